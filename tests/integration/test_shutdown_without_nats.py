"""A decider stops within a second of being told to, even with NATS gone (killed) or frozen (a
partition: the connection looks alive, nothing answers). What it could not clean up, the server
does: the reader's consumer expires when inactive, the leadership when not renewed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuherd.log import open_log
from gpuherd.natsd import NatsServer
from gpuherd.runtime.runner import DeciderRunner
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import FAST_ENV
from tests.integration.stopping import (
    STOPS_WITHIN_S,
    end,
    outage_once_lead_is_taken,
    sigterm_with_nats_away,
    stopped_within,
)


async def test_a_leader_stopped_with_nats_gone_ends_within_a_second(local_nats: NatsServer) -> None:
    log_ = await open_log(local_nats.url, name="stop-leader")
    runner = DeciderRunner(log_, SchedulerDecider(), instance="a")
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await asyncio.wait_for(runner.caught_up.wait(), 15)
        local_nats.kill()
        await asyncio.sleep(0.3)  # the client has seen the connection drop
        assert await stopped_within(task, stop) < STOPS_WITHIN_S  # it waited 5 s + 2 s for NATS
    finally:
        await end(task, stop, log_)


async def test_a_runner_stopped_as_it_takes_the_lead_with_nats_gone_ends_within_a_second(
    local_nats: NatsServer,
) -> None:
    log_ = await open_log(local_nats.url, name="stop-taking-lead")
    acquired = outage_once_lead_is_taken(log_, local_nats)  # NATS goes as it is about to append its fence
    runner = DeciderRunner(log_, SchedulerDecider(), instance="a")
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await asyncio.wait_for(acquired.wait(), 15)
        await asyncio.sleep(0.3)
        assert await stopped_within(task, stop) < STOPS_WITHIN_S  # its fence waited for NATS for an hour
    finally:
        await end(task, stop, log_)


@pytest.mark.parametrize("outage", ["killed", "frozen"])
async def test_a_decider_process_ends_within_a_second_of_sigterm_with_nats_away(
    outage: str, local_nats: NatsServer, tmp_path: Path
) -> None:
    server = local_nats
    output = tmp_path / "scheduler.log"
    argv = [sys.executable, "-m", "services.scheduler", "--nats-url", server.url, "--instance", "a"]
    with output.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **FAST_ENV})
    try:
        deadline = time.monotonic() + 30
        while b"caught up" not in output.read_bytes():
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()[-2000:]
            await asyncio.sleep(0.1)
        await sigterm_with_nats_away(process, server, outage, output, wait_s=15)  # it took 7.5 s killed, 12.5 s frozen
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)  # so that the fixture's stop is answered at once
