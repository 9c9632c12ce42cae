"""The node agent and the dashboard stop within a second of being told to, even with NATS gone
(killed) or frozen (a partition: the connection looks alive, nothing answers), as the deciders do
(tests/integration/test_shutdown_without_nats.py). What they could not clean up, the server does:
the agent's node leadership expires when not renewed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from gpuherd.log import open_log
from gpuherd.natsd import NatsServer
from services.nodeagent.agent import Agent
from services.nodeagent.executors.sim import SimExecutor
from tests.integration.procs import FAST_ENV
from tests.integration.stopping import (
    STOPS_WITHIN_S,
    end,
    outage_once_lead_is_taken,
    sigterm_with_nats_away,
    stopped_within,
)

pytestmark = pytest.mark.timeout(60)


async def test_an_agent_stopped_with_nats_gone_ends_within_a_second(local_nats: NatsServer) -> None:
    log_ = await open_log(local_nats.url, name="stop-agent")
    agent = Agent(log_, "n1", SimExecutor(gpus=2), heartbeat_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(agent.caught_up.wait(), 15)
        local_nats.kill()
        await asyncio.sleep(0.3)  # the client has seen the connection drop
        assert await stopped_within(task, stop) < STOPS_WITHIN_S  # it waited 2 s to release its node
    finally:
        await end(task, stop, log_)


async def test_an_agent_stopped_as_it_takes_its_node_with_nats_gone_ends_within_a_second(
    local_nats: NatsServer,
) -> None:
    log_ = await open_log(local_nats.url, name="stop-agent-taking-node")
    acquired = outage_once_lead_is_taken(log_, local_nats)  # NATS goes as the agent is about to load its snapshot
    agent = Agent(log_, "n1", SimExecutor(gpus=2), heartbeat_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(acquired.wait(), 15)
        await asyncio.sleep(0.3)
        assert await stopped_within(task, stop) < STOPS_WITHIN_S  # its snapshot load retried for 60 s
    finally:
        await end(task, stop, log_)


def agent_argv(url: str, tmp_path: Path) -> list[str]:
    return [
        *("-m", "services.nodeagent", "--nats-url", url, "--node", "n1", "--gpus", "2", "--executor", "sim"),
        *("--data-dir", str(tmp_path / "agents" / "n1"), "--heartbeat", "0.5"),
    ]


def dashboard_argv(url: str, tmp_path: Path) -> list[str]:
    return [
        *("-m", "apps", "serve", "dashboard", "--nats-url", url, "--port", "0"),
        *("--report-dir", str(tmp_path), "--url-file", str(tmp_path / "dashboard.url")),
    ]


# What each process prints once it serves (it is then connected, and has read the empty log), and
# whether a page stays open on it (a dashboard's event stream, which never ends by itself).
PROCESSES = {
    "agent": (agent_argv, b'"registered"', False),
    "dashboard": (dashboard_argv, b'"dashboard serving"', False),
    "dashboard-page-open": (dashboard_argv, b'"dashboard serving"', True),
}


@pytest.mark.parametrize("outage", ["killed", "frozen"])
@pytest.mark.parametrize("service", sorted(PROCESSES))
async def test_an_agent_or_dashboard_process_ends_within_a_second_of_sigterm_with_nats_away(
    service: str, outage: str, local_nats: NatsServer, tmp_path: Path
) -> None:
    server = local_nats
    argv_of, serving, page_open = PROCESSES[service]
    output = tmp_path / f"{service}.log"
    with output.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, *argv_of(server.url, tmp_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **FAST_ENV},
        )
    browser = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        deadline = time.monotonic() + 30
        while serving not in output.read_bytes():
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()[-2000:]
            await asyncio.sleep(0.1)
        if page_open:
            page = await browser.get((tmp_path / "dashboard.url").read_text() + "api/stream")
            assert b"event: change" in await page.content.readline()
        await asyncio.sleep(0.5)  # its loops have begun
        await sigterm_with_nats_away(process, server, outage, output, wait_s=20)
    finally:
        await browser.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)  # so that the fixture's stop is answered at once
