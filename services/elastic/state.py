"""The elastic service's own state: the core fold plus what only it needs of each running elastic
job: its measured throughput per world size, its profile's numbers, when it last shrank for waiting
jobs, its last proposal, and the service's parameters as the log last recorded them."""

from __future__ import annotations

import math

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ACTIVE, ClusterState, apply


class JobModel(msgspec.Struct, kw_only=True, gc=False):
    """What the policy knows of a job beyond the cluster state: its profile's numbers."""

    compute_per_sample_s: float | None = None  # from its per-layer profile
    grad_bytes: int = 0


class ElasticState(ClusterState, kw_only=True, gc=False):
    throughput: dict[str, dict[int, float]] = msgspec.field(default_factory=dict)  # job -> world -> samples/s
    models: dict[str, JobModel] = msgspec.field(default_factory=dict)
    shrunk_at: dict[str, float] = msgspec.field(default_factory=dict)  # job -> its last shrink for waiting jobs
    proposed: dict[str, tuple[int, float]] = msgspec.field(default_factory=dict)  # job -> (generation, at)
    params: dict[str, float] | None = None  # the latest applied ElasticConfigured (None: the decider's default)
    # The policy's rules in force: the latest applied ElasticConfigured's, else those of the latest
    # proposal folded (a log of older rules that never recorded them); None: this service's own.
    rules: int | None = None
    recorded_rules: int | None = None  # what the latest applied ElasticConfigured says
    elastic_running: int = 0  # running elastic jobs: the timer ticks only while there are some
    elastic_active: dict[str, None] = msgspec.field(default_factory=dict)  # placed or running elastic jobs


_MAX_GRAD_BYTES = 2**64 - 1  # (what a snapshot's integers hold, as intake and the agent bound it)


def usable_model(compute_per_sample_s: float, grad_bytes: int) -> JobModel | None:
    """The model, or None where its numbers cannot predict a throughput: a compute time that is not
    finite and above 0 (the throughput divides by it), gradient bytes outside what a snapshot holds.
    A job's own process reports them, and a spec accepted before intake rules 10 may declare them."""
    if not (math.isfinite(compute_per_sample_s) and compute_per_sample_s > 0 and 0 <= grad_bytes <= _MAX_GRAD_BYTES):
        return None
    return JobModel(compute_per_sample_s=compute_per_sample_s, grad_bytes=grad_bytes)


def usable_throughput(world: int, samples_per_s: float | None) -> bool:
    """Whether a measured throughput can stand in the throughput table (a size the policy can run
    at, a rate finite and above 0; the job's process reports it)."""
    if samples_per_s is None or not 0 < world <= ev.MAX_ELASTIC_WORLD:
        return False
    return math.isfinite(samples_per_s) and samples_per_s > 0


def job_model(profile: dict) -> JobModel | None:
    """A job's compute time per sample and gradient bytes, from its per-layer profile."""
    try:
        batch = int(profile["batch_size"])
        step_s = float(profile["step_s"])
        grad_bytes = sum(int(layer.get("grad_bytes", 0)) for layer in profile["layers"])
        per_sample_s = step_s / batch
    except (KeyError, TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    return usable_model(per_sample_s, grad_bytes) if batch > 0 else None


def _placed_or_running(state: ElasticState, job_id: str) -> bool:
    """Whether a job's proposal or profile is worth keeping: a profile relayed late, or a proposal
    decided before its job's end and appended after it, would leave an entry for an ended job
    forever (nothing else removes it)."""
    job = state.jobs.get(job_id)
    return job is not None and job.status in ACTIVE


# The events this state folds beyond the core fold, by exact type (as the core fold dispatches):
# nearly every event is none of them, and the checks below ran for each (about a tenth of the
# service's time under load, with the unions they built per event).
_OWN = frozenset({ev.ProfileReported, ev.RescaleCompleted, ev.RescaleProposed, ev.JobResized, ev.ElasticConfigured})
_ACTIVATIONS = (ev.JobPlaced, ev.JobFinished, ev.JobRequeued)  # (the fold's only (de)activations)
_RUNNING_CHANGES = (ev.JobStarted, ev.JobFinished, ev.JobRequeued)
_JOB_LIFE = frozenset({*_ACTIVATIONS, *_RUNNING_CHANGES})


def evolve(state: ElasticState, seq: int, event: ev.Event, *, params_ok: bool) -> ElasticState:
    """Fold ``event``; ``params_ok``: an ElasticConfigured in it can be applied."""
    apply(state, seq, event)
    kind = type(event)
    if kind in _OWN:
        _fold_own(state, event, params_ok=params_ok)
    elif kind not in _JOB_LIFE:
        return state
    if isinstance(event, ev.JobFinished):
        for table in (state.models, state.shrunk_at, state.proposed, state.throughput):
            table.pop(event.job, None)
    if isinstance(event, _ACTIVATIONS):
        job = state.jobs.get(event.job)
        if event.job in state.active and job is not None and job.spec.elastic is not None:
            state.elastic_active[event.job] = None
        else:
            state.elastic_active.pop(event.job, None)
    if isinstance(event, _RUNNING_CHANGES):
        jobs = state.jobs
        state.elastic_running = sum(1 for j in state.elastic_active if jobs[j].status == "running")
    return state


def _fold_own(state: ElasticState, event: ev.Event, *, params_ok: bool) -> None:
    if isinstance(event, ev.ProfileReported) and event.rank == 0 and _placed_or_running(state, event.job):
        model = job_model(event.profile)
        if model is not None:
            state.models[event.job] = model
    elif isinstance(event, ev.RescaleCompleted):
        job = state.jobs.get(event.job)
        measured = usable_throughput(event.world_before, event.samples_per_s_before)
        if measured and job is not None and job.status in ACTIVE and job.attempt == event.attempt:
            state.throughput.setdefault(event.job, {})[event.world_before] = event.samples_per_s_before  # type: ignore[assignment]
    elif isinstance(event, ev.RescaleProposed):
        if _placed_or_running(state, event.job):
            state.proposed[event.job] = (event.generation, event.at)
        if state.recorded_rules is None:
            state.rules = event.rules
    elif isinstance(event, ev.JobResized) and event.kind == "shrink":
        state.shrunk_at[event.job] = event.at
    elif isinstance(event, ev.ElasticConfigured) and params_ok:
        state.params = dict(event.params)
        state.rules = state.recorded_rules = event.rules
