"""A runner told to stop stops at once, whatever it waits for: NATS going away just as it takes the
lead left it retrying its fence (for an hour), outside of anything that listened for the stop; and
its loops end even when one of them swallows a cancellation."""

from __future__ import annotations

import asyncio
import contextlib

from gpuherd.aio import STOP_LOOPS_S, run_until_stopped
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


async def test_loops_stop_even_when_one_swallows_a_cancellation() -> None:
    """A retry loop that takes one cancellation for a failure and goes on (Python 3.11's wait_for
    returns a timeout that came with the cancellation: a scheduler stopped with SIGTERM went on
    retrying its replay consumer for over an hour) is cancelled again: the loops end at once."""
    swallowed: list[int] = []

    async def retries_on() -> None:
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # (taken for a failed attempt: tried again)

    async def steady() -> None:
        await asyncio.Event().wait()

    stop = asyncio.Event()
    stop.set()
    await asyncio.wait_for(run_until_stopped({"retries": retries_on(), "steady": steady()}, stop), 2.0)
    assert swallowed == [1], "the loop did not swallow a cancellation: the test tested nothing"


async def test_a_loop_that_never_ends_is_left_after_a_while_not_waited_for_forever() -> None:
    ending = asyncio.Event()

    async def never_ends() -> None:
        while not ending.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)

    stop = asyncio.Event()
    stop.set()
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(run_until_stopped({"never": never_ends()}, stop), 2.0 + STOP_LOOPS_S)
    assert asyncio.get_running_loop().time() - started >= STOP_LOOPS_S * 0.9
    ending.set()
    for task in asyncio.all_tasks():
        if task.get_name() == "never":
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
