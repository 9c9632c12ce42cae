"""A runner told to stop stops at once, whatever it waits for: NATS going away just as it takes the
lead left it retrying its fence (for an hour), outside of anything that listened for the stop."""

from __future__ import annotations

import asyncio

from gpuherd.log import InProcessLog
from gpuherd.runtime.runner import DeciderRunner
from services.scheduler.decide import SchedulerDecider


class GoneAfterLeadership(InProcessLog):
    """The log stops answering once the leadership is taken (each question waits for ever)."""

    def __init__(self) -> None:
        super().__init__(duplicate_window=0)
        self.acquired = asyncio.Event()

    async def subject_last_seq(self, subject: str) -> int:
        self.acquired.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_runner_stopped_while_it_fences_its_leadership_returns_at_once() -> None:
    log = GoneAfterLeadership()
    runner = DeciderRunner(log, SchedulerDecider(), instance="a")
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await asyncio.wait_for(log.acquired.wait(), 5)
        stop.set()
        await asyncio.wait_for(asyncio.shield(task), 1.0)
        assert "decider.scheduler" not in log._leaderships, "released on the way out"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
