"""The live elastic service: the elastic decider on the log, with a clock tick so that waiting
periods (minimum interval between rescales, hold after a shrink) end even when nothing else
happens. It only proposes; the scheduler commits, the agents and the jobs' workers carry out."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

from gpuherd import events as ev
from gpuherd.aio import serve_until_signal
from gpuherd.decider import DeciderRunner, append_reliably, clock_ticker
from gpuherd.log import open_log
from gpuherd.obs import configure
from services.elastic.decide import ElasticDecider
from services.elastic.policy import params_from


async def serve(url: str, *, params: dict[str, float] | None, tick_s: float, instance: str | None = None) -> None:
    """``params``: record them as the service's parameters (ElasticConfigured) before it starts;
    None: keep what the log last recorded (or the defaults)."""
    instance = instance or f"{socket.gethostname()}-{os.getpid()}"
    log_ = await open_log(url, name=f"elastic-{instance}")
    if params is not None:
        now = time.time()
        configured = ev.ElasticConfigured(
            id=f"elastic:config:{instance}:{now:.6f}", at=now, source="elastic", params=params
        )
        await append_reliably(log_, [configured])
    runner = DeciderRunner(log_, ElasticDecider(), instance=instance, extra_tasks=[clock_ticker("elastic", tick_s)])
    try:
        await serve_until_signal(runner.run)
    finally:
        await log_.close()


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
    params = None
    if args.params is not None:
        try:
            params = {k: float(v) for k, v in json.loads(args.params).items()}
            params_from(params)
        except (ValueError, TypeError, AttributeError) as exc:
            parser.error(f"--params: {exc}")
    asyncio.run(serve(args.nats_url, params=params, tick_s=args.tick, instance=args.instance))
