"""The live elastic service: the elastic decider on the log, with a timer (``ElasticTicked``) while
elastic jobs run, so that waiting periods (minimum interval between rescales, hold after a shrink)
end even when nothing else happens. It only proposes; the scheduler commits, the agents and the
jobs' workers carry out."""

from __future__ import annotations

import argparse
import asyncio

from gpuherd import events as ev
from gpuherd.obs import configure
from gpuherd.runtime.serve import configured_event, serve_decider
from gpuherd.runtime.timers import clock_ticker
from gpuherd.service_args import add_params_argument, params_argument, service_parser
from services.elastic.decide import ElasticDecider
from services.elastic.policy import params_from

TICK_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("elastic", "gpuherd elastic service: grows and shrinks running elastic jobs")
    add_params_argument(parser, '{"min_interval_s": 30}')
    parser.add_argument("--tick", type=float, default=TICK_S, help="seconds between clock ticks")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure("elastic")
    try:
        params = params_argument(args.params, params_from)
    except ValueError as exc:
        parser.error(f"--params: {exc}")
    decider = ElasticDecider()
    ticker = clock_ticker(ev.ElasticTicked, args.tick, needed=lambda state: state.elastic_running > 0)
    configured = None if params is None else configured_event(ev.ElasticConfigured, decider.name, params)
    asyncio.run(
        serve_decider(
            args.nats_url,
            decider,
            extra_tasks=[ticker],
            configured=configured,
            instance=args.instance,
            metrics_port=args.metrics_port,
        )
    )
