"""Powering the node down and up for cluster energy saving: the reconcile step says what
(``reconcile.power``), the hook (``--power-hook CMD``, run as ``CMD down|up NODE``) does the real
switching, and the agent records what happened. A failed power-down keeps the node in service,
which loses nothing."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable

from gpuherd import events as ev
from gpuherd.obs import get_logger
from services.nodeagent.reconcile import power
from services.nodeagent.state import AgentState
from services.nodeagent.writer import AgentWriter

log = get_logger("gpuherd.nodeagent")


class PowerSwitch:
    def __init__(self, node: str, state: Callable[[], AgentState], writer: AgentWriter, hook: str | None) -> None:
        self.node = node
        self._state = state
        self.writer = writer
        self.hook = hook
        self._task: asyncio.Task[None] | None = None

    def kick(self) -> None:
        """Carry out a power request soon (one at a time)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._carry_out(), name="power")

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _carry_out(self) -> None:
        state = self._state()
        move = power(state, self.node)
        if move is None:
            return
        ok = await self._run_hook(move.action)
        kind = ev.NodePoweredUp if move.action == "up" or not ok else ev.NodePoweredDown
        await self.writer.append(kind(**self.writer.stamp(f"power-{kind.__name__}", str(state.seq)), node=self.node))
        log.info("power state changed", recorded=kind.__name__)

    async def _run_hook(self, action: str) -> bool:
        if not self.hook:
            return True  # no hook: the node is only marked (it takes no work while off)
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(self.hook),
            action,
            self.node,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await proc.communicate()
        if proc.returncode != 0:
            log.error("power hook failed", action=action, code=proc.returncode, output=output.decode()[-500:])
            return False
        return True
