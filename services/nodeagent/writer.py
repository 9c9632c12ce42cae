"""How a node's agent writes to the log: events stamped by ``AgentEvents`` (ids derived from what
they are about, so a repeat after a crash changes nothing: the log drops it, or every reader
folds its second copy as nothing new), appended at once or in the background:
through a report relay where one answers (stored with other agents' reports in one commit), else
by the agent itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gpuherd import events as ev
from gpuherd.log import EventStore
from gpuherd.log.relay import RelayClient
from gpuherd.runtime.runner import append_reliably
from services.nodeagent.reconcile import AgentEvents


class AgentWriter:
    def __init__(
        self, log: EventStore, events: AgentEvents, clock: Callable[[], float], relay: RelayClient | None = None
    ) -> None:
        self.log = log
        self.events = events
        self.clock = clock
        self.relay = relay
        self._background: set[asyncio.Task[Any]] = set()

    def stamp(self, kind: str, *parts: str) -> dict[str, Any]:
        """id, at and source of an event this agent writes."""
        return self.events.stamp(kind, *parts, at=self.clock())

    async def append(self, event: ev.Event, trace: str | None = None) -> None:
        if self.relay is not None and await self.relay.store(event, trace):
            return
        await append_reliably(self.log, [event], trace=trace)

    def append_soon(self, event: ev.Event) -> None:
        """Append in the background (from a callback that cannot wait)."""
        self.soon(self.append(event))

    def soon(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def cancel(self) -> None:
        for task in list(self._background):
            task.cancel()
