"""The node agent and the dashboard stop within a second of being told to, even with NATS gone
(killed) or frozen (a partition: the connection looks alive, nothing answers), as the deciders do
(tests/integration/test_shutdown_without_nats.py). What they could not clean up, the server does:
the agent's node leadership expires when not renewed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from gpuherd.log import EventLog, open_log
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.natsd import NatsServer
from services.nodeagent.agent import Agent
from services.nodeagent.executors.sim import SimExecutor

pytestmark = pytest.mark.timeout(60)

STOPS_WITHIN_S = 1.0


async def stopped_within(task: asyncio.Task[None], stop: asyncio.Event) -> float:
    """Set ``stop``; the seconds ``task`` took to end (it fails the test after 5 s)."""
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(asyncio.shield(task), 5.0)
    return time.monotonic() - started


async def end(task: asyncio.Task[None], stop: asyncio.Event, log_: EventLog) -> None:
    stop.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert isinstance(log_, JetStreamLog)
    with contextlib.suppress(ConnectionError):  # (its unsent bytes, NATS being gone)
        await log_.nc.close()  # not drained, which NATS gone refuses: it would go on reconnecting


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
    acquired = asyncio.Event()
    leadership_of = log_.leadership

    def leadership(name: str, holder: str) -> Any:
        lead = leadership_of(name, holder)
        try_acquire = lead.try_acquire

        async def acquire_then_outage() -> bool:
            ok = await try_acquire()
            if ok:
                local_nats.kill()  # NATS goes as the agent is about to load its snapshot
                acquired.set()
            return ok

        lead.try_acquire = acquire_then_outage  # type: ignore[method-assign]
        return lead

    log_.leadership = leadership  # type: ignore[method-assign]
    agent = Agent(log_, "n1", SimExecutor(gpus=2), heartbeat_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(acquired.wait(), 15)
        await asyncio.sleep(0.3)
        assert await stopped_within(task, stop) < STOPS_WITHIN_S  # its snapshot load retried for 60 s
    finally:
        await end(task, stop, log_)
