"""The dashboard's read model on a long history: what it holds, and what a job list costs.

A history of ``--jobs`` jobs run to the end (the simulator, on 1-8 GPU jobs arriving at 75% of the
cluster's capacity) is folded into the dashboard's view twice: as it is (it remembers the latest
``ENDED_KEPT`` jobs to end), and, as the baseline, remembering every ended job (what it did before:
its memory grew with every job the cluster ever ran). For each: the memory the view holds once
folded (tracemalloc, in a fold of its own), the fold's time, and ``/api/jobs``' first page (the
view's ``jobs()``, median of 5). Target: the view's memory does not grow with the history once
more than ``ENDED_KEPT`` jobs have ended.

Usage: python bench/bench_dashboard_memory.py [--jobs 60000] [--nodes 200] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from typing import Any

from bench_restart import history
from rich.console import Console
from rich.table import Table

from gpuherd import events as ev
from services.dashboard.view import ENDED_KEPT, DashboardView

console = Console(stderr=True)
EVERY_JOB = 2**62  # the baseline: no ended job is forgotten


def measure(events: list[ev.Event], ended_kept: int) -> dict[str, Any]:
    view = DashboardView(ended_kept=ended_kept)
    began = time.perf_counter()
    for seq, event in enumerate(events, 1):
        view.fold(seq, event)
    fold_s = time.perf_counter() - began
    pages = []
    for _ in range(5):
        began = time.perf_counter()
        view.jobs(limit=200)
        pages.append(time.perf_counter() - began)
    del view
    gc.collect()
    traced = DashboardView(ended_kept=ended_kept)
    tracemalloc.start()
    for seq, event in enumerate(events, 1):
        traced.fold(seq, event)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "jobs_remembered": len(traced.state.jobs),
        "forgotten": traced.forgotten,
        "held_mb": held / 2**20,
        "fold_s": fold_s,
        "jobs_page_ms": statistics.median(pages) * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60_000)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures instead")
    args = parser.parse_args()
    events, _ = history(args.jobs, args.nodes, args.seed)
    figures = {
        "jobs": args.jobs,
        "events": len(events),
        "ended_kept": ENDED_KEPT,
        "bounded": measure(events, ENDED_KEPT),
        "every_job": measure(events, EVERY_JOB),
    }
    bounded, every = figures["bounded"], figures["every_job"]
    figures["memory_ratio"] = every["held_mb"] / bounded["held_mb"]
    if args.json:
        print(json.dumps(figures))
        return 0
    table = Table(title=f"dashboard view of {args.jobs:,} ended jobs ({len(events):,} events)")
    for column in ("view", "jobs remembered", "memory held MB", "fold s", "/api/jobs page ms"):
        table.add_column(column, justify="right")
    for name, row in ((f"latest {ENDED_KEPT:,} ended", bounded), ("every job (before)", every)):
        table.add_row(
            name,
            f"{row['jobs_remembered']:,}",
            f"{row['held_mb']:.1f}",
            f"{row['fold_s']:.1f}",
            f"{row['jobs_page_ms']:.1f}",
        )
    console.print(table)
    console.print(f"memory: the baseline holds {figures['memory_ratio']:.1f}x what the bounded view holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
