"""A generation that names the GPU of a worker that died again, as a joiner (a grow back onto the
GPU the recovery gave up, or a rollback to a worker that crashed as it left at a shrink), needs a
new worker there, and the old death is not news. Before, the node agent started workers only on
GPUs that never had one, so the generation's rank 0 waited for a joiner that never came, and it
reported the old death again as a new ``WorkerLost`` (its id names the generation), which made the
scheduler recover again, needlessly."""

from __future__ import annotations

import sys
from pathlib import Path

from gpuherd import events as ev
from gpuherd.control import RescaleReport, encode_message
from gpuherd.log import Record
from gpuherd.train.report import left_file
from services.nodeagent import taskfiles
from services.nodeagent.executors.base import TaskKey
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.reconcile import (
    Action,
    AgentEvents,
    ReportLostWorker,
    StartWorkers,
    Tasks,
    reconcile,
)
from services.nodeagent.state import AgentState, evolve, new_state
from services.nodeagent.taskfiles import GrowRequest, ProcLaunch, TaskDescription, WorkerDeath
from tests.helpers import node
from tests.unit.test_resize import SPEC, _completed, _e, _propose, _resized
from tests.unit.test_scheduler_decider import drive
from tests.unit.test_scheduling_rules_12 import _shrink_never_reported

KEY = TaskKey("j", 0)


def _worker(task_dir: Path, gpu: int, generation: int) -> ProcLaunch:
    return ProcLaunch(
        argv=[sys.executable], env={}, log=str(task_dir / f"worker-{gpu}.log"), gpu=gpu, generation=generation
    )


def _task_folder(executor: CpuExecutor, started: dict[int, int]) -> Path:
    """j's task folder on n1 as the executor keeps it: a worker on each GPU of ``started`` (GPU ->
    the generation it started in: those of generation 0 at the task's start, the others grown)."""
    folder = executor.task_dir(KEY)
    folder.mkdir(parents=True)
    first = [_worker(folder, gpu, 0) for gpu, generation in started.items() if generation == 0]
    description = TaskDescription(
        procs=first, alive_file=str(folder / "alive"), fence_after_s=60.0, kill_grace_s=1.0, elastic=True
    )
    taskfiles.write(folder / taskfiles.TASK_FILE, description)
    for gpu, generation in started.items():
        if generation:
            _grow(folder, gpu, generation)
    return folder


def _grow(folder: Path, gpu: int, generation: int) -> None:
    """A worker started on ``gpu`` in ``generation``, as the executor asks the shim for it."""
    number = len(list(folder.glob(taskfiles.GROWN_PATTERN)))
    taskfiles.write(folder / f"grow-{number:04d}.json", GrowRequest(procs=[_worker(folder, gpu, generation)]))


def _dies(folder: Path, gpu: int, started_in: int, code: int = -9) -> None:
    """The worker of ``gpu`` that started in ``started_in`` died, as the task's shim writes it down."""
    deaths = taskfiles.read(folder / taskfiles.DEAD_WORKERS_FILE, list[WorkerDeath]) or []
    deaths.append(WorkerDeath(gpu=gpu, code=code, reason="worker was killed", generation=started_in))
    taskfiles.write(folder / taskfiles.DEAD_WORKERS_FILE, deaths)


def _agent_state(log: list[Record]) -> AgentState:
    state = new_state("n1")
    for record in log:
        evolve(state, record.seq, record.event)
    return state


def _act(log: list[Record], executor: CpuExecutor) -> list[Action]:
    state = _agent_state(log)
    workers = executor.workers(KEY)
    tasks = Tasks({KEY}, set(), {}, workers={KEY: workers}, planned={KEY: state.jobs["j"].generation})
    return reconcile(state, "n1", "j", tasks, 1000.0, AgentEvents("n1"), simulated=False)


def _started(actions: list[Action]) -> list[tuple[int, ...]]:
    return [a.launch.gpus for a in actions if isinstance(a, StartWorkers)]


def _reported(actions: list[Action]) -> list[ev.WorkerLost]:
    return [a.event for a in actions if isinstance(a, ReportLostWorker)]


def _running_on_three_gpus() -> list[Record]:
    """j (elastic, 2 GPUs) started on n1/0,1 and grew onto n1/2 (generation 1, committed)."""
    log = drive(
        [
            ev.PolicyConfigured(id="policy", policy="fifo", rules=ev.SCHEDULING_RULES, params={}),
            node("n1", 3, executor="cpu", ports=(29500, 29599)),
            ev.JobSubmitted(id="s", source="test", job="j", spec=SPEC, intake_source="t"),
        ]
    )
    log = drive([_e(ev.JobStarted, job="j", attempt=0, node="n1")], log)
    return _completed(_propose(log, 3), 1, 3, 2)


def test_a_grow_back_onto_a_gpu_whose_worker_died_starts_a_worker_there_and_reports_the_death_once(
    tmp_path: Path,
) -> None:
    executor = CpuExecutor(tmp_path, gpus=3, alive_file=tmp_path / "alive")
    folder = _task_folder(executor, {0: 0, 1: 0, 2: 1})
    log = _running_on_three_gpus()
    _dies(folder, 1, started_in=0)

    # The death, in the generation its worker is part of: reported, and no worker is started for it.
    actions = _act(log, executor)
    (lost,) = _reported(actions)
    assert (lost.gpu, lost.exit_code) == (1, -9) and _started(actions) == []
    log = drive([lost], log)
    recover = _resized(log)[-1]
    assert recover.kind == "recover" and recover.allocations == (ev.Allocation("n1", (0, 2)),)
    assert _reported(_act(log, executor)) == [], "known to the log"
    log = _completed(log, 2, 2, 3)
    assert _act(log, executor) == [], "the job goes on without GPU 1"

    # The job grows back onto GPU 1: a new worker there, which takes the state as every joiner does.
    log = drive([_e(ev.RescaleProposed, at=300.0, job="j", attempt=0, generation=2, gpus=3)], log)
    grow = _resized(log)[-1]
    assert grow.kind == "grow" and grow.generation == 3 and grow.joiners == ("n1/1",)
    actions = _act(log, executor)
    assert _started(actions) == [(1,)], "else the grow waits for a joiner that never starts"
    assert _reported(actions) == [], "the old death is not news: reported once, at generation 1"

    # Once started, it is GPU 1's worker: nothing to start or report, until it dies itself.
    _grow(folder, 1, 3)
    assert [a for a in _act(log, executor) if isinstance(a, StartWorkers | ReportLostWorker)] == []
    _dies(folder, 1, started_in=3, code=1)
    actions = _act(log, executor)
    assert [(e.gpu, e.exit_code) for e in _reported(actions)] == [(1, 1)] and _started(actions) == []


def test_a_rollback_to_a_worker_that_died_as_it_left_starts_a_worker_there_and_reports_no_death(
    tmp_path: Path,
) -> None:
    """j ran on n1/0,1,2; a shrink to n1/0 let n1/1 and n1/2 go: n1/2 left, n1/1 crashed on its way
    out (no worker of the shrink: not lost). The shrink fails and is rolled back to all three."""
    executor = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive")
    folder = _task_folder(executor, {0: 0, 1: 0, 2: 0})
    log = _shrink_never_reported(ev.SCHEDULING_RULES)
    _dies(folder, 1, started_in=0, code=1)
    assert _reported(_act(log, executor)) == [], "it was leaving: its death is no loss to the job"
    left = RescaleReport(job="j", attempt=0, event="left", generation=2)
    (folder / left_file(2)).write_bytes(encode_message(left))  # (as the runtime leaves it)
    assert executor.workers(KEY).left == {2}
    failed = _e(ev.RescaleFailed, job="j", attempt=0, generation=2, node="n1", reason="re-form timed out")
    log = drive([failed], log)
    rollback = _resized(log)[-1]
    assert rollback.kind == "rollback" and rollback.joiners == ("n1/1", "n1/2")
    actions = _act(log, executor)
    assert _started(actions) == [(1, 2)], "both joiners get a worker: the one that left and the one that died"
    assert _reported(actions) == [], "a death while it was no worker of the job is not a lost worker"
