"""The memory broker's decider: memory leases from the log alone.

Every event that can change spare memory, a lease or a borrower's life runs one pass of
``policy.decide``; its own timer (``MemoryTicked``, while leases exist) makes expiries and
deadlines fire when due, so a replay decides the same. Its parameters are the log's latest
``MemoryBrokerConfigured``; one it cannot apply is refused (``CommandRefused``).
"""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.runtime.decider import Decider, RecordedParams, params_problem, refused
from services.memory.policy import BrokerParams, decide, params_from, request_problem
from services.memory.state import MemoryState, evolve

TRIGGERS: frozenset[type[ev.Event]] = frozenset(
    {
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
        ev.MemoryTicked,
        ev.MemoryBrokerConfigured,
    }
)


class MemoryDecider(Decider[MemoryState]):
    name = "memory"
    STATE_FORMAT = 2
    FOLLOWS = TRIGGERS
    REFUSES = frozenset({ev.MemoryBrokerConfigured})
    EMITS = frozenset(
        {
            ev.MemoryLeaseGranted,
            ev.MemoryLeaseDenied,
            ev.MemoryLeaseRevoked,
            ev.MemoryLeaseReclaimed,
            ev.CommandRefused,
            ev.MemoryTicked,
        }
    )

    def __init__(self, params: BrokerParams | None = None) -> None:
        default = params or BrokerParams()

        def lenient(values: dict[str, float]) -> BrokerParams:
            try:
                return params_from(values)
            except ValueError:
                return default  # recorded unchecked, before commands were checked: the default, as then

        self.params = RecordedParams(default, lenient)  # the default until the log records MemoryBrokerConfigured

    def params_for(self, state: MemoryState) -> BrokerParams:
        """The parameters in force: the log's latest applied MemoryBrokerConfigured, else this decider's own."""
        return self.params.get(state.params)

    def initial_state(self) -> MemoryState:
        return MemoryState(retain_finished=False)

    def state_type(self) -> type[MemoryState]:
        return MemoryState

    def evolve(self, state: MemoryState, seq: int, event: ev.Event) -> MemoryState:
        ok = isinstance(event, ev.MemoryBrokerConfigured) and (
            event.unchecked or params_problem(event.params, params_from) is None
        )
        return evolve(state, seq, event, params_ok=ok)

    def decide(self, state: MemoryState, event: ev.Event) -> list[ev.Event]:
        # (Any tick: logs of older versions had one tick type for every service, and it triggered this.)
        if type(event) not in TRIGGERS and not isinstance(event, ev.Tick):
            return []
        params = self.params_for(state)
        if isinstance(event, ev.MemoryBrokerConfigured) and not event.unchecked:
            problem = params_problem(event.params, params_from)
            if problem is not None:
                return [refused(event, problem)]
        if isinstance(event, ev.MemoryLeaseRequested) and event.lease in state.leases:
            lease = state.leases[event.lease]
            problem = request_problem(state, event, params) if lease.status == "pending" else None
            if problem is not None:
                denied = ev.MemoryLeaseDenied(lease=event.lease, job=event.job, reason=problem)
                others = [e for e in decide(state, params) if getattr(e, "lease", None) != event.lease]
                return [denied, *others]
        if not state.leases:
            return []  # nothing to lend, revoke or reclaim
        return list(decide(state, params))
