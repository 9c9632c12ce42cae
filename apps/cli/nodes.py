"""Nodes: ``nodes`` (their GPUs, what runs on them, and why one is drained, lost or off)."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
from rich.table import Table

from apps.cli.common import console, log_state, plain, print_json


def cmd_nodes(args: argparse.Namespace) -> int:
    state = log_state(args)
    nodes = sorted(state.nodes.values(), key=lambda n: n.node)
    if args.json:
        print_json([msgspec.to_builtins(n) for n in nodes])
        return 0
    table = Table(title=f"nodes ({len(nodes)})")
    for col in ("node", "status", "power", "executor", "rack", "gpus", "free", "jobs", "why"):
        # (a node's name whole on one line; its jobs' ids and the reasons fold, never "…": ids are typed again)
        table.add_column(
            col, no_wrap=col == "node", overflow="fold" if col in ("node", "rack", "jobs", "why") else "ellipsis"
        )
    for n in nodes:
        jobs = sorted({g.job for g in n.gpus if g.job})
        why = [n.reason] * bool(n.reason) + [f"GPU {g.info.index}: {g.health_reason}" for g in n.gpus if not g.healthy]
        cells = (
            n.node,
            n.status,
            n.power,
            n.executor,
            n.rack,
            str(len(n.gpus)),
            str(len(n.free_gpus())),
            ", ".join(jobs),  # (every id whole: cut at 60 characters, the last one was no id)
            "; ".join(why),
        )
        table.add_row(*map(plain, cells))
    console.print(table)
    return 0


def add_commands(sub: Any) -> None:
    n = sub.add_parser("nodes", help="list nodes and their GPUs")
    n.add_argument("--json", action="store_true", help="print JSON instead of a table")
    n.set_defaults(func=cmd_nodes)
