"""The elastic decider: proposes resizes of running elastic jobs, from the log alone.

It decides on the events that change demand or supply (submissions, ends, placements, rescales,
nodes) and on its own timer, so time-based rules (minimum interval, hold after a shrink) fire when
due and a replay decides the same. Its parameters are the log's latest ``ElasticConfigured``; one
it cannot apply is refused (``CommandRefused``) and the parameters before it stay in force.
"""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.runtime.decider import Decider, RecordedParams, params_problem, refused
from services.elastic.policy import ElasticParams, decide, params_from
from services.elastic.state import ElasticState, evolve

TRIGGERS: frozenset[type[ev.Event]] = frozenset(
    {
        ev.JobSubmitted,
        ev.JobStarted,
        ev.JobFinished,
        ev.JobRequeued,
        ev.JobPlaced,
        ev.RescaleCompleted,
        ev.NodeRegistered,
        ev.NodeUndrained,
        ev.ElasticTicked,
        ev.JobCancelRequested,
        ev.ElasticConfigured,
    }
)


class ElasticDecider(Decider[ElasticState]):
    name = "elastic"
    STATE_FORMAT = 3  # 3: placed and running elastic jobs indexed
    FOLLOWS = TRIGGERS
    REFUSES = frozenset({ev.ElasticConfigured})
    EMITS = frozenset({ev.RescaleProposed, ev.CommandRefused, ev.ElasticTicked})

    def __init__(self, params: ElasticParams | None = None) -> None:
        # The default until the log records ElasticConfigured.
        self.params = RecordedParams(params or ElasticParams(), _lenient(params or ElasticParams()))

    def params_for(self, state: ElasticState) -> ElasticParams:
        """The parameters in force: the log's latest applied ElasticConfigured, else this decider's own."""
        return self.params.get(state.params)

    def initial_state(self) -> ElasticState:
        return ElasticState(retain_finished=False)

    def state_type(self) -> type[ElasticState]:
        return ElasticState

    def evolve(self, state: ElasticState, seq: int, event: ev.Event) -> ElasticState:
        ok = isinstance(event, ev.ElasticConfigured) and (
            event.unchecked or params_problem(event.params, params_from) is None
        )
        return evolve(state, seq, event, params_ok=ok)

    def decide(self, state: ElasticState, event: ev.Event) -> list[ev.Event]:
        # (Any tick: logs of older versions had one tick type for every service, and it triggered this.)
        if type(event) not in TRIGGERS and not isinstance(event, ev.Tick):
            return []
        out: list[ev.Event] = []
        if isinstance(event, ev.ElasticConfigured) and not event.unchecked:
            problem = params_problem(event.params, params_from)
            if problem is not None:
                out.append(refused(event, problem))
        if state.elastic_running or isinstance(event, ev.ElasticTicked | ev.ElasticConfigured):
            out += decide(state, self.params_for(state))
        return out


def _lenient(default: ElasticParams):
    """Parameters recorded unchecked (before commands were checked) that do not convert meant the
    default, as they did then."""

    def convert(values: dict[str, float]) -> ElasticParams:
        try:
            return params_from(values)
        except ValueError:
            return default

    return convert
