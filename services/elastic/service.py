"""The live elastic service: the elastic decider on the log, with a clock tick so that waiting
periods (minimum interval between rescales, hold after a shrink) end even when nothing else
happens. It only proposes; the scheduler commits, the agents and the jobs' workers carry out."""

from __future__ import annotations

import argparse

from gpuherd import events as ev
from gpuherd.decider import decider_service_main, decider_service_parser
from services.elastic.decide import ElasticDecider
from services.elastic.policy import params_from

DESCRIPTION = "gpuherd elastic service"
EXAMPLE = '{"min_interval_s": 30}'
TICK_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    return decider_service_parser("elastic", description=DESCRIPTION, example=EXAMPLE, tick_s=TICK_S)


def main(argv: list[str] | None = None) -> None:
    decider_service_main(
        argv,
        ElasticDecider(),
        description=DESCRIPTION,
        configured=ev.ElasticConfigured,
        convert=params_from,
        example=EXAMPLE,
        tick_s=TICK_S,
    )
