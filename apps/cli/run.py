"""Running gpuherd: ``up`` (a whole cluster on this machine) and ``serve`` (one process)."""

from __future__ import annotations

import argparse
from typing import Any

from apps import registry
from apps.cluster.up import run_cluster
from gpuherd.runtime import shell


def cmd_serve(args: argparse.Namespace) -> int:
    shell.main(registry.spec(args.service), args.args, peers=registry.specs())
    return 0


def add_commands(sub: Any) -> None:
    up = sub.add_parser("up", help="start NATS (unless NATS_URL), the services and node agents")
    up.add_argument("--agents", type=int, default=2, help="simulated node agents (sim executor)")
    up.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of each sim agent")
    up.add_argument("--cpu-agents", type=int, default=2, help="agents that run real processes on CPU")
    up.add_argument("--cpu-gpus", type=int, default=4, help="virtual GPUs of each cpu agent (2 NVLink islands)")
    up.add_argument("--nvml", action="store_true", help="also run an nvml agent for this machine's GPUs")
    up.add_argument("--policy", default=None, help="record this policy at start (default: keep the log's; fifo)")
    up.add_argument("--vcs", default=None, help="a YAML/JSON file of virtual clusters to configure at start")
    up.add_argument("--lost-after", type=float, default=10.0, help="seconds without heartbeat before a node is lost")
    up.add_argument(
        "--demo", choices=["philly"], default=None, help="submit a demo workload and report, then keep serving"
    )
    up.add_argument("--exit-after-demo", action="store_true", help="stop the cluster once the demo has reported")
    up.add_argument("--demo-jobs", type=int, default=300, help="trace jobs the demo submits")
    up.add_argument("--demo-seconds", type=float, default=45.0, help="wall time the demo's arrivals span")
    up.add_argument("--trace", default=None, help="path of philly.csv (default: ../shared/traces/philly/philly.csv)")
    up.add_argument("--fresh", action="store_true", help="start from an empty data folder")
    up.add_argument(
        "--fast-unsafe-fsync",
        action="store_true",
        help="the embedded NATS fsyncs every 2 minutes instead of before each acknowledgement: faster, and a "
        "power cut loses acknowledged jobs (benchmarks only; also GPUHERD_UNSAFE_FSYNC=1)",
    )
    up.add_argument("--ui-port", type=int, default=8080, help="the dashboard's port (0: any free one; -1: none)")
    up.add_argument(
        "--ui-token-file",
        default=None,
        help="the dashboard's operator token file (default: DATA_DIR/dashboard.token, made private on the first up)",
    )
    up.add_argument(
        "--ui-read-only", action="store_true", help="a dashboard without operator actions (cancel, drain, audit)"
    )
    up.set_defaults(func=run_cluster)

    sv = sub.add_parser(
        "serve",
        help="run one service or a node agent in the foreground (what each container of the deployment runs)",
        description="Run one gpuherd process; the arguments after the name are its own (see `gpuherd serve NAME -h`).",
    )
    sv.add_argument("service", choices=[s.name for s in registry.specs()], help="the service or agent to run")
    sv.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments (see `gpuherd serve NAME -h`)")
    sv.set_defaults(func=cmd_serve)
