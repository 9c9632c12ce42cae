"""The ``gpuherd`` command: one module per command group, each adding its subcommands.

Tables for people; ``--json`` for machines. ``common`` is what the groups share; the groups
never import each other (import-linter holds them to it).
"""

from __future__ import annotations

import argparse
import os
import sys

from apps.cli import accounting, analytics, config, history, jobs, nodes, ops, profile, run
from apps.cli.common import DEFAULT_DATA_DIR, console, plain
from gpuherd.errors import GpuherdError

GROUPS = (run, jobs, nodes, config, history, accounting, analytics, profile, ops)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuherd", description="Event-sourced resource manager for DL training")
    parser.add_argument("--nats-url", default=None, help="NATS server (default: NATS_URL or the local cluster)")
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("GPUHERD_DATA_DIR", DEFAULT_DATA_DIR),
        help="where `up` keeps NATS data, logs, cluster file (default: GPUHERD_DATA_DIR, else .gpuherd; "
        "other commands also find the .gpuherd of a parent folder)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from gpuherd.obs import configure

    configure("cli", level=os.environ.get("GPUHERD_LOG_LEVEL", "WARNING"), json=False)  # logs go to stderr
    try:
        sys.exit(args.func(args))
    except GpuherdError as exc:
        console.print(f"[red]error:[/red] {plain(exc)}", highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
