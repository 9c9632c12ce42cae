"""``serve_until_signal``: SIGTERM and SIGINT stop what it runs, and act as before once it returns."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gpuherd.aio import serve_until_signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def test_a_signal_stops_the_run_and_the_handlers_are_given_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    stopped: list[bool] = []

    async def run(stop: asyncio.Event) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # set stop, not end the process
        await asyncio.wait_for(stop.wait(), 5)
        stopped.append(True)

    await serve_until_signal(run)
    assert stopped == [True]
    # A process forked later (a sweep's run, Ctrl-C'd) must not inherit a handler that only sets
    # this run's flag: it would go on after Ctrl-C.
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before


async def test_the_handlers_are_given_back_when_the_run_fails() -> None:
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}

    async def run(stop: asyncio.Event) -> None:
        raise RuntimeError("broken on purpose")

    with pytest.raises(RuntimeError, match="broken on purpose"):
        await serve_until_signal(run)
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
