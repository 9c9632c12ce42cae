"""Reconciling one job on one node: what the log says should run here against what runs, as a pure
function that returns the actions to take. The live agent carries them out with its executor; the
simulator carries them out on its virtual clock (``apps/sim``): one logic for both.

Reconciling rather than reacting to single events makes a restart safe: after folding the log
again, the agent adopts the tasks that still run (their shims outlived it) and stops those whose
attempt ended meanwhile.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from types import MappingProxyType
from typing import NamedTuple

from gpuherd import events as ev
from gpuherd.fold import ACTIVE, ClusterState, JobState
from gpuherd.fold.leases import Leases
from gpuherd.jobenv import ElasticPlan
from services.nodeagent import leases as lease_rules
from services.nodeagent.executors.base import TaskExit, TaskKey, TaskLaunch, TaskWorkers
from services.nodeagent.taskfiles import WorkerDeath

# -- what to do: the actions the agent (or the simulator) carries out, one by one ---------------------


class StopTask(NamedTuple):
    """Stop the task; with ``report`` its end is recorded (``TaskEnded``) with that outcome."""

    key: TaskKey
    reason: str
    grace_s: float = 0.0  # SIGUSR1 first, this long to checkpoint (a preemption)
    report: ev.PartOutcome | None = None


class StartTask(NamedTuple):
    """Start (or, ``launch.resume``, adopt) this node's part; ``started`` is recorded first. If it
    cannot start, the actions after it are not carried out (its failure is recorded instead)."""

    launch: TaskLaunch
    started: ev.JobStarted | None


class WritePlan(NamedTuple):
    """Hand the elastic job's current generation to the task's workers (they switch at a step
    boundary); once written, the agent notes the generation (``Tasks.planned``)."""

    key: TaskKey
    plan: ElasticPlan


class StartWorkers(NamedTuple):
    """Start the workers a rescale added on this node's GPUs (``launch.gpus``) in a running elastic task."""

    launch: TaskLaunch


class WriteTaskFile(NamedTuple):
    """Replace file ``name`` of the task's folder with ``text``; once written, the agent notes the
    text (``Tasks.files``)."""

    key: TaskKey
    name: str
    text: str


class RequestLease(NamedTuple):
    """Ask the memory broker for a worker's lease (appended in the background: asked once per id)."""

    event: ev.MemoryLeaseRequested


class ReportLostWorker(NamedTuple):
    """An elastic task's worker died outside a rescale (appended in the background)."""

    event: ev.WorkerLost


class RecordEnd(NamedTuple):
    """Record how a task that ended by itself ended; once appended, the agent notes it recorded."""

    key: TaskKey
    event: ev.TaskEnded


class Record(NamedTuple):
    """Append an event, before the actions after it are carried out (a simulated executor's rescale
    is done at once; a worker lost while no agent ran precedes its task's end)."""

    event: ev.Event


Action = (
    StopTask
    | StartTask
    | WritePlan
    | StartWorkers
    | WriteTaskFile
    | RequestLease
    | ReportLostWorker
    | RecordEnd
    | Record
)

# -- what runs: the snapshot the reconcile step compares with the log ----------------------------------

_NOTHING: Mapping = MappingProxyType({})


class Tasks(NamedTuple):
    """What runs on this node, as the executor and the agent's own notes have it: the reconcile
    step's input beside the log. Only the tasks of the job being reconciled need to be in it."""

    running: Set[TaskKey]
    exited: Set[TaskKey]  # ended by themselves (never started again in the same attempt)
    deadline_missed: Mapping[TaskKey, str]  # kept a revoked lease past its deadline: to stop, and why
    workers: Mapping[TaskKey, TaskWorkers] = _NOTHING  # elastic: the workers started, and those that died
    planned: Mapping[TaskKey, int] = _NOTHING  # elastic: the generation last written to the task
    files: Mapping[tuple[TaskKey, str], str] = _NOTHING  # the text last written to each task file
    asked: Set[str] = frozenset()  # leases already asked for (the log has them, or a request is on its way)
    unrecorded: Mapping[TaskKey, TaskExit] = _NOTHING  # of ``exited``: those whose end is not in the log yet
    progress: Mapping[TaskKey, Mapping[str, float]] = _NOTHING  # each task's leader's last report


class AgentEvents:
    """The events a node's agent writes: ids derived from what they are about (never random), so
    writing one again after a crash changes nothing (dropped by the log, or folded as nothing new);
    ``source`` is ``agent.<node>``."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.source = f"agent.{node}"

    def stamp(self, kind: str, *parts: str, at: float) -> dict[str, object]:
        return {"id": ":".join((self.source, kind, *parts)), "at": at, "source": self.source}

    def started(self, job: JobState, at: float) -> ev.JobStarted:
        again = (str(job.generation),) if job.generation else ()  # an elastic job back on this node
        stamp = self.stamp("start", job.job, str(job.attempt), *again, at=at)
        return ev.JobStarted(**stamp, job=job.job, attempt=job.attempt, node=self.node)  # type: ignore[arg-type]

    def ended(
        self,
        key: TaskKey,
        outcome: ev.PartOutcome,
        at: float,
        *,
        exit_code: int | None = None,
        reason: str = "",
        output_tail: str = "",
        metrics: dict[str, float] | None = None,
        job: JobState | None = None,
    ) -> ev.TaskEnded:
        """``job``: the log's state of the task's job, if known. An elastic part that left this node
        and came back ends here again in the same attempt: its generation makes the id its own."""
        generation = job.generation if job is not None and job.attempt == key.attempt else 0
        again = (str(generation),) if generation else ()
        return ev.TaskEnded(
            **self.stamp("ended", key.job, str(key.attempt), *again, at=at),  # type: ignore[arg-type]
            job=key.job,
            attempt=key.attempt,
            node=self.node,
            outcome=outcome,
            exit_code=exit_code,
            reason=reason,
            output_tail=output_tail,
            metrics=metrics,
        )

    def rescaled(self, job: JobState, at: float, **fields: object) -> ev.RescaleCompleted:
        stamp = self.stamp("rescaled", job.job, str(job.attempt), str(job.generation), at=at)
        return ev.RescaleCompleted(
            **stamp, job=job.job, attempt=job.attempt, generation=job.generation, node=self.node, **fields
        )  # type: ignore[arg-type]

    def lease_requested(self, job: JobState, lease: str, gpu: int, at: float) -> ev.MemoryLeaseRequested:
        """An elastic worker that left this GPU and was grown back onto it in the same attempt asks
        again under the same lease (its first one was reclaimed when it left): its generation makes
        the event's id its own, where the log would drop it as a duplicate of the first request."""
        needs = job.spec.memory
        assert needs is not None, "only a job that declares memory leases it"
        again = (str(job.generation),) if job.generation else ()
        return ev.MemoryLeaseRequested(
            **self.stamp("lease", lease, *again, at=at),  # type: ignore[arg-type]
            lease=lease,
            job=job.job,
            attempt=job.attempt,
            node=self.node,
            gpu=gpu,
            mb=needs.extra_mb,
            min_mb=needs.min_mb,
            tiers=needs.tiers,
        )

    def worker_lost(self, job: JobState, attempt: int, death: WorkerDeath, at: float) -> ev.WorkerLost | None:
        """An elastic worker of this node died outside a rescale (a leaving worker exits with 0): the
        event that says so, or None if it is not news (the attempt is over or ending, the worker is
        not one of the current generation's, or its death is known already)."""
        if death.gpu is None or job.attempt != attempt or job.stopping():
            return None  # (the whole attempt is ending: its parts report as usual)
        worker = ev.worker_id(self.node, death.gpu)
        if worker not in job.workers or worker in job.lost_workers:
            return None
        parts = (job.job, str(attempt), str(death.gpu), str(job.generation))
        return ev.WorkerLost(
            **self.stamp("worker-lost", *parts, at=at),  # type: ignore[arg-type]
            job=job.job,
            attempt=attempt,
            node=self.node,
            gpu=death.gpu,
            exit_code=death.code,
            reason=death.reason,
        )


def launch_for(
    job: JobState, node: str, *, resume: bool, elapsed_s: float, gpus: tuple[int, ...] | None = None
) -> TaskLaunch:
    """This node's part of the job's current attempt: its GPUs, ranks and rendezvous. For an
    elastic job, one worker per GPU (``gpus``: only these, when a running task grows). A sim task
    runs what is left of its duration: what earlier attempts did counts (it checkpointed)."""
    procs = [job.spec.procs_per_node or len(a.gpus) for a in job.allocations]
    index = job.nodes.index(node)
    elastic = job.spec.elastic is not None
    mine = job.allocations[index].gpus if gpus is None else gpus
    return TaskLaunch(
        key=TaskKey(job.job, job.attempt),
        spec=job.spec,
        gpus=mine,
        group_rank=index,
        rank_offset=sum(procs[:index]),
        world_size=sum(procs),
        procs=len(mine) if elastic else procs[index],
        rendezvous=job.rendezvous,
        resume=resume,
        elapsed_s=elapsed_s,
        attained_s=job.service_gpu_s / job.spec.gpus,
        elastic=elastic,
        generation=job.generation,
    )


def stop_reason(job: JobState) -> str:
    if job.cancel_requested:
        return "cancelled on request"
    if job.preempt_reason is not None:
        return job.preempt_reason
    if job.time_limit_reached:
        return f"time limit of {job.spec.time_limit_s:g}s reached"
    for node, part in job.parts_ended.items():
        if part.outcome != "completed":
            return f"the gang is stopping: its part on {node} {part.outcome} ({part.reason or part.exit_code})"
    return "the gang is stopping"


def reconcile(
    state: ClusterState,
    node: str,
    job_id: str,
    tasks: Tasks,
    now: float,
    events: AgentEvents,
    *,
    simulated: bool,
    leases: Leases = _NOTHING,
) -> list[Action]:
    """The actions that bring this node's part of ``job_id`` in line with the log (``state``, and
    ``leases``: the memory leases of this node's workers) given what runs (``tasks``). ``simulated``:
    the executor runs no processes (no plans, files or workers to hand out; a rescale is done at once)."""
    job = state.jobs.get(job_id)
    mine = job is not None and job.status in ACTIVE and node in job.nodes
    # An elastic job's workers leaving this node take part in the switch, then exit by themselves.
    leaving = job is not None and job.status in ACTIVE and not mine and any(a.node == node for a in job.releasing)
    key = TaskKey(job_id, job.attempt) if job is not None else None
    out: list[Action] = []
    for k in sorted(k for k in tasks.unrecorded if k.job == job_id) if tasks.unrecorded else ():
        out += deaths_before_end(job, k, tasks, now, events)
        out.append(RecordEnd(k, ended(k, tasks, now, events, job)))
    for running in sorted(k for k in tasks.running if k.job == job_id) if tasks.running else ():
        if leaving and running == key:
            assert job is not None
            out += hand_plan(job, running, tasks, again=False) if not simulated else []
        elif not mine or running != key:
            out.append(StopTask(running, "its attempt ended"))
    if job is None or key is None or not mine or node in job.parts_ended:
        return out
    if job.stopping():
        grace = job.preempt_grace_s if job.preempt_reason is not None and not job.cancel_requested else 0.0
        return [*out, StopTask(key, stop_reason(job), grace, report="stopped")]
    elastic = job.spec.elastic is not None
    if elastic and not simulated:
        out += missed_rescale(job, tasks.workers.get(key), now, events)
    if key in tasks.running:
        if key in tasks.deadline_missed:
            return [*out, StopTask(key, tasks.deadline_missed[key], report="failed")]
        workers = tasks.workers.get(key, TaskWorkers())
        out += sync_leases(job, node, key, tasks, workers.launched, now, events, leases, simulated=simulated)
        if elastic and simulated:
            out += simulated_rescale(job, node, now, events)
        elif elastic:
            out += hand_plan(job, key, tasks, again=False)
            rejoining = dead_rejoining(job, node, workers.dead)
            out += new_workers(job, node, workers, rejoining)
            # A rejoining GPU's death is old news (the new worker started now replaces it).
            out += lost_workers(job, key, [d for d in workers.dead if d.gpu not in rejoining], now, events)
        return out
    if key in tasks.exited:
        return out
    resume = node in job.started_nodes
    late = resume or (elastic and job.generation > 0)  # (a grow onto this node)
    elapsed = max(0.0, now - job.started_at) if late and job.started_at is not None else 0.0
    started = None if resume else events.started(job, now)
    launch = launch_for(job, node, resume=resume, elapsed_s=elapsed)
    out.append(StartTask(launch, started))
    if elastic and not simulated:
        out += hand_plan(job, key, tasks, again=True)  # a fresh folder (or one from before a restart)
    # Its workers: those it starts now, or, adopted after a restart, those its folder names.
    workers = tasks.workers.get(key, TaskWorkers()).launched if resume else frozenset(launch.gpus)
    out += sync_leases(job, node, key, tasks, workers, now, events, leases, simulated=simulated, fresh=True)
    return out


def hand_plan(job: JobState, key: TaskKey, tasks: Tasks, *, again: bool) -> list[Action]:
    """The job's current generation for the task's workers: once per generation, unless ``again``."""
    plan = job.plan()
    if plan is None or (not again and tasks.planned.get(key) == plan.generation):
        return []
    return [WritePlan(key, plan)]


def new_workers(job: JobState, node: str, workers: TaskWorkers, rejoining: Set[int]) -> list[Action]:
    """The workers of this node's GPUs that a rescale added to a running elastic task: on GPUs that
    never had one, on those whose worker left at an earlier rescale (a rollback of the shrink it
    left at names it again, as a joiner: without a new worker there, the generation could never
    form, and the job would wait for the scheduler's ``rescale_timeout_s`` to roll back again), and
    on those whose worker died before the generation named it again (``rejoining``)."""
    mine = job.allocations[job.nodes.index(node)].gpus
    new = tuple(g for g in mine if g not in workers.launched or g in workers.left or g in rejoining)
    return [StartWorkers(launch_for(job, node, resume=False, elapsed_s=0.0, gpus=new))] if new else []


def dead_rejoining(job: JobState, node: str, dead: Sequence[WorkerDeath]) -> frozenset[int]:
    """The GPUs of this node whose current worker died and that the job's current generation names
    again as joiners: a grow back onto a GPU the recovery from that death gave up, or a rollback to
    a worker that died as it left at a shrink. A joiner is new to the generation, so that worker,
    started in an earlier one, is none of it: the GPU needs a new worker, and the death is no news
    (reported already, or of a worker the job had let go). A death without its worker's generation
    (a shim of a version before it) cannot be told apart: it counts as it did."""
    joiners = set(job.joiners)
    return frozenset(
        d.gpu
        for d in dead
        if d.gpu is not None
        and d.generation is not None
        and d.generation < job.generation
        and ev.worker_id(node, d.gpu) in joiners
    )


def ended(key: TaskKey, tasks: Tasks, now: float, events: AgentEvents, job: JobState | None) -> ev.TaskEnded:
    """How a task that ended by itself ended, with its leader's last report as the final metrics."""
    exit_ = tasks.unrecorded[key]
    metrics = tasks.progress.get(key)
    return events.ended(
        key,
        exit_.outcome,
        now,
        exit_code=exit_.exit_code,
        reason=exit_.reason,
        output_tail=exit_.output_tail,
        metrics=dict(metrics) if metrics is not None else None,
        job=job,
    )


def deaths_before_end(
    job: JobState | None, key: TaskKey, tasks: Tasks, now: float, events: AgentEvents
) -> list[Action]:
    """The worker deaths the shim of an elastic task that ended recorded and the log does not know
    of (they came while no agent listened: it ended during a restart), recorded before its end, as a
    live agent would have: the fold takes a part whose workers were each lost as lost workers (the
    job goes on with the survivors), but a part that ends failed first stops the whole gang. Each is
    appended (not in the background) so that it precedes the end in the log."""
    workers = tasks.workers.get(key)
    if job is None or job.spec.elastic is None or workers is None:
        return []
    return [Record(lost.event) for lost in lost_workers(job, key, workers.dead, now, events)]


def lost_workers(
    job: JobState, key: TaskKey, dead: Sequence[WorkerDeath], now: float, events: AgentEvents
) -> list[ReportLostWorker]:
    """The deaths the task's shim recorded that the log does not know of (one missed while the
    agent was away, or whose message was lost)."""
    out: list[ReportLostWorker] = []
    seen: set[str] = set()
    for death in dead:
        lost = events.worker_lost(job, key.attempt, death, now)
        if lost is not None and lost.id not in seen:
            seen.add(lost.id)
            out.append(ReportLostWorker(lost))
    return out


def sync_leases(
    job: JobState,
    node: str,
    key: TaskKey,
    tasks: Tasks,
    workers: Set[int],
    now: float,
    events: AgentEvents,
    leases: Leases,
    *,
    simulated: bool,
    fresh: bool = False,
) -> list[Action]:
    """Ask for the leases the task's workers need (an elastic worker's once its process is there:
    ``workers``; every GPU's at once when simulated, or when the job is not elastic); hand the task
    its leases as the log has them (``fresh``: a folder the lease file was not written to yet)."""
    if job.spec.memory is None:
        return []
    if job.spec.elastic is None or simulated:
        workers = {g for a in job.allocations if a.node == node for g in a.gpus}
    out: list[Action] = []
    for lease, gpu in lease_rules.wanted_requests(job, node, set(workers)):
        if lease not in tasks.asked:
            out.append(RequestLease(events.lease_requested(job, lease, gpu, now)))
    if not simulated:
        text = lease_rules.lease_file(leases, job, node)
        if fresh or tasks.files.get((key, lease_rules.LEASES_FILE)) != text:
            out.append(WriteTaskFile(key, lease_rules.LEASES_FILE, text))
    return out


# The most workers a rescale report may name: beyond any cluster, and an integer every reader's
# snapshot holds (a world of 1e23 from a job's process made every elastic snapshot raise).
MAX_REPORTED_WORLD = 2**31


def checked_rescale(
    job: JobState | None, world: int, before: int, rate: float | None
) -> tuple[int, int, float | None] | None:
    """The worlds and throughput of a completed rescale, as a job's process reported them (by
    datagram or in its task folder), as the log may record them; None to drop the report. The
    completion itself is kept (it gives a shrink's GPUs back); a throughput the elastic service
    divides by must be finite and above 0 (else it is not recorded), and a world the agent cannot
    believe (outside 1..2**31; 0 before: a worker that had none) is replaced by the agent's own count
    of the job's workers, without the throughput, which that world no longer vouches for."""
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        rate = None
    if 1 <= world <= MAX_REPORTED_WORLD and 0 <= before <= MAX_REPORTED_WORLD:
        return world, before, rate
    if job is None:
        return None
    return len(job.workers), sum(len(a.gpus) for a in job.committed), None


def missed_rescale(job: JobState, workers: TaskWorkers | None, now: float, events: AgentEvents) -> list[Action]:
    """The completion of the job's rescale in flight that a worker of this task left in its folder
    and the log does not have: its datagram came while no agent listened (a restart), and without
    it the scheduler rolls back a rescale that happened. The id is the one the datagram's event
    has: recorded once either way."""
    report = workers.rescaled if workers is not None else None
    if report is None or job.rescale is None or (report.attempt, report.generation) != (job.attempt, job.generation):
        return []
    checked = checked_rescale(job, report.world, report.world_before, report.samples_per_s_before)
    assert checked is not None  # (the job is known)
    world, before, rate = checked
    done = events.rescaled(
        job,
        now,
        world=world,
        world_before=before,
        times=ev.complete_phase_times(report.times, fallback=report.at or now),
        samples_per_s_before=rate,
    )
    return [Record(done)]


def simulated_rescale(job: JobState, node: str, now: float, events: AgentEvents) -> list[Action]:
    """A sim job has no workers to switch: its leading node reports the rescale done at once (so
    simulated elastic jobs resize, and their GPUs are given back, as real ones do)."""
    if job.rescale is None or job.nodes[0] != node:
        return []
    done = events.rescaled(
        job,
        now,
        world=len(job.workers),
        world_before=sum(len(a.gpus) for a in job.committed),
        # Nothing to switch: every phase after the decision happens at once, now.
        times=ev.complete_phase_times({"decided": job.rescaled_at or now, "first_step": now}),
    )
    return [Record(done)]


class PowerMove(NamedTuple):
    """Carry out a power request: ``down`` (the drained node is empty) or ``up`` (it was asked to boot)."""

    action: str


def power(state: ClusterState, node: str) -> PowerMove | None:
    """A draining node powers down once its last job is gone; a booting one powers up."""
    me = state.nodes.get(node)
    if me is None:
        return None
    if me.power == "draining" and not me.busy():
        return PowerMove("down")
    if me.power == "booting":
        return PowerMove("up")
    return None
