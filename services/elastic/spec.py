"""The elastic service, as a service: its pure decider (``decide.py``) and this spec are all of it;
the generic shell runs it. It only proposes; the scheduler commits, the agents and the jobs'
workers carry out."""

import time
import uuid
from collections.abc import Awaitable

from gpuherd import events as ev
from gpuherd.runtime.runner import DeciderRunner
from gpuherd.runtime.spec import TimerSpec, switched_decider
from services.elastic.decide import ElasticDecider
from services.elastic.state import ElasticState

TICK_S = 10.0  # while elastic jobs run: minimum intervals and holds after a shrink end when due


def _may_grow(state: ElasticState) -> bool:
    """Whether time alone can make a decision due: elastic jobs run and nothing waits (a grow's
    minimum interval or hold may end). While jobs wait, their shrinks are decided as events come, and
    nothing is lent."""
    return state.elastic_running > 0 and not state.queue


def rules_recorder(runner: DeciderRunner[ElasticState]) -> Awaitable[None]:
    """Once caught up, record this service's rules in the log unless it has them (its parameters
    stay): every later proposal is then audited by the rules it was made by."""

    async def record() -> None:
        await runner.caught_up.wait()
        state = runner.state
        if state.recorded_rules == ev.ELASTIC_RULES:
            return
        params = dict(state.params or {})
        event = ev.ElasticConfigured(
            id=f"elastic:rules:{uuid.uuid4().hex}", at=time.time(), source="elastic", params=params
        )
        await runner.append_input([event])  # fenced, as its decisions

    return record()


SPEC = switched_decider(
    ElasticDecider,
    "grows and shrinks running elastic jobs",
    TimerSpec(ev.ElasticTicked, TICK_S, needed=_may_grow, on_grid=True),
    tasks=lambda args: [rules_recorder],
)
