"""The memory broker's decider: memory leases from the log alone.

State: the cluster (the same fold as every service: GPUs' reported memory, jobs' peaks, leases)
and the parameters the log last recorded. Every event that can change spare memory, a lease or
a borrower's life runs one pass of ``policy.decide``; its own clock ticks make expiries and
deadlines fire when due, so a replay decides the same.
"""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.decider import Decider, RecordedParams
from gpuherd.state import ClusterState, apply
from services.memory.policy import BrokerParams, decide, params_from, request_problem

TRIGGERS: tuple[type[ev.Event], ...] = (
    ev.MemoryLeaseRequested,
    ev.MemoryLeaseReleased,
    ev.MemoryLeaseRenewed,
    ev.GpuMemoryReported,
    ev.JobPlaced,
    ev.JobStarted,
    ev.JobResized,
    ev.JobFinished,
    ev.JobRequeued,
    ev.NodeLost,
    ev.NodeRegistered,
    ev.GpuHealthChanged,
    ev.ClockTicked,
    ev.MemoryBrokerConfigured,
)


class MemoryBrokerState(msgspec.Struct, kw_only=True):
    seq: int = 0
    now: float = 0.0
    cluster: ClusterState = msgspec.field(default_factory=ClusterState)
    params: dict[str, float] | None = None  # the latest MemoryBrokerConfigured (None: the decider's default)


class MemoryDecider(Decider[MemoryBrokerState]):
    name = "memory"

    def __init__(self, params: BrokerParams | None = None) -> None:
        self.params = RecordedParams(
            params or BrokerParams(), params_from
        )  # the default until the log records MemoryBrokerConfigured

    def params_for(self, state: MemoryBrokerState) -> BrokerParams:
        """The parameters in force: the log's latest MemoryBrokerConfigured, else this decider's own."""
        return self.params.get(state.params)

    def initial_state(self) -> MemoryBrokerState:
        return MemoryBrokerState()

    def evolve(self, state: MemoryBrokerState, seq: int, event: ev.Event) -> MemoryBrokerState:
        apply(state.cluster, seq, event)
        if isinstance(event, ev.MemoryBrokerConfigured):
            state.params = dict(event.params)
        state.seq = seq
        state.now = state.cluster.now
        return state

    def decide(self, state: MemoryBrokerState, event: ev.Event) -> list[ev.Event]:
        if not isinstance(event, TRIGGERS):
            return []
        params = self.params_for(state)
        if isinstance(event, ev.MemoryLeaseRequested) and event.lease in state.cluster.leases:
            lease = state.cluster.leases[event.lease]
            problem = request_problem(state.cluster, event, params) if lease.status == "pending" else None
            if problem is not None:
                denied = ev.MemoryLeaseDenied(lease=event.lease, job=event.job, reason=problem)
                others = [e for e in decide(state.cluster, params) if getattr(e, "lease", None) != event.lease]
                return [denied, *others]
        return list(decide(state.cluster, params))

    def encode_state(self, state: MemoryBrokerState) -> bytes:
        return msgspec.msgpack.encode(state)

    def decode_state(self, data: bytes) -> MemoryBrokerState:
        return msgspec.msgpack.decode(data, type=MemoryBrokerState)
