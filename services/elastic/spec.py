"""The elastic service, as a service: its pure decider (``decide.py``) and this spec are all of it;
the generic shell runs it. It only proposes; the scheduler commits, the agents and the jobs'
workers carry out."""

from gpuherd import events as ev
from gpuherd.runtime.spec import TimerSpec, switched_decider
from services.elastic.decide import ElasticDecider
from services.elastic.state import ElasticState

TICK_S = 10.0  # while elastic jobs run: minimum intervals and holds after a shrink end when due


def _running(state: ElasticState) -> bool:
    return state.elastic_running > 0


SPEC = switched_decider(
    ElasticDecider, "grows and shrinks running elastic jobs", TimerSpec(ev.ElasticTicked, TICK_S, needed=_running)
)
