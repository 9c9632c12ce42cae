"""The node agent's reconcile step on running elastic jobs, over generated histories in which the
log (placements, grows, shrinks, failed rescales rolled back, lost workers recovered from, stops)
and node ``n1``'s workers (each GPU's workers one after another: running, left at a rescale, died,
exited) move together, and the agent reconciles now and then and carries out what it is asked.

The generic properties in ``test_reconcile_properties.py`` draw what runs independently of the log,
so they seldom reach a running elastic task, and never one whose generation names a GPU again.
Here every state is one the agent could see: the log is folded with the real fold, the workers'
view is the executor's ``TaskWorkers`` as the process executor derives it from the task's folder
(each GPU's current worker: its death, or its 'left' report), and after every reconcile:

- no worker is started beside a live one, nor on a GPU the job's current generation does not give
  this node, nor for a task that is not the job's current one here, nor for a job that is stopping;
- every GPU the current generation gives this node has exactly one live worker once the actions are
  carried out, unless the log knows its worker died (a lost worker: the job recovers without it);
- a worker's death is reported at most once, over the whole history, and only a real one;
- a task of an attempt that is over, of a job no longer here or stopping, is stopped, workers and all;
- reconciling again right after carrying out the actions asks for nothing (idempotence).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.fold import ACTIVE, JobState
from services.nodeagent.executors.base import TaskExit, TaskKey, TaskWorkers
from services.nodeagent.reconcile import (
    Action,
    AgentEvents,
    Record,
    RecordEnd,
    ReportLostWorker,
    StartTask,
    StartWorkers,
    StopTask,
    Tasks,
    WritePlan,
    reconcile,
)
from services.nodeagent.state import AgentState, evolve, new_state
from services.nodeagent.taskfiles import WorkerDeath
from tests.helpers import node

ME, OTHER, JOB = "n1", "n2", "j"
GPUS = 4
SPEC = ev.JobSpec(name=JOB, user="u", gpus=2, duration_s=100.0, elastic=ev.Elastic(min=1, max=4))
RENDEZVOUS = ev.Rendezvous("n1.local", 29500)
PLACEMENTS = (  # where the scheduler may place the job's 2 GPUs (n1 alone in most: it is n1's view we test)
    ((ME, (0, 1)),),
    ((ME, (0, 1)),),
    ((ME, (0,)), (OTHER, (0,))),
    ((ME, (1, 2)),),
    ((OTHER, (0, 1)),),
)


@dataclass(eq=False)
class Worker:
    """One worker process of an elastic task on one GPU."""

    gpu: int
    generation: int  # the job's generation it started in (its launch says so)
    fate: str = "running"  # running | left | died | exited (0, no 'left' report) | killed (its task stopped)
    left_at: int = 0  # left: the generation it left at (its 'left' report names it)
    code: int = 0  # died: its exit code


@dataclass
class Task:
    """One attempt's task on n1: each GPU's workers in launch order (the last is the current one)."""

    gpus: dict[int, list[Worker]] = field(default_factory=dict)
    running: bool = True

    def start(self, gpus: tuple[int, ...], generation: int) -> None:
        for gpu in gpus:
            self.gpus.setdefault(gpu, []).append(Worker(gpu, generation))

    def current(self) -> dict[int, Worker]:
        return {gpu: workers[-1] for gpu, workers in self.gpus.items()}

    def live(self, gpu: int) -> list[Worker]:
        return [w for w in self.gpus.get(gpu, ()) if w.fate == "running"]

    def view(self) -> TaskWorkers:
        """What the process executor reads of the folder: every GPU a worker was launched on, the
        death of each GPU's current worker (the shim records every death; those of earlier workers
        of a GPU are filtered out by their generation), and the GPUs whose current worker left at a
        generation after the one it started in."""
        current = self.current()
        return TaskWorkers(
            launched=frozenset(self.gpus),
            dead=tuple(
                WorkerDeath(gpu=g, code=w.code, reason="worker was killed", generation=w.generation)
                for g, w in sorted(current.items())
                if w.fate == "died"
            ),
            left=frozenset(g for g, w in current.items() if w.fate == "left" and w.left_at > w.generation),
        )


class World:
    """The log as n1's agent folds it, n1's tasks and their workers, and the agent's notes."""

    def __init__(self) -> None:
        self.state: AgentState = new_state(ME)
        self.seq = itertools.count(1)
        self.ids = itertools.count()
        self.at = 1.0
        self.tasks: dict[TaskKey, Task] = {}
        self.exited: set[TaskKey] = set()
        self.unrecorded: dict[TaskKey, TaskExit] = {}
        self.planned: dict[TaskKey, int] = {}
        self.released_at: dict[int, int] = {}  # n1's GPU -> the generation that last let it go
        self.reported: dict[Worker, list[str]] = {}  # each dead worker's WorkerLost ids, as appended
        self.seen: set[str] = set()  # (statistics: what the reconciles of a running task here met)
        self.fold(node(ME, GPUS))
        self.fold(node(OTHER, GPUS))
        self.fold(ev.JobSubmitted(id="s", job=JOB, spec=SPEC, intake_source="t"))

    @property
    def job(self) -> JobState | None:
        return self.state.jobs.get(JOB)

    def stamp(self) -> dict[str, object]:
        self.at += 1.0
        return {"id": f"e{next(self.ids)}", "at": self.at}

    def fold(self, event: ev.Event) -> None:
        """Append ``event``: the agent folds it, and keeps its notes as ``NodeAgent._remember`` does."""
        evolve(self.state, next(self.seq), event)
        if isinstance(event, ev.JobResized):
            for alloc in event.releasing:
                if alloc.node == ME:  # (their workers take part in the switch, then leave at it)
                    self.released_at.update(dict.fromkeys(alloc.gpus, event.generation))
            if any(a.node == ME for a in event.allocations):
                self.exited.discard(TaskKey(event.job, event.attempt))  # back on this node: start it again
        elif isinstance(event, ev.JobFinished | ev.JobRequeued):
            job = self.job
            current = job.attempt if job is not None else None
            self.exited = {k for k in self.exited if k.attempt == current}
            self.planned = {k: v for k, v in self.planned.items() if k.attempt == current}

    def task_exits(self, key: TaskKey, outcome: str | None = None) -> None:
        """The task ended by itself (its shim exits once no worker is left): failed if every worker
        died, as the shim judges it (one that died was reported, and the job went on without it)."""
        task = self.tasks[key]
        workers = [w for ws in task.gpus.values() for w in ws]
        for worker in workers:
            if worker.fate == "running":
                worker.fate = "exited"
        if outcome is None:
            outcome = "failed" if all(w.fate == "died" for w in workers) else "completed"
        task.running = False
        self.exited.add(key)
        self.unrecorded[key] = TaskExit(key=key, outcome=outcome, exit_code=0 if outcome == "completed" else 1)  # type: ignore[arg-type]

    def snapshot(self) -> Tasks:
        return Tasks(
            frozenset(k for k, t in self.tasks.items() if t.running),
            frozenset(self.exited),
            {},
            workers={k: t.view() for k, t in self.tasks.items()},
            planned=dict(self.planned),
            unrecorded=dict(self.unrecorded),
        )

    def reconcile(self) -> list[Action]:
        return reconcile(self.state, ME, JOB, self.snapshot(), self.at, AgentEvents(ME), simulated=False)

    def report(self, lost: ev.WorkerLost, *, before_end: bool = False) -> None:
        """A death reported: appended to the log (the fold takes it), and noted against its worker.

        Known exception (not counted): a death recorded before the end of a task that ended by
        itself (``deaths_before_end``, say after an agent restart) of a GPU the current generation
        names again as a joiner, whose worker died before it. That death was reported already, but
        the new worker was never started (the task ended first), and reporting the GPU lost again
        is how the log learns that the generation will not form there."""
        task = self.tasks[TaskKey(lost.job, lost.attempt)]
        worker = task.current().get(lost.gpu)
        assert worker is not None and worker.fate == "died", f"a death reported of no dead worker: {lost}"
        assert lost.exit_code == worker.code
        job = self.job
        rejoining = job is not None and ev.worker_id(ME, lost.gpu) in job.joiners and worker.generation < job.generation
        if not (before_end and rejoining):
            self.reported.setdefault(worker, []).append(lost.id)
        self.fold(lost)

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case StartTask(launch, started):
                    if started is not None:
                        self.fold(started)
                    self.tasks[launch.key] = task = Task()
                    task.start(launch.gpus, launch.generation)
                case StartWorkers(launch):
                    self.tasks[launch.key].start(launch.gpus, launch.generation)
                case StopTask(key, reason, _, report):
                    task = self.tasks.get(key)  # (a part that never started here is reported stopped too)
                    if task is not None:
                        task.running = False
                        for worker in task.current().values():
                            if worker.fate == "running":
                                worker.fate = "killed"
                    if report is not None:
                        self.exited.add(key)
                        self.fold(AgentEvents(ME).ended(key, report, self.at, reason=reason, job=self.job))
                case WritePlan(key, plan):
                    self.planned[key] = plan.generation
                case ReportLostWorker(lost):
                    self.report(lost)
                case Record(ev.WorkerLost() as lost):
                    self.report(lost, before_end=True)
                case RecordEnd(key, ended):
                    self.fold(ended)
                    del self.unrecorded[key]
                case _:
                    raise AssertionError(f"not an action of an elastic job without memory: {action}")

    # -- what happens in the cluster meanwhile --------------------------------------------------------

    def resize(self, kind: str, allocations: tuple[ev.Allocation, ...], releasing=()) -> None:
        """A new generation, as the scheduler builds it (``services/scheduler/resize.py``)."""
        job = self.job
        assert job is not None
        workers = ev.workers_of(allocations)
        committed = ev.workers_of(job.committed)
        source = next((w for w in committed if w in workers), workers[0])
        self.fold(
            ev.JobResized(
                **self.stamp(),  # type: ignore[arg-type]
                job=JOB,
                attempt=job.attempt,
                generation=job.generation + 1,
                allocations=allocations,
                rendezvous=RENDEZVOUS,
                state_from=source,
                joiners=tuple(w for w in workers if w not in job.workers),
                releasing=tuple(releasing),
                kind=kind,  # type: ignore[arg-type]
            )
        )

    def current_task(self) -> Task | None:
        job = self.job
        task = self.tasks.get(TaskKey(JOB, job.attempt)) if job is not None else None
        return task if task is not None and task.running else None


def _only(allocations: tuple[ev.Allocation, ...], keep: set[str]) -> tuple[ev.Allocation, ...]:
    """The allocations restricted to the workers in ``keep``, in their order (as the scheduler's)."""
    out = (ev.Allocation(a.node, tuple(g for g in a.gpus if ev.worker_id(a.node, g) in keep)) for a in allocations)
    return tuple(a for a in out if a.gpus)


def _mine(job: JobState) -> tuple[int, ...]:
    return job.allocations[job.nodes.index(ME)].gpus if ME in job.nodes else ()


def moves(world: World, *, ends: bool) -> list[str]:
    """What may happen next, each as often as it should be drawn (the agent reconciling first: the
    draws shrink towards it). Only with ``ends`` may the job be stopped or finished (else most
    histories would end before their rescales got anywhere)."""
    job = world.job
    out = ["reconcile"] * 6
    if job is None:
        return out
    if job.status == "pending":
        return ["place"]  # (the scheduler places it: nothing else can happen to it meanwhile)
    if job.status not in ACTIVE:
        return out
    if OTHER in job.nodes and OTHER not in job.started_nodes:
        out += ["start on n2"] * 3
    survivors = [w for w in job.workers if w not in job.lost_workers]
    if not job.stopping():
        if job.rescale is not None:
            out += ["complete"] * 3 + ["fail"] * 3
        elif job.status == "running" and not job.lost_workers:  # (as the scheduler commits them)
            out += ["grow"] * 4 + ["shrink"] * 3
        if job.lost_workers and survivors and set(survivors) & set(ev.workers_of(job.committed)):
            out += ["recover"] * 3  # (as the scheduler recovers, while a survivor holds the state)
        if OTHER in job.nodes:
            out.append("lose on n2")
        if ends:
            out += ["cancel", "preempt", "n2 fails"]
    else:
        out += ["requeue", "finish"]  # (as the scheduler settles a stopping attempt)
    task = world.current_task()
    if task is not None:
        live = sum(w.fate == "running" for w in task.current().values())
        if live > 1 or (live and ends):  # (the last worker's death fails the task: only in ends)
            out += ["die"] * 2 + ["exit"] * ends
        if any(_may_leave(world, w) for w in task.current().values()):
            out += ["leave"] * 4
        if ends:
            out.append("task ends")
    return out


def _may_leave(world: World, worker: Worker) -> bool:
    return worker.fate == "running" and world.released_at.get(worker.gpu, -1) > worker.generation


def happen(draw: Callable[..., Any], world: World, move: str) -> None:
    """One thing the scheduler, another node or one of n1's workers does (not the agent)."""
    job = world.job
    assert job is not None
    stamp = world.stamp()
    attempt = job.attempt
    task = world.current_task()
    live = sorted((w for w in task.current().values() if w.fate == "running"), key=lambda w: w.gpu) if task else []
    if move == "place":
        where = draw(st.sampled_from(PLACEMENTS))
        allocations = tuple(ev.Allocation(n, g) for n, g in where)
        world.fold(ev.JobPlaced(**stamp, job=JOB, attempt=attempt, allocations=allocations, rendezvous=RENDEZVOUS))
    elif move == "start on n2":
        world.fold(ev.JobStarted(**stamp, job=JOB, attempt=attempt, node=OTHER))
    elif move == "grow":
        held = {(a.node, g) for a in (*job.allocations, *job.releasing) for g in a.gpus}
        free = [(n, g) for n in (ME, OTHER) for g in range(GPUS) if (n, g) not in held]
        if len(job.workers) >= 4 or not free:
            return
        # Mostly n1's lowest free GPU (the scheduler grows on the job's nodes first; a GPU just
        # given back is often the lowest), else any.
        mine = [(n, g) for n, g in free if n == ME]
        n, g = mine[0] if mine and draw(st.integers(0, 3)) else draw(st.sampled_from(free))
        grown = {a.node: a.gpus for a in job.allocations}
        grown[n] = (*grown.get(n, ()), g)  # (a node's new GPUs follow its old ones; a new node comes last)
        world.resize("grow", tuple(ev.Allocation(k, v) for k, v in grown.items()))
    elif move == "shrink":
        if len(job.workers) <= 1:
            return
        gone = job.workers[-1]  # (the newest worker goes)
        keep = set(job.workers) - {gone}
        world.resize("shrink", _only(job.allocations, keep), releasing=_only(job.allocations, {gone}))
    elif move == "complete":
        # The new rank 0 reports its first step only once every worker of the generation is there.
        if task is not None and any(not task.live(g) for g in _mine(job)):
            return
        if ME in job.nodes and task is None:
            return
        done = {"decided": job.rescaled_at or stamp["at"], "first_step": stamp["at"]}
        node_ = job.nodes[0]
        world.fold(
            ev.RescaleCompleted(
                **stamp,  # type: ignore[arg-type]
                job=JOB,
                attempt=attempt,
                generation=job.generation,
                node=node_,
                world=len(job.workers),
                world_before=sum(len(a.gpus) for a in job.committed),
                times=ev.complete_phase_times(done),
            )
        )
    elif move == "fail":
        failed = ev.RescaleFailed(**stamp, job=JOB, attempt=attempt, generation=job.generation, node=ME, reason="x")
        world.fold(failed)
        # The scheduler's rollback (rules 12): the committed workers still held and alive; the new
        # workers of the failed generation leave.
        committed = ev.workers_of(job.committed)
        held = {*ev.workers_of(job.allocations), *ev.workers_of(job.releasing)}
        alive = [w for w in committed if w in held and w not in job.lost_workers]
        if not alive:
            return
        joined = set(job.workers) - set(committed) - set(job.lost_workers)
        world.resize("rollback", _only(job.committed, set(alive)), releasing=_only(job.allocations, joined))
    elif move == "recover":
        survivors = [w for w in job.workers if w not in job.lost_workers]
        world.resize("recover", _only(job.allocations, set(survivors)))
    elif move == "lose on n2":
        gpu = draw(st.sampled_from(job.allocations[job.nodes.index(OTHER)].gpus))
        world.fold(ev.WorkerLost(**stamp, job=JOB, attempt=attempt, node=OTHER, gpu=gpu, exit_code=-9))
    elif move == "cancel":
        world.fold(ev.JobCancelRequested(**stamp, job=JOB))
    elif move == "preempt":
        world.fold(ev.JobPreempted(**stamp, job=JOB, attempt=attempt, reason="for k", by="k", grace_s=20.0))
    elif move == "n2 fails":
        if OTHER in job.nodes:
            world.fold(ev.TaskEnded(**stamp, job=JOB, attempt=attempt, node=OTHER, outcome="failed"))
    elif move == "requeue":
        world.fold(ev.JobRequeued(**stamp, job=JOB, attempt=attempt, reason="stopped"))
    elif move == "finish":
        world.fold(ev.JobFinished(**stamp, job=JOB, attempt=attempt, outcome="completed"))
    elif move == "die":
        worker = draw(st.sampled_from(live))
        worker.fate, worker.code = "died", draw(st.sampled_from([1, -9]))
    elif move == "exit":
        draw(st.sampled_from(live)).fate = "exited"
    elif move == "leave":
        worker = draw(st.sampled_from([w for w in live if _may_leave(world, w)]))
        worker.fate, worker.left_at = "left", world.released_at[worker.gpu]
    elif move == "task ends":  # (its training is done, or its shim was killed)
        world.task_exits(TaskKey(JOB, attempt), draw(st.sampled_from(["completed", "failed"])))
    if task is not None and task.running and not any(task.live(g) for g in task.gpus):
        world.task_exits(TaskKey(JOB, attempt))  # (its last worker is gone: the shim exits)
    if task is not None and not task.running:
        # The agent notes an end and reconciles the job at once (``NodeAgent._note_exit``); a
        # generation folded between the two would make it forget the end was noted (see the report
        # of this test's author: ``_remember`` discards the key from ``_exited`` on a JobResized).
        agent_reconciles(world)


def agent_reconciles(world: World) -> None:
    """The agent reconciles the job and carries out the actions; every property is checked."""
    job = world.job
    current = TaskKey(JOB, job.attempt) if job is not None else None
    task = world.tasks.get(current) if job is not None and current is not None else None
    if job is not None and task is not None and task.running:
        here = [int(w.partition("/")[2]) for w in job.joiners if w.startswith(f"{ME}/")]
        world.seen |= {"joiners"} if here else set()
        fates = {task.current()[g].fate for g in here if g in task.gpus}
        world.seen |= {f"a joiner's GPU whose worker {fate}" for fate in fates & {"left", "died", "running"}}
    actions = world.reconcile()
    check_starts(world, actions)
    world.carry_out(actions)
    check_after(world)
    again = world.reconcile()
    assert again == [], f"reconciling again after carrying out {actions} asks for {again}"


def check_starts(world: World, actions: list[Action]) -> None:
    """No worker beside a live one, nor on a GPU the job does not give n1 now, nor for a job that
    is stopping or a task that is not its current one."""
    job = world.job
    for action in actions:
        if not isinstance(action, StartTask | StartWorkers):
            continue
        launch = action.launch
        assert job is not None and job.status in ACTIVE and not job.stopping(), f"{action} for a job not to run"
        assert launch.key == TaskKey(JOB, job.attempt), f"{action} for an attempt that is over"
        assert launch.generation == job.generation
        assert len(set(launch.gpus)) == len(launch.gpus) and launch.gpus
        assert set(launch.gpus) <= set(_mine(job)), f"{action}: a worker on a GPU the job does not hold here"
        task = world.tasks.get(launch.key)
        if isinstance(action, StartTask):
            assert task is None or not task.running, "a task started beside itself"
        else:
            assert task is not None and task.running, "workers added to a task that does not run"
            beside = [g for g in launch.gpus if task.live(g)]
            assert not beside, f"{action}: a worker started beside the live one on GPU {beside}"


def check_after(world: World) -> None:
    """Once the actions are carried out: each death reported at most once; every GPU of the
    current generation here has one live worker unless the log knows its worker is lost; what
    must not run does not."""
    for worker, ids in world.reported.items():
        assert len(ids) == 1, f"the death of the worker on GPU {worker.gpu} (gen {worker.generation}) reported {ids}"
    job = world.job
    current = TaskKey(JOB, job.attempt) if job is not None else None
    for key, task in world.tasks.items():
        for gpu in task.gpus:
            assert len(task.live(gpu)) <= 1, f"two live workers on GPU {gpu}"
        if not task.running:
            assert not any(task.live(g) for g in task.gpus), "a stopped task's worker runs on"
            continue
        assert job is not None and key == current, "a task of an attempt that is over runs on"
        assert job.status in ACTIVE, "a task of a job that ended runs on"
        leaving = ME not in job.nodes and any(a.node == ME for a in job.releasing)
        assert ME in job.nodes or leaving, "a task of a job no longer here runs on"
        if leaving:
            continue  # (its workers take part in the switch, then leave; the attempt's end stops them)
        assert not job.stopping(), "a task of a job that stops runs on"
        if ME in job.parts_ended:
            continue
        for gpu in _mine(job):
            worker = task.current().get(gpu)
            if worker is not None and worker.fate == "exited":
                continue  # (exited with 0 and said nothing: the agent cannot tell, and it ends with its task)
            if worker is not None and worker.fate == "died" and ev.worker_id(ME, gpu) in job.lost_workers:
                continue  # (the job goes on without it: the scheduler recovers)
            assert len(task.live(gpu)) == 1, (
                f"GPU {gpu} of generation {job.generation} (joiners {job.joiners}) has no live worker: "
                f"{task.gpus.get(gpu)}"
            )


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data())
def test_elastic_workers_one_per_gpu_deaths_reported_once_and_reconcile_settles(data: st.DataObject) -> None:
    """A history of the job as it goes, n1's agent reconciling it at some points (a late agent
    sees several events at once): the properties are checked at each of them and at the end."""
    world = World()
    ends = data.draw(st.sampled_from([False, False, False, True]), label="ends")
    for _ in range(data.draw(st.integers(10, 40), label="steps")):
        if world.job is None:
            break
        move = data.draw(st.sampled_from(moves(world, ends=ends)))
        if move == "reconcile":
            agent_reconciles(world)
        else:
            happen(data.draw, world, move)
        note(f"{move}: {describe(world)}")
    agent_reconciles(world)
    # What the history reached (``--hypothesis-show-statistics``).
    job = world.job
    event("reconciled a running task whose generation has joiners on n1" if "joiners" in world.seen else "no joiners")
    for seen in sorted(world.seen - {"joiners"}):
        event(f"reconciled with {seen}")
    event(f"generation reached: {min(job.generation, 5) if job is not None else 'gone'}")
    earlier = [w for t in world.tasks.values() for ws in t.gpus.values() for w in ws[:-1]]
    if any(w.fate == "left" for w in earlier):
        event("a GPU got a new worker after its worker left")
    if any(w.fate == "died" for w in earlier):
        event("a GPU got a new worker after its worker died")


def describe(world: World) -> str:
    """The log's view of the job and n1's workers, for the notes of a failing example."""
    job = world.job
    if job is None:
        return "job gone"
    where = " ".join(f"{a.node}:{list(a.gpus)}" for a in job.allocations)
    gone = " ".join(f"{a.node}:{list(a.gpus)}" for a in job.releasing)
    tasks = "; ".join(
        f"attempt {k.attempt}{'' if t.running else ' (over)'}: "
        + " ".join(f"{g}=" + ",".join(f"{w.fate}@{w.generation}" for w in ws) for g, ws in sorted(t.gpus.items()))
        for k, t in world.tasks.items()
    )
    return (
        f"{job.status} attempt {job.attempt} gen {job.generation} {job.rescale or 'settled'} on {where}"
        f"{f' releasing {gone}' if gone else ''} joiners {list(job.joiners)} lost {job.lost_workers}"
        f"{' stopping' if job.stopping() else ''} | n1 {tasks or 'nothing'}"
    )
