"""Reconciling one job on one node: what the log says should run here against what runs, as a pure
function that returns the actions to take. The live agent carries them out with its executor; the
simulator carries them out on its virtual clock (``apps/sim``): one logic for both.

Reconciling rather than reacting to single events makes a restart safe: after folding the log
again, the agent adopts the tasks that still run (their shims outlived it) and stops those whose
attempt ended meanwhile.
"""

from __future__ import annotations

from collections.abc import Set
from typing import NamedTuple

from gpuherd import events as ev
from gpuherd.fold import ACTIVE, ClusterState, JobState
from services.nodeagent.executors.base import TaskKey, TaskLaunch


class StopTask(NamedTuple):
    """Stop the task; with ``report`` its end is recorded (``TaskEnded``) with that outcome."""

    key: TaskKey
    reason: str
    grace_s: float = 0.0  # SIGUSR1 first, this long to checkpoint (a preemption)
    report: ev.PartOutcome | None = None


class StartTask(NamedTuple):
    """Start (or, ``launch.resume``, adopt) this node's part; ``started`` is recorded first."""

    launch: TaskLaunch
    started: ev.JobStarted | None


class HandPlan(NamedTuple):
    """Write the job's current generation to the task's workers (``again``: even if written before)."""

    key: TaskKey
    again: bool = False


class SyncLeases(NamedTuple):
    """Ask for the leases the task's workers need, and hand the task its leases as the log has them."""

    key: TaskKey


class Grow(NamedTuple):
    """Start the workers a rescale added on this node's GPUs in a running elastic task."""

    key: TaskKey


class CollectDeaths(NamedTuple):
    """Report the elastic task's workers that died while the agent was away."""

    key: TaskKey


class Record(NamedTuple):
    """Append an event (a simulated executor's rescale is done at once)."""

    event: ev.Event


Action = StopTask | StartTask | HandPlan | SyncLeases | Grow | CollectDeaths | Record


class Tasks(NamedTuple):
    """What the agent knows of its tasks."""

    running: Set[TaskKey]
    exited: Set[TaskKey]  # ended on their own and reported
    deadline_missed: dict[TaskKey, str]  # kept a revoked lease past its deadline: to stop, and why


class AgentEvents:
    """The events a node's agent writes: ids derived from what they are about (never random), so
    writing one again after a crash is a no-op; ``source`` is ``agent.<node>``."""

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
    ) -> ev.TaskEnded:
        return ev.TaskEnded(
            **self.stamp("ended", key.job, str(key.attempt), at=at),  # type: ignore[arg-type]
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
    state: ClusterState, node: str, job_id: str, tasks: Tasks, now: float, events: AgentEvents, *, simulated: bool
) -> list[Action]:
    """The actions that bring this node's part of ``job_id`` in line with the log."""
    job = state.jobs.get(job_id)
    mine = job is not None and job.status in ACTIVE and node in job.nodes
    # An elastic job's workers leaving this node take part in the switch, then exit by themselves.
    leaving = job is not None and job.status in ACTIVE and not mine and any(a.node == node for a in job.releasing)
    key = TaskKey(job_id, job.attempt) if job is not None else None
    out: list[Action] = []
    for running in sorted(k for k in tasks.running if k.job == job_id) if tasks.running else ():
        if leaving and running == key:
            out.append(HandPlan(running))
        elif not mine or running != key:
            out.append(StopTask(running, "its attempt ended"))
    if job is None or key is None or not mine or node in job.parts_ended:
        return out
    if job.stopping():
        grace = job.preempt_grace_s if job.preempt_reason is not None and not job.cancel_requested else 0.0
        return [*out, StopTask(key, stop_reason(job), grace, report="stopped")]
    if key in tasks.running:
        if key in tasks.deadline_missed:
            return [*out, StopTask(key, tasks.deadline_missed[key], report="failed")]
        out.append(SyncLeases(key))
        if job.spec.elastic is not None:
            if simulated:
                out += simulated_rescale(job, node, now, events)
            else:
                out += [HandPlan(key), Grow(key), CollectDeaths(key)]
        return out
    if key in tasks.exited:
        return out
    resume = node in job.started_nodes
    late = resume or (job.spec.elastic is not None and job.generation > 0)  # (a grow onto this node)
    elapsed = max(0.0, now - job.started_at) if late and job.started_at is not None else 0.0
    started = None if resume else events.started(job, now)
    out.append(StartTask(launch_for(job, node, resume=resume, elapsed_s=elapsed), started))
    if job.spec.elastic is not None:
        out.append(HandPlan(key, again=True))
    out.append(SyncLeases(key))
    return out


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
