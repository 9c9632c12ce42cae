"""The analytics decider: duration predictions and cluster energy saving, from the log alone.

State: the cluster (the same fold as every service), the duration model, and the CES demand
history. All three change only in ``evolve``, so a replay rebuilds them exactly.

- ``JobSubmitted`` -> ``JobDurationPredicted`` (the model as it stands: it has learned from
  every job finished before this submission, never from the future).
- ``JobFinished`` (folded) -> the model learns the job's run time (GPU-seconds / GPUs over all
  its attempts), if it ran at all.
- ``ClockTicked`` (with CES on) -> samples demand, forecasts its peak, and powers idle nodes
  down (``NodePowerDownRequested``) or powered-down nodes up (``NodePowerUpRequested``).
  The scheduler also asks for power-up when jobs wait for GPUs that only powered-down nodes
  have; the agents carry both out.
"""

from __future__ import annotations

import math

import msgspec

from gpuherd import events as ev
from gpuherd.decider import Decider
from gpuherd.state import ClusterState, JobState, apply
from services.analytics.ces import CesParams, DemandHistory, forecast_peak, plan_power
from services.analytics.predict import MODEL_NAME, DurationModel, Features


class AnalyticsState(msgspec.Struct, kw_only=True):
    seq: int = 0
    now: float = 0.0
    cluster: ClusterState = msgspec.field(default_factory=ClusterState)
    model: DurationModel = msgspec.field(default_factory=DurationModel)
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


class AnalyticsDecider(Decider[AnalyticsState]):
    name = "analytics"

    def __init__(self, *, predict: bool = True, ces: CesParams | None = None) -> None:
        self.predict = predict
        self.ces = ces  # None: no energy saving

    def initial_state(self) -> AnalyticsState:
        return AnalyticsState()

    def evolve(self, state: AnalyticsState, seq: int, event: ev.Event) -> AnalyticsState:
        cluster = state.cluster
        if isinstance(event, ev.JobFinished):
            job = cluster.jobs.get(event.job)
            was_active = job is not None and job.status not in ("completed", "failed", "cancelled")
            apply(cluster, seq, event)
            if job is not None and was_active and job.service_gpu_s > 0:
                state.model.observe(features(job), job.service_gpu_s / job.spec.gpus)
        else:
            apply(cluster, seq, event)
        if isinstance(event, ev.NodePowerDownRequested):
            state.last_power_down_at = event.at
        if isinstance(event, ev.ClockTicked) and self.ces is not None:
            state.demand.record(event.at, demand_nodes(cluster), self.ces)
        state.seq = seq
        state.now = cluster.now
        return state

    def decide(self, state: AnalyticsState, event: ev.Event) -> list[ev.Event]:
        if isinstance(event, ev.JobSubmitted) and self.predict:
            job = state.cluster.jobs.get(event.job)
            if job is None or job.status != "pending" or job.predicted_s is not None:
                return []
            guess = state.model.predict(features(job))
            return [ev.JobDurationPredicted(job=event.job, seconds=guess.seconds, model=MODEL_NAME, basis=guess.basis)]
        if isinstance(event, ev.ClockTicked) and self.ces is not None:
            return self._power(state, event.at)
        return []

    def _power(self, state: AnalyticsState, now: float) -> list[ev.Event]:
        cluster = state.cluster
        params = self.ces
        assert params is not None
        nodes = [n for n in cluster.nodes.values() if n.status == "up"]
        powered = [n for n in nodes if n.power in ("on", "booting")]
        forecast = forecast_peak(state.demand, now, params)
        plan = plan_power(len(powered), len(nodes), forecast, now, state.last_power_down_at, params)
        reason = f"forecast peak {forecast} nodes + buffer {params.buffer_nodes}; {len(powered)} powered"
        if plan.down:
            idle = sorted((n for n in nodes if n.power == "on" and not n.busy()), key=lambda n: n.node, reverse=True)
            return [ev.NodePowerDownRequested(node=n.node, reason=reason) for n in idle[: plan.down]]
        if plan.up:
            asleep = sorted((n for n in nodes if n.power in ("draining", "off")), key=lambda n: (n.power, n.node))
            return [ev.NodePowerUpRequested(node=n.node, reason=reason) for n in asleep[: plan.up]]
        return []

    def encode_state(self, state: AnalyticsState) -> bytes:
        return msgspec.msgpack.encode(state)

    def decode_state(self, data: bytes) -> AnalyticsState:
        return msgspec.msgpack.decode(data, type=AnalyticsState)
