"""The analytics service's own state: the core fold plus its duration model (learned from every
finished job), the jobs it predicted, and the history of node demand energy saving forecasts from."""

from __future__ import annotations

import math

import msgspec

from gpuherd import events as ev
from gpuherd.fold import TERMINAL, ClusterState, JobState, apply
from services.analytics.ces import CesParams, DemandHistory
from services.analytics.predict import DurationModel, Features


class AnalyticsState(ClusterState, kw_only=True, gc=False):
    model: DurationModel = msgspec.field(default_factory=DurationModel)
    predicted: dict[str, None] = msgspec.field(default_factory=dict)  # jobs with a JobDurationPredicted
    demand: DemandHistory = msgspec.field(default_factory=DemandHistory)
    last_power_down_at: float = -1e18


def features(job: JobState) -> Features:
    return Features(vc=job.spec.vc, gpus=job.spec.gpus, user=job.spec.user, name=job.spec.name)


def demand_nodes(state: ClusterState) -> int:
    """Nodes running anything, plus the nodes the jobs waiting for GPUs would fill."""
    busy = sum(1 for n in state.nodes.values() if n.status != "lost" and n.busy())
    waiting = sum(state.jobs[j].spec.gpus for j in state.queue if not state.jobs[j].cancel_requested)
    if not waiting:
        return busy
    free = sum(len(n.free_gpus()) for n in state.nodes.values() if n.accepts_work())
    per_node = max(state.max_gpus_per_node(), 1)
    return busy + math.ceil(max(0, waiting - free) / per_node)


def evolve(state: AnalyticsState, seq: int, event: ev.Event, ces: CesParams | None) -> AnalyticsState:
    """Fold ``event``: the model learns a job's run time when it finishes (never from the future)."""
    if isinstance(event, ev.JobFinished):
        job = state.jobs.get(event.job)
        was_active = job is not None and job.status not in TERMINAL
        apply(state, seq, event)
        if job is not None and was_active and job.service_gpu_s > 0:
            state.model.observe(features(job), job.service_gpu_s / job.spec.gpus)
        if event.job not in state.jobs:
            state.predicted.pop(event.job, None)
        return state
    apply(state, seq, event)
    if isinstance(event, ev.JobDurationPredicted) and event.job in state.jobs:
        state.predicted[event.job] = None
    elif isinstance(event, ev.NodePowerDownRequested):
        state.last_power_down_at = event.at
    elif isinstance(event, ev.AnalyticsTicked) and ces is not None:
        state.demand.record(event.at, demand_nodes(state), ces)
    return state
