"""The elastic service, as a service: its pure decider (``decide.py``) and this spec are all of it;
the generic shell runs it. It only proposes; the scheduler commits, the agents and the jobs'
workers carry out."""

import functools

from gpuherd import events as ev
from gpuherd.runtime.serve import rules_recorder
from gpuherd.runtime.spec import BACKGROUND_NICE, TimerSpec, switched_decider
from services.elastic.decide import ElasticDecider, rules_in_force
from services.elastic.policy import ElasticParams, next_due, params_from
from services.elastic.state import ElasticState

TICK_S = 10.0  # live: how often the timer looks whether a decision is due
# A rescale is weighed over seconds of profiles and is worth it over minutes: reading the log in
# batches up to 20 ms apart costs a proposal at most that, and spares the host a wake-up for every
# job event.
READ_LINGER_S = 0.02


def _next_due(state: ElasticState) -> float | None:
    """When time alone next makes a decision due (a grow's minimum interval or hold ends, a
    proposal may be retried): the timer ticks then, and only then."""
    return next_due(state, _params(state.params), rules_in_force(state))


@functools.lru_cache(maxsize=64)
def _cached_params(items: tuple[tuple[str, float], ...]) -> ElasticParams:
    return params_from(dict(items))


def _params(values: dict[str, float] | None) -> ElasticParams:
    return _cached_params(tuple(sorted((values or {}).items())))


SPEC = switched_decider(
    ElasticDecider,
    "grows and shrinks running elastic jobs",
    TimerSpec(ev.ElasticTicked, TICK_S, needed=lambda state: False, due=_next_due),
    tasks=lambda args: [rules_recorder(ev.ElasticConfigured, lambda state: state.recorded_rules, ev.ELASTIC_RULES)],
    read_linger_s=READ_LINGER_S,
    nice=BACKGROUND_NICE,
)
