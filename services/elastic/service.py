"""The live elastic service: the elastic decider on the log, with a clock tick so that waiting
periods (minimum interval between rescales, hold after a shrink) end even when nothing else
happens. It only proposes; the scheduler commits, the agents and the jobs' workers carry out."""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.decider import decider_service_main
from services.elastic.decide import ElasticDecider
from services.elastic.policy import params_from


def main(argv: list[str] | None = None) -> None:
    decider_service_main(
        argv,
        ElasticDecider(),
        description="gpuherd elastic service",
        configured=ev.ElasticConfigured,
        convert=params_from,
        example='{"min_interval_s": 30}',
        tick_s=10.0,
    )
