"""A rollback of a shrink names the workers that left at its switch again, as joiners; the node agent
starts new workers on their GPUs once they have left (``left-<gpu>.json``). When the rollback reached
the agent before a leaving worker had left, reconciling it started nothing there, and nothing made
the agent look again until the job's next event (the rollback's own ``reform_timeout_s`` failure).
The worker's 'left' datagram now makes the agent reconcile the job, so the joiner starts at once."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from gpuherd import jobenv
from gpuherd.control import RescaleReport
from gpuherd.jobenv import ElasticPlan
from gpuherd.log import InProcessLog
from gpuherd.train.elastic.membership import Membership
from services.nodeagent import taskfiles
from services.nodeagent.agent import Agent
from services.nodeagent.control_socket import ControlSocket
from services.nodeagent.executors.base import TaskKey, TaskLaunch
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.messages import JobMessages
from services.nodeagent.reconcile import AgentEvents
from services.nodeagent.taskfiles import GrowRequest, ProcLaunch, TaskDescription
from services.nodeagent.writer import AgentWriter
from tests.helpers import until
from tests.unit.test_rollback_to_workers_that_left import _agent_state, _rolled_back

pytestmark = pytest.mark.timeout(30)

KEY = TaskKey("j", 0)


def _worker(folder: Path, gpu: int, generation: int) -> ProcLaunch:
    return ProcLaunch(
        argv=[sys.executable], env={}, log=str(folder / f"worker-{gpu}.log"), gpu=gpu, generation=generation
    )


class _RunningTask(CpuExecutor):
    """j's task runs here, its folder as the executor keeps it; a grow is written down as the
    executor asks the task's shim for one (no shim runs: nothing is started)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, gpus=4, alive_file=root / "alive")
        self.grown: list[tuple[int, ...]] = []
        folder = self.task_dir(KEY)
        folder.mkdir(parents=True)
        procs = [_worker(folder, gpu, 0) for gpu in (0, 1, 2)]
        description = TaskDescription(
            procs=procs, alive_file=str(root / "alive"), fence_after_s=60.0, kill_grace_s=1.0, elastic=True
        )
        taskfiles.write(folder / taskfiles.TASK_FILE, description)

    def running(self) -> set[TaskKey]:
        return {KEY}

    def grow(self, key: TaskKey, launch: TaskLaunch) -> bool:
        folder = self.task_dir(key)
        number = len(list(folder.glob(taskfiles.GROWN_PATTERN)))
        procs = [_worker(folder, gpu, launch.generation) for gpu in launch.gpus]
        taskfiles.write(folder / f"grow-{number:04d}.json", GrowRequest(procs=procs))
        self.grown.append(launch.gpus)
        return True


class _OnePlan:
    def __init__(self, plan: ElasticPlan) -> None:
        self.plan = plan

    def latest(self) -> ElasticPlan | None:
        return self.plan


def _leave(worker: str, folder: Path, agent_addr: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker`` leaves at the switch to the shrink (generation 2), as the runtime does it: its
    report left in the task's folder, then its datagram to the agent."""
    with monkeypatch.context() as env:
        env.setenv(jobenv.TASK_DIR, str(folder))
        env.setenv(jobenv.AGENT_ADDR, agent_addr)
        env.setenv(jobenv.JOB_ID, "j")
        env.setenv(jobenv.ATTEMPT, "0")
        env.setenv(jobenv.ELASTIC_WORKER, worker)
        plan = ElasticPlan(generation=2, workers=("n1/0",), addr="127.0.0.1", port=29500, source="n1/0")
        membership = Membership(worker, _OnePlan(plan))
        membership._leave(plan)
    assert membership.left


async def test_a_workers_left_datagram_starts_the_rollbacks_joiner_on_its_gpu_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = _RunningTask(tmp_path)
    agent = Agent(InProcessLog(duplicate_window=0), "n1", executor)
    address = f"unix-abstract:gpuherd-test-left-{os.getpid()}-{time.monotonic_ns()}"
    control = ControlSocket(address, agent.messages.on_message)
    await control.start()
    try:
        agent.state = _agent_state(_rolled_back("failed"))  # generation 3: back to n1/0,1,2
        agent.caught_up.set()
        # The rollback reached the agent before n1/1 and n1/2 left: their workers are still there.
        await agent.reconcile("j")
        assert executor.grown == []

        _leave("n1/1", executor.task_dir(KEY), address, monkeypatch)
        await until(lambda: executor.grown == [(1,)], timeout=5)
        _leave("n1/2", executor.task_dir(KEY), address, monkeypatch)
        await until(lambda: executor.grown == [(1,), (2,)], timeout=5)
        await agent.settled()
        assert executor.grown == [(1,), (2,)], "each joiner is started once"
    finally:
        control.close()


def test_only_a_left_of_the_jobs_current_attempt_asks_for_a_reconcile() -> None:
    state = _agent_state(_rolled_back("failed"))
    asked: list[str] = []
    writer = AgentWriter(InProcessLog(duplicate_window=0), AgentEvents("n1"), time.time)
    messages = JobMessages("n1", lambda: state, None, writer, None, reconcile_job=asked.append)  # type: ignore[arg-type]
    for attempt, event in ((0, "left"), (1, "left"), (0, "peer-lost")):
        messages.on_message(RescaleReport(job="j", attempt=attempt, event=event, generation=2))  # type: ignore[arg-type]
    messages.on_message(RescaleReport(job="gone", attempt=0, event="left", generation=2))
    assert asked == ["j"]


async def test_a_left_before_the_agent_caught_up_waits_for_the_catch_ups_reconcile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = _RunningTask(tmp_path)
    agent = Agent(InProcessLog(duplicate_window=0), "n1", executor)
    agent.state = _agent_state(_rolled_back("failed"))  # (folded so far: the log may say more)
    nobody = f"unix-abstract:gpuherd-test-nobody-{os.getpid()}-{time.monotonic_ns()}"
    _leave("n1/1", executor.task_dir(KEY), nobody, monkeypatch)
    agent.messages.on_message(RescaleReport(job="j", attempt=0, event="left", generation=2))
    await asyncio.sleep(0)
    await agent.settled()
    assert executor.grown == [], "a partial state is no ground to act on"
    agent.caught_up.set()
    await agent.reconcile("j")  # (as the catch-up reconciles every job)
    assert executor.grown == [(1,)]
