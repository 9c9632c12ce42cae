"""The live elastic service: the elastic decider on the log, with a clock tick so that waiting
periods (minimum interval between rescales, hold after a shrink) end even when nothing else
happens. It only proposes; the scheduler commits, the agents and the jobs' workers carry out."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from gpuherd import events as ev
from gpuherd.decider import params_argument, serve_decider
from gpuherd.obs import configure
from services.elastic.decide import ElasticDecider
from services.elastic.policy import params_from


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpuherd-elastic", description="gpuherd elastic service")
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument(
        "--params", default=None, help='record these ElasticParams (JSON, e.g. {"min_interval_s": 30}) before starting'
    )
    parser.add_argument("--tick", type=float, default=10.0, help="seconds between clock ticks")
    parser.add_argument("--instance", default=None)
    args = parser.parse_args(argv)
    configure("elastic")
    try:
        params = params_argument(args.params, params_from)
    except ValueError as exc:
        parser.error(f"--params: {exc}")
    now = time.time()
    configured = (
        None
        if params is None
        else ev.ElasticConfigured(id=f"elastic:config:{os.getpid()}:{now:.6f}", at=now, source="elastic", params=params)
    )
    asyncio.run(
        serve_decider(args.nats_url, ElasticDecider(), tick_s=args.tick, configured=configured, instance=args.instance)
    )
