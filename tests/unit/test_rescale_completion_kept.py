"""A rescale's completion reported while the agent restarts: the worker's datagram is lost, but the
report is also left in the task's folder, where the agent finds it and records the completion it
missed (once: the id is the datagram's event's), so the scheduler never rolls back a rescale that
happened."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuherd import control, jobenv
from gpuherd import events as ev
from gpuherd.train.report import RESCALE_COMPLETED_FILE, send
from services.nodeagent.executors.base import TaskKey, TaskWorkers
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.reconcile import AgentEvents, Record, Tasks, reconcile
from services.nodeagent.state import AgentState, evolve, new_state
from tests.helpers import node

KEY = TaskKey("j", 0)
RENDEZVOUS = ev.Rendezvous("127.0.0.1", 29500)


def shrunk_not_reported() -> AgentState:
    """j ran on n1/0,1,2; a shrink to n1/0 (generation 1) is in flight: n1/1 and n1/2 left."""
    spec = ev.JobSpec(name="j", user="u", gpus=3, command=(sys.executable, "train.py"), elastic=ev.Elastic(1, 3))
    three, one = (ev.Allocation("n1", (0, 1, 2)),), (ev.Allocation("n1", (0,)),)
    history = [
        node("n1", 4, executor="cpu"),
        ev.JobSubmitted(id="s", job="j", spec=spec, intake_source="t"),
        ev.JobPlaced(id="p", at=1.0, job="j", attempt=0, allocations=three, rendezvous=RENDEZVOUS),
        ev.JobStarted(id="st", at=2.0, job="j", attempt=0, node="n1"),
        ev.JobResized(
            id="r", at=100.0, job="j", attempt=0, generation=1, allocations=one, rendezvous=RENDEZVOUS,
            state_from="n1/0", releasing=(ev.Allocation("n1", (1, 2)),), kind="shrink",
        ),
    ]  # fmt: skip
    state = new_state("n1")
    for seq, event in enumerate(history, 1):
        evolve(state, seq, event)
    assert state.jobs["j"].rescale == "shrink"
    return state


def act(state: AgentState, tasks: Tasks) -> list:
    return reconcile(state, "n1", "j", tasks, 150.0, AgentEvents("n1"), simulated=False)


@pytest.fixture
def task_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The task's folder, as the new rank 0 of ``j`` sees its environment; no agent listens."""
    folder = tmp_path / "jobs" / "j" / "attempt-0"
    folder.mkdir(parents=True)
    monkeypatch.setenv(jobenv.TASK_DIR, str(folder))
    monkeypatch.setenv(jobenv.AGENT_ADDR, f"unix-abstract:gpuherd-test-nobody-{tmp_path.name}")
    monkeypatch.setenv(jobenv.JOB_ID, "j")
    monkeypatch.setenv(jobenv.ATTEMPT, "0")
    return folder


def completed(generation: int, **fields: object) -> bool:
    times = {"decided": 100.0, "noticed": 100.5, "first_step": 102.0}
    sent = dict(event="completed", generation=generation, world=1, world_before=3, times=times) | fields
    return send(control.RescaleReport, **sent)


def test_a_completion_reported_while_the_agent_restarts_is_recorded_from_the_task_s_folder(
    tmp_path: Path, task_dir: Path
) -> None:
    assert not completed(1), "no agent listens: the datagram is lost"
    ex = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive")
    workers = ex.workers(KEY)
    assert workers.rescaled is not None and workers.rescaled.generation == 1
    state = shrunk_not_reported()
    # The agent's reconcile, adopting the task after its restart and once it runs again.
    for tasks in (Tasks(set(), set(), {}, workers={KEY: workers}), Tasks({KEY}, set(), {}, workers={KEY: workers})):
        done = [a.event for a in act(state, tasks) if isinstance(a, Record)]
        assert len(done) == 1 and isinstance(done[0], ev.RescaleCompleted)
        assert done[0].id == "agent.n1:rescaled:j:0:1", "the datagram's event's id: recorded once"
        assert (done[0].generation, done[0].world, done[0].world_before) == (1, 1, 3)
        assert done[0].times["decided"] == 100.0 and done[0].times["first_step"] == 102.0
    evolve(state, 100, done[0])
    assert state.jobs["j"].rescale is None and state.jobs["j"].held == 1
    assert not any(isinstance(a, Record) for a in act(state, Tasks({KEY}, set(), {}, workers={KEY: workers})))


def test_only_the_completion_of_the_rescale_in_flight_is_recorded(tmp_path: Path, task_dir: Path) -> None:
    completed(0)  # an earlier generation's
    ex = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive")
    tasks = Tasks({KEY}, set(), {}, workers={KEY: ex.workers(KEY)})
    assert not any(isinstance(a, Record) for a in act(shrunk_not_reported(), tasks))
    (task_dir / RESCALE_COMPLETED_FILE).write_text("not a report")
    assert ex.workers(KEY).rescaled is None


def test_worlds_no_agent_believes_are_counted_by_the_agent() -> None:
    rescaled = control.RescaleReport(
        job="j", attempt=0, at=101.0, event="completed", generation=1, world=10**23, samples_per_s_before=float("nan")
    )
    tasks = Tasks(set(), set(), {}, workers={KEY: TaskWorkers(launched=frozenset({0, 1, 2}), rescaled=rescaled)})
    actions = act(shrunk_not_reported(), tasks)
    (done,) = [a.event for a in actions if isinstance(a, Record)]
    assert (done.world, done.world_before, done.samples_per_s_before) == (1, 3, None)
