"""The analytics service's own state: the core fold plus its duration model (learned from every
finished job), the predictions it made and recorded, and the history of node demand energy saving
forecasts from.

A submission is predicted when it is folded (the model as it stands then: it has learned from every
job finished before, never from the future); the decider records that prediction. The model learns
only here, from the log, so a replay rebuilds it exactly."""

from __future__ import annotations

import math

import msgspec

from gpuherd import events as ev
from gpuherd.fold import TERMINAL, ClusterState, JobState, apply
from services.analytics.ces import CesParams, DemandHistory
from services.analytics.predict import DurationModel, Features, Prediction


class AnalyticsState(ClusterState, kw_only=True, gc=False):
    model: DurationModel = msgspec.field(default_factory=DurationModel)
    # Jobs with a recorded JobDurationPredicted -> its (seconds, sigma): the latest one in force
    predicted: dict[str, tuple[float, float]] = msgspec.field(default_factory=dict)
    fresh: dict[str, Prediction] = msgspec.field(default_factory=dict)  # made at submission, not yet recorded
    demand: DemandHistory = msgspec.field(default_factory=DemandHistory)
    last_power_down_at: float = -1e18


def features(job: JobState) -> Features:
    spec = job.spec
    name = spec.name
    if spec.command:  # the script's name says more than a free-form job name, where both are given
        name = f"{name}|{' '.join(spec.command[:2])}"
    return Features(vc=spec.vc, gpus=spec.gpus, user=spec.user, name=name, nodes=spec.nodes or 0, at=job.submitted_at)


def demand_nodes(state: ClusterState) -> int:
    """Nodes running anything, plus the nodes the jobs waiting for GPUs would fill: what does not fit
    the free GPUs of the busy nodes needs more nodes. (The free GPUs of an idle node are no room of
    a node already counted: counted against the waiting GPUs, they read the idle node a waiting job
    needs as spare, and energy saving powered it down.)"""
    busy = sum(1 for n in state.nodes.values() if n.status != "lost" and n.busy())
    waiting = sum(state.jobs[j].spec.gpus for j in state.queue if not state.jobs[j].cancel_requested)
    if not waiting:
        return busy
    free = sum(len(n.free_gpus()) for n in state.nodes.values() if n.accepts_work() and n.busy())
    per_node = max(state.max_gpus_per_node(), 1)
    return busy + math.ceil(max(0, waiting - free) / per_node)


def evolve(
    state: AnalyticsState, seq: int, event: ev.Event, ces: CesParams | None, *, predict: bool = True
) -> AnalyticsState:
    """Fold ``event``: a submission is predicted, and the model learns a job's run time when it
    finishes (never from the future)."""
    # (By exact type, as the core fold and the scheduler dispatch: no event type subclasses another,
    # and this runs for every event.)
    if type(event) is ev.JobFinished:
        job = state.jobs.get(event.job)
        was_active = job is not None and job.status not in TERMINAL
        apply(state, seq, event)
        if job is not None and was_active and predict:
            if job.service_gpu_s > 0:
                state.model.observe(job.job, features(job), job.service_gpu_s / job.spec.gpus)
            else:
                state.model.forget(job.job, features(job))
        if event.job not in state.jobs:
            state.predicted.pop(event.job, None)
            state.fresh.pop(event.job, None)
        return state
    new = type(event) is ev.JobSubmitted and event.job not in state.jobs
    apply(state, seq, event)
    if new and predict and event.job in state.jobs:  # type: ignore[union-attr]
        job = state.jobs[event.job]  # type: ignore[union-attr]
        state.fresh[job.job] = state.model.submit(job.job, features(job))
    elif type(event) is ev.JobDurationPredicted and event.job in state.jobs:
        state.predicted[event.job] = (event.seconds, event.sigma)
        state.fresh.pop(event.job, None)
        if predict:
            state.model.recorded(event.job, event.seconds, event.sigma)
    elif type(event) is ev.NodePowerDownRequested:
        state.last_power_down_at = event.at
    elif type(event) is ev.AnalyticsTicked and ces is not None:
        state.demand.record(event.at, demand_nodes(state), ces)
    return state
