"""A snapshot folded beyond the log's head (HERD recreated, or restored from an older backup, while
the snapshot bucket survived) describes another log: the runner must not trust it."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from gpuherd.log import InProcessLog
from gpuherd.runtime.core import DecisionCore
from gpuherd.runtime.runner import DeciderRunner
from gpuherd.runtime.snapshots import save_snapshot
from services.scheduler.decide import SchedulerDecider
from tests.helpers import node, until


async def test_a_snapshot_beyond_the_logs_head_is_dropped_and_the_state_rebuilt_from_the_log() -> None:
    log = InProcessLog(duplicate_window=0)
    await log.append([node("n1", 2)])
    decider = SchedulerDecider()
    ahead = decider.initial_state()
    ahead.seq = 50_000_000  # folded from a log far longer than this one
    await save_snapshot(log, decider.name, decider.STATE_FORMAT, ahead.seq, decider.encode_state(ahead))
    runner = DeciderRunner(log, decider, instance="a")
    stop = asyncio.Event()
    with capture_logs() as logs:
        task = asyncio.create_task(runner.run(stop))
        try:
            await until(runner.caught_up.is_set)
            await log.append([node("n2", 2)])  # appended afterwards: it must be folded too
            await until(lambda: "n2" in runner.state.nodes, timeout=2)
            assert "n1" in runner.state.nodes, "rebuilt from the start of the log"
            assert runner.state.seq == await log.last_seq()
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
    warnings = [entry for entry in logs if entry["log_level"] == "warning" and entry.get("snapshot_seq") == ahead.seq]
    assert warnings, "the operator is told why the snapshot was dropped"
    assert warnings[0]["head"] == 2  # the node, and the runner's fence as it began to lead


def test_the_core_refuses_to_catch_up_to_a_head_behind_its_state() -> None:
    core = DecisionCore(SchedulerDecider())
    core.state.seq = 10
    with pytest.raises(ValueError, match="beyond the log's head"):
        core.catch_up(3)  # it would wait past the head and say it is caught up
    core.catch_up(10)
    assert core.caught_up
