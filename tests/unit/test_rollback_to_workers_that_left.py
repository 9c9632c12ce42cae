"""A rollback of a shrink names the workers that left at the shrink's switch again, as joiners (the
scheduler rolls back to the last completed generation's workers whose GPUs the job still holds).
Those workers' processes are gone: the node agent must start new ones on their GPUs, which take the
source's state as every joiner does. Before, it started workers only on GPUs that never had one, so
the rollback's rank 0 waited for joiners that never came, and the job sat until the scheduler's
``rescale_timeout_s`` rolled it back again, to the same workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd import jobenv
from gpuherd.jobenv import ElasticPlan
from gpuherd.log import Record
from gpuherd.train.elastic.membership import Membership
from gpuherd.train.report import left_file
from services.nodeagent import taskfiles
from services.nodeagent.executors.base import TaskKey, TaskWorkers
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.reconcile import AgentEvents, StartWorkers, Tasks, WritePlan, reconcile
from services.nodeagent.state import AgentState, evolve, new_state
from services.nodeagent.taskfiles import GrowRequest, ProcLaunch, TaskDescription
from tests.helpers import tick
from tests.unit.test_resize import _e, _resized
from tests.unit.test_scheduler_decider import drive
from tests.unit.test_scheduling_rules_12 import _shrink_never_reported

KEY = TaskKey("j", 0)


def _rolled_back(how: str) -> list[Record]:
    """j ran on n1/0,1,2 (committed, generation 1); a shrink to n1/0 (generation 2) let n1/1 and
    n1/2 go; then the scheduler rolls it back: its new group failed to form, or it was never
    reported done within ``rescale_timeout_s``."""
    log = _shrink_never_reported(ev.SCHEDULING_RULES)
    if how == "failed":
        failed = _e(ev.RescaleFailed, job="j", attempt=0, generation=2, node="n1", reason="re-form timed out")
        log = drive([failed], log)
    else:
        log = drive([tick(1901.0, lost_after=1e9)], log)
    rollback = _resized(log)[-1]
    assert rollback.kind == "rollback" and rollback.generation == 3
    assert rollback.allocations == (ev.Allocation("n1", (0, 1, 2)),) and rollback.joiners == ("n1/1", "n1/2")
    return log


def _agent_state(log: list[Record]) -> AgentState:
    state = new_state("n1")
    for record in log:
        evolve(state, record.seq, record.event)
    return state


def _act(state: AgentState, workers: TaskWorkers) -> list:
    tasks = Tasks({KEY}, set(), {}, workers={KEY: workers}, planned={KEY: state.jobs["j"].generation})
    return reconcile(state, "n1", "j", tasks, 2000.0, AgentEvents("n1"), simulated=False)


def _worker(task_dir: Path, gpu: int, generation: int) -> ProcLaunch:
    return ProcLaunch(
        argv=[sys.executable], env={}, log=str(task_dir / f"worker-{gpu}.log"), gpu=gpu, generation=generation
    )


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    """j's task folder on n1, as the cpu executor keeps it: its three workers started in generation 0."""
    folder = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive").task_dir(KEY)
    folder.mkdir(parents=True)
    description = TaskDescription(
        procs=[_worker(folder, gpu, 0) for gpu in (0, 1, 2)],
        alive_file=str(tmp_path / "alive"),
        fence_after_s=60.0,
        kill_grace_s=1.0,
        elastic=True,
    )
    taskfiles.write(folder / taskfiles.TASK_FILE, description)
    return folder


class _OnePlan:
    def __init__(self, plan: ElasticPlan) -> None:
        self.plan = plan

    def latest(self) -> ElasticPlan | None:
        return self.plan


def _leave(worker: str, generation: int, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker`` leaves at the switch to ``generation``, as the runtime does it, in its own environment
    (no agent listens: the datagram is lost, only the task folder keeps its word)."""
    with monkeypatch.context() as env:
        env.setenv(jobenv.TASK_DIR, str(task_dir))
        env.setenv(jobenv.AGENT_ADDR, f"unix-abstract:gpuherd-test-nobody-{task_dir.parent.name}")
        env.setenv(jobenv.JOB_ID, "j")
        env.setenv(jobenv.ATTEMPT, "0")
        env.setenv(jobenv.ELASTIC_WORKER, worker)
        plan = ElasticPlan(generation=generation, workers=("n1/0",), addr="127.0.0.1", port=29500, source="n1/0")
        membership = Membership(worker, _OnePlan(plan))
        membership._leave(plan)
    assert membership.left


@pytest.mark.parametrize("how", ["failed", "overdue"])
def test_a_rollback_naming_workers_that_left_gets_new_workers_on_their_gpus(
    how: str, tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _agent_state(_rolled_back(how))
    executor = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive")
    assert [a for a in _act(state, executor.workers(KEY)) if isinstance(a, StartWorkers)] == [], (
        "while the workers of GPUs 1 and 2 are still there, none is started beside them"
    )
    for worker in ("n1/1", "n1/2"):
        _leave(worker, 2, task_dir, monkeypatch)
    starts = [a for a in _act(state, executor.workers(KEY)) if isinstance(a, StartWorkers)]
    assert [s.launch.gpus for s in starts] == [(1, 2)], "the joiners whose workers left get new ones"
    assert starts[0].launch.key == KEY and starts[0].launch.generation == 3
    # They start as joiners of the rollback, which the plan the agent hands out says.
    fresh = state.jobs["j"].plan()
    assert fresh is not None and fresh.joiners == ("n1/1", "n1/2") and fresh.source == "n1/0"

    # Once started (in generation 3), they are the GPUs' workers: not started again.
    taskfiles.write(task_dir / "grow-0000.json", GrowRequest(procs=[_worker(task_dir, 1, 3), _worker(task_dir, 2, 3)]))
    workers = executor.workers(KEY)
    assert workers.launched == {0, 1, 2} and workers.left == frozenset()
    assert [a for a in _act(state, workers) if isinstance(a, StartWorkers | WritePlan)] == []


def test_only_the_current_worker_of_a_gpu_counts_as_left(
    tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive")
    _leave("n1/1", 2, task_dir, monkeypatch)
    assert (task_dir / left_file(1)).exists()
    assert executor.workers(KEY).left == {1}
    # A worker of GPU 1 started in generation 5 (the job grew back onto it) that left at 7 has left;
    # the one started in 5 has not left at 2 (that was its predecessor).
    taskfiles.write(task_dir / "grow-0000.json", GrowRequest(procs=[_worker(task_dir, 1, 5)]))
    assert executor.workers(KEY).left == frozenset()
    _leave("n1/1", 7, task_dir, monkeypatch)
    assert executor.workers(KEY).left == {1}
    (task_dir / left_file(1)).write_text("not a report")
    assert executor.workers(KEY).left == frozenset(), "an unreadable report is no word"


def test_a_grow_back_onto_a_gpu_whose_worker_left_at_a_completed_shrink_starts_a_worker_there(
    tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _shrink_never_reported(ev.SCHEDULING_RULES)
    _leave("n1/1", 2, task_dir, monkeypatch)
    _leave("n1/2", 2, task_dir, monkeypatch)
    log = drive([_e(ev.RescaleCompleted, job="j", attempt=0, generation=2, node="n1", world=1, world_before=3)], log)
    log = drive([_e(ev.RescaleProposed, at=300.0, job="j", attempt=0, generation=2, gpus=2)], log)
    grow = _resized(log)[-1]
    assert grow.kind == "grow" and grow.allocations == (ev.Allocation("n1", (0, 1)),) and grow.joiners == ("n1/1",)
    workers = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive").workers(KEY)
    starts = [a for a in _act(_agent_state(log), workers) if isinstance(a, StartWorkers)]
    assert [s.launch.gpus for s in starts] == [(1,)], "else the grow waits for a joiner that never starts"
