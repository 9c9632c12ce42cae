"""The node agent when a task cannot even be launched: the failure is its end, at once."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gpuherd import events as ev
from gpuherd.log import InProcessLog
from services.nodeagent.agent import Agent
from services.nodeagent.executors import TaskLaunch
from services.nodeagent.executors.sim import SimExecutor
from services.nodeagent.state import evolve
from tests.helpers import node, submit

pytestmark = pytest.mark.timeout(30)


class UnlaunchableExecutor(SimExecutor):
    """An executor whose every launch raises (no fork, a full disk), counting the tries."""

    def __init__(self) -> None:
        super().__init__(gpus=2)
        self.launches: list[TaskLaunch] = []

    async def start(self, launch: TaskLaunch) -> None:
        self.launches.append(launch)
        raise OSError("cannot fork")


async def test_a_launch_that_raises_is_not_launched_again_before_its_failure_is_read_back() -> None:
    log = InProcessLog()
    executor = UnlaunchableExecutor()
    agent = Agent(log, "n1", executor)
    seqs = itertools.count(1)
    placed = ev.JobPlaced(id="p-j", at=1.0, job="j", attempt=0, allocations=(ev.Allocation("n1", (0,)),))
    for event in (node("n1", 2), submit("j"), placed):
        evolve(agent.state, next(seqs), event)

    await asyncio.wait_for(agent.reconcile("j"), 10)
    # The agent's JobStarted is read back before its TaskEnded (the follow loop is behind the
    # writes): the reconcile it triggers must not launch the part again.
    (started,) = [r.event for r in log._records if isinstance(r.event, ev.JobStarted)]
    evolve(agent.state, next(seqs), started)
    await asyncio.wait_for(agent.reconcile("j"), 10)

    assert len(executor.launches) == 1, "launched once, not again before its failure was read back"
    (failed,) = [r.event for r in log._records if isinstance(r.event, ev.TaskEnded)]
    assert failed.outcome == "failed" and "cannot fork" in failed.reason
