"""The live memory broker: the memory decider on the log, with a timer (``MemoryTicked``, while
leases exist) so that lease expiries and revocation deadlines fire when due even when nothing else
happens. It owns memory leases only; GPUs stay the scheduler's, and agents carry out what it decides."""

from __future__ import annotations

import argparse
import asyncio

from gpuherd import events as ev
from gpuherd.obs import configure
from gpuherd.runtime.serve import configured_event, serve_decider
from gpuherd.runtime.timers import clock_ticker
from gpuherd.service_args import add_params_argument, params_argument, service_parser
from services.memory.decide import MemoryDecider
from services.memory.policy import params_from

TICK_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("memory", "gpuherd neighbor-GPU memory broker")
    add_params_argument(parser, '{"lease_term_s": 300}')
    parser.add_argument("--tick", type=float, default=TICK_S, help="seconds between clock ticks")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure("memory")
    try:
        params = params_argument(args.params, params_from)
    except ValueError as exc:
        parser.error(f"--params: {exc}")
    decider = MemoryDecider()
    ticker = clock_ticker(ev.MemoryTicked, args.tick, needed=lambda state: bool(state.leases))
    configured = None if params is None else configured_event(ev.MemoryBrokerConfigured, decider.name, params)
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
