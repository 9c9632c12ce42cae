"""A service's timer, live: time reaches its decider as a tick event of its own type, appended once
the runner has caught up, so time-based decisions replay exactly. The simulator ticks the same
types on its virtual clock (``apps/sim``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from gpuherd import events as ev
from gpuherd.runtime.runner import DeciderRunner, ExtraTask


def tick_event(kind: type[ev.Tick], service: str, now: float) -> ev.Tick:
    """The tick ``kind`` of ``service`` at ``now`` (its id names the moment: written once)."""
    return kind(id=f"{service}:tick:{now:.3f}", at=now, source=service)


def clock_ticker(
    kind: type[ev.Tick],
    every_s: float,
    *,
    needed: Callable[[Any], bool] = lambda state: True,
    due: Callable[[Any], float | None] | None = None,
) -> ExtraTask:
    """A runner task that appends a ``kind`` tick every ``every_s`` seconds while ``needed(state)``
    says a time-based decision may be due (a memory broker with no lease needs none), or once
    ``due(state)`` (when a decision next falls due) has come: looked at every ``every_s``."""

    async def tick(runner: DeciderRunner[Any]) -> None:
        await runner.caught_up.wait()
        while True:
            await asyncio.sleep(every_s)
            now = time.time()
            at = due(runner.state) if due is not None else None
            if needed(runner.state) or (at is not None and at <= now):
                await runner.append_input([tick_event(kind, runner.name, now)])  # fenced

    return tick
