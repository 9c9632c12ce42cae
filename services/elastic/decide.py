"""The elastic decider: proposes resizes of running elastic jobs, from the log alone.

State: the cluster (the same fold as every service), each job's profile numbers (from
``ProfileReported``), when each job last shrank for waiting jobs (hysteresis), and its last
proposal (so a proposal is not repeated before the scheduler answered it). It decides on the
events that change demand or supply (submissions, ends, placements, rescales, nodes) and on its
own clock ticks, so time-based rules (minimum interval, hold after a shrink) fire when due and a
replay decides the same.
"""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.decider import Decider, RecordedParams
from gpuherd.state import ClusterState, apply
from services.elastic.policy import ElasticParams, JobModel, decide, params_from

TRIGGERS: tuple[type[ev.Event], ...] = (
    ev.JobSubmitted,
    ev.JobStarted,
    ev.JobFinished,
    ev.JobRequeued,
    ev.JobPlaced,
    ev.RescaleCompleted,
    ev.NodeRegistered,
    ev.NodeUndrained,
    ev.ClockTicked,
    ev.JobCancelRequested,
    ev.ElasticConfigured,
)


class ElasticServiceState(msgspec.Struct, kw_only=True):
    seq: int = 0
    now: float = 0.0
    cluster: ClusterState = msgspec.field(default_factory=ClusterState)
    models: dict[str, JobModel] = msgspec.field(default_factory=dict)
    shrunk_at: dict[str, float] = msgspec.field(default_factory=dict)  # job -> its last shrink for waiting jobs
    proposed: dict[str, tuple[int, float]] = msgspec.field(default_factory=dict)  # job -> (generation, at)
    params: dict[str, float] | None = None  # the latest ElasticConfigured (None: the decider's default)


def job_model(profile: dict) -> JobModel | None:
    """A job's compute time per sample and gradient bytes, from its per-layer profile."""
    try:
        batch = int(profile["batch_size"])
        step_s = float(profile["step_s"])
        grad_bytes = sum(int(layer.get("grad_bytes", 0)) for layer in profile["layers"])
    except (KeyError, TypeError, ValueError):
        return None
    if batch <= 0 or step_s <= 0:
        return None
    return JobModel(compute_per_sample_s=step_s / batch, grad_bytes=grad_bytes)


class ElasticDecider(Decider[ElasticServiceState]):
    name = "elastic"

    def __init__(self, params: ElasticParams | None = None) -> None:
        self.params = RecordedParams(
            params or ElasticParams(), params_from
        )  # the default until the log records ElasticConfigured

    def params_for(self, state: ElasticServiceState) -> ElasticParams:
        """The parameters in force: the log's latest ElasticConfigured, else this decider's own."""
        return self.params.get(state.params)

    def initial_state(self) -> ElasticServiceState:
        return ElasticServiceState()

    def evolve(self, state: ElasticServiceState, seq: int, event: ev.Event) -> ElasticServiceState:
        apply(state.cluster, seq, event)
        if isinstance(event, ev.ProfileReported) and event.rank == 0:
            model = job_model(event.profile)
            if model is not None:
                state.models[event.job] = model
        elif isinstance(event, ev.RescaleProposed):
            state.proposed[event.job] = (event.generation, event.at)
        elif isinstance(event, ev.JobResized) and event.kind == "shrink":
            state.shrunk_at[event.job] = event.at
        elif isinstance(event, ev.ElasticConfigured):
            state.params = dict(event.params)
        elif isinstance(event, ev.JobFinished):
            for table in (state.models, state.shrunk_at, state.proposed):
                table.pop(event.job, None)
        state.seq = seq
        state.now = state.cluster.now
        return state

    def decide(self, state: ElasticServiceState, event: ev.Event) -> list[ev.Event]:
        if not isinstance(event, TRIGGERS):
            return []
        params = self.params_for(state)
        return list(decide(state.cluster, state.models, params, shrunk_at=state.shrunk_at, proposed=state.proposed))

    def encode_state(self, state: ElasticServiceState) -> bytes:
        return msgspec.msgpack.encode(state)

    def decode_state(self, data: bytes) -> ElasticServiceState:
        return msgspec.msgpack.decode(data, type=ElasticServiceState)
