"""The live memory broker: the memory decider on the log, with a clock tick so that lease
expiries and revocation deadlines fire when due even when nothing else happens. It owns memory
leases only; GPUs stay the scheduler's, and agents carry out what it decides."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from gpuherd import events as ev
from gpuherd.decider import params_argument, serve_decider
from gpuherd.obs import configure
from services.memory.decide import MemoryDecider
from services.memory.policy import params_from


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpuherd-memory", description="gpuherd neighbor-GPU memory broker")
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument(
        "--params", default=None, help='record these BrokerParams (JSON, e.g. {"lease_term_s": 300}) before starting'
    )
    parser.add_argument("--tick", type=float, default=5.0, help="seconds between clock ticks")
    parser.add_argument("--instance", default=None)
    args = parser.parse_args(argv)
    configure("memory")
    try:
        params = params_argument(args.params, params_from)
    except ValueError as exc:
        parser.error(f"--params: {exc}")
    now = time.time()
    configured = (
        None
        if params is None
        else ev.MemoryBrokerConfigured(
            id=f"memory:config:{os.getpid()}:{now:.6f}", at=now, source="memory", params=params
        )
    )
    asyncio.run(
        serve_decider(args.nats_url, MemoryDecider(), tick_s=args.tick, configured=configured, instance=args.instance)
    )
