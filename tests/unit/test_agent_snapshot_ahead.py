"""A node agent's snapshot folded beyond the log's head (HERD recreated, or restored from an older
backup, while the snapshot bucket survived) describes another log: the agent must not trust it."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from structlog.testing import capture_logs

from gpuherd.log import InProcessLog
from gpuherd.runtime.snapshots import save_snapshot
from services.nodeagent.agent import Agent
from services.nodeagent.executors.sim import SimExecutor
from services.nodeagent.state import STATE_FORMAT, new_state
from tests.helpers import node, until

pytestmark = pytest.mark.timeout(30)


async def test_an_agent_snapshot_beyond_the_logs_head_is_dropped_and_the_state_rebuilt_from_the_log() -> None:
    log = InProcessLog(duplicate_window=0)
    ahead = new_state("n1")
    ahead.seq = 50_000_000  # folded from a log far longer than this one
    await save_snapshot(log, "agent.n1", STATE_FORMAT, ahead.seq, msgspec.msgpack.encode(ahead))
    agent = Agent(log, "n1", SimExecutor(gpus=2))
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(agent.run(stop))
        try:
            await until(agent.caught_up.is_set)
            await log.append([node("n2", 2)])  # appended afterwards: it must be folded too
            await until(lambda: agent.state.seq == 2, timeout=2)  # it waited for sequence 50,000,001
            assert agent.state.me is not None, "its own registration, folded from the start of the log"
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
    warnings = [entry for entry in logs if entry["log_level"] == "warning" and entry.get("snapshot_seq") == ahead.seq]
    assert warnings, "the operator is told why the snapshot was dropped"
    assert warnings[0]["key"] == "agent.n1"
