"""The elastic decider: proposes resizes of running elastic jobs, from the log alone.

It decides on the events that change demand or supply (submissions, ends, placements, rescales,
nodes) and on its own timer, so time-based rules (minimum interval, hold after a shrink) fire when
due and a replay decides the same. Its parameters are the log's latest ``ElasticConfigured``; one
it cannot apply is refused (``CommandRefused``) and the parameters before it stay in force.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gpuherd import events as ev
from gpuherd.runtime.decider import ConfiguredDecider
from services.elastic.policy import ElasticParams, decide, params_from
from services.elastic.state import ElasticState, evolve

# What can change whether a rescale pays: demand (jobs arriving, ending, cancelled), supply (GPUs
# freed, nodes back), a rescale done, time (its own tick), and its parameters.
TRIGGERS: frozenset[type[ev.Event]] = frozenset(
    {ev.JobSubmitted, ev.JobStarted, ev.JobFinished, ev.JobRequeued, ev.JobPlaced, ev.JobCancelRequested}
    | {ev.NodeRegistered, ev.NodeUndrained, ev.RescaleCompleted, ev.ElasticTicked, ev.ElasticConfigured}
)


def rules_in_force(state: ElasticState) -> int:
    """The policy's rules in force: the log's, else this service's own."""
    return state.rules if state.rules is not None else ev.ELASTIC_RULES


class ElasticDecider(ConfiguredDecider[ElasticState, ElasticParams]):
    name = "elastic"
    STATE, FOLD = ElasticState, staticmethod(evolve)
    PARAMS, CONVERT = ElasticParams, staticmethod(params_from)
    STATE_FORMAT = 4  # 3: placed and running elastic jobs indexed; 4: the rules in force
    TRIGGERS, CONFIGURED, PARAMS_EXAMPLE = TRIGGERS, ev.ElasticConfigured, '{"min_interval_s": 30}'
    EMITS = frozenset({ev.RescaleProposed, ev.CommandRefused, ev.ElasticTicked})

    def rules_for(self, state: ElasticState) -> int:
        return rules_in_force(state)

    def audit_state(self, state: ElasticState, recorded: Sequence[ev.Event]) -> ElasticState:
        """On a log that has recorded no rules yet, proposals are re-decided by the rules they carry:
        the state says nothing of which service decided them (one of rules 1, which recorded none,
        or this one before its own rules are recorded), and learns a proposal's rules only once it
        is folded, after its ``based_on``."""
        carried = {e.rules for e in recorded if isinstance(e, ev.RescaleProposed)}
        if state.rules is not None or len(carried) != 1:
            return state
        return msgspec.structs.replace(state, rules=carried.pop())

    def decide(self, state: ElasticState, event: ev.Event) -> list[ev.Event]:
        if not self.triggered(event):
            return []
        out = self.refusal(event)
        if state.elastic_running or isinstance(event, ev.ElasticTicked | ev.ElasticConfigured):
            out += decide(state, self.params_for(state), self.rules_for(state))
        return out
