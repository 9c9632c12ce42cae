"""The memory broker's decider: memory leases from the log alone.

Every event that can change spare memory, a lease or a borrower's life runs one pass of
``policy.decide``; its own timer (``MemoryTicked``, while leases exist) makes expiries and
deadlines fire when due, so a replay decides the same. Its parameters are the log's latest
``MemoryBrokerConfigured``, and so are the rules of its policy (``MEMORY_RULES``; the first in a log
that recorded none); one it cannot apply is refused (``CommandRefused``).
"""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.runtime.decider import ConfiguredDecider
from services.memory.policy import BrokerParams, decide, keeps_leaving_workers_leases, params_from, request_problem
from services.memory.state import MemoryState, evolve

# What can change spare memory or a lease: the leases' own life, memory use reported, a borrower's
# or a lender's job starting, resizing (a rescale completed: its leaving workers' GPUs are released,
# their leases reclaimed) or ending, a node lost or back, a GPU's health, time (its own tick), and
# its parameters.
TRIGGERS: frozenset[type[ev.Event]] = frozenset(
    {ev.MemoryLeaseRequested, ev.MemoryLeaseReleased, ev.MemoryLeaseRenewed, ev.GpuMemoryReported}
    | {ev.JobPlaced, ev.JobStarted, ev.JobResized, ev.RescaleCompleted, ev.JobFinished, ev.JobRequeued}
    | {ev.NodeLost, ev.NodeRegistered, ev.GpuHealthChanged, ev.MemoryTicked, ev.MemoryBrokerConfigured}
)


class MemoryDecider(ConfiguredDecider[MemoryState, BrokerParams]):
    name = "memory"
    STATE, FOLD = MemoryState, staticmethod(evolve)
    PARAMS, CONVERT = BrokerParams, staticmethod(params_from)
    # 3: the rules in force; 4: what was lent at each node's latest memory report; 5: what of it
    # borrowers had allocated (``reported_borrowed_mb``)
    STATE_FORMAT = 5
    TRIGGERS, CONFIGURED, PARAMS_EXAMPLE = TRIGGERS, ev.MemoryBrokerConfigured, '{"lease_term_s": 300}'
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

    def decide(self, state: MemoryState, event: ev.Event) -> list[ev.Event]:
        if not self.triggered(event):
            return []
        if isinstance(event, ev.RescaleCompleted) and not keeps_leaving_workers_leases(state):
            return []  # (rules 1 made no pass there: a replay of their log decides where they did)
        refusal = self.refusal(event)
        if refusal:
            return refusal
        params = self.params_for(state)
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
