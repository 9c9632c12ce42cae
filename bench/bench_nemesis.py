"""The nemesis, long: a gpuherd cluster of network-namespace hosts under a seeded schedule of real
faults, judged from the outside (``apps/nemesis``).

A 3-node JetStream cluster (R3 streams, stores on lazyfs), 2 scheduler replicas, 4 cpu node agents
running real job processes and an intake client submitting at a steady rate; faults of every kind
(partition, pause, kill, power loss, clock, latency), overlapping where the kind allows. Then the
checker: acknowledged, lost, duplicated, double booked, overlapping attempts, audit mismatches, and
each fault's recovery time (healed -> the cluster placing again). Before it, the power-cut
demonstration: the same coordinated power cut of all three NATS servers with nats-server's old
default (fsync every 2 minutes) and with gpuherd's (``sync_interval: always``).

Needs root (network namespaces); a fault kind whose facility is missing is skipped by name.
``make nemesis`` installs iptables, fuse3, faketime (Debian) when root.

Usage: python bench/bench_nemesis.py [--jobs 2000] [--rate 4] [--faults 24] [--seed 2026] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from rich.console import Console
from rich.table import Table

from apps.nemesis.faults import KINDS
from apps.nemesis.run import NemesisConfig, Unavailable, power_cut, run_nemesis
from gpuherd.obs import configure

console = Console(stderr=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=4.0, help="submissions per second")
    parser.add_argument("--faults", type=int, default=24)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--no-power-cut", action="store_true", help="skip the power-cut demonstration")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    configure("bench-nemesis", level="WARNING", json=False)  # logs to stderr: stdout is the JSON
    say = console.print
    try:
        cuts = []
        if not args.no_power_cut:
            for sync in ("2m", "always"):
                cuts.append(asyncio.run(power_cut(sync, jobs=60, log_progress=say)))
        config = NemesisConfig(
            seed=args.seed, jobs=args.jobs, rate=args.rate, faults=args.faults, kinds=tuple(args.kinds.split(","))
        )
        result = asyncio.run(run_nemesis(config, log_progress=say))
    except Unavailable as exc:
        console.print(f"[bold red]NEMESIS SKIPPED: {exc}[/bold red]")
        if args.json:
            print(json.dumps({"skipped": str(exc)}))
        return 0
    summary = result.summary()
    summary["power_cut"] = cuts

    if cuts:
        table = Table(title="coordinated power cut of all 3 NATS servers (kill, drop unsynced writes, restart)")
        for col in ("sync_interval", "acknowledged", "lost after the cut", "unsynced data dropped"):
            table.add_column(col, justify="left" if col == "sync_interval" else "right")
        for cut in cuts:
            if "skipped" in cut:
                table.add_row(cut["sync"], "skipped", cut["skipped"], "")
            else:
                table.add_row(cut["sync"], str(cut["acknowledged"]), str(cut["lost"]), cut["dropped"])
        console.print(table)

    history = Table(title=f"faults (seed {args.seed}, sync {summary['sync']})")
    for col in ("at s", "held s", "fault", "recovered in s"):
        history.add_column(col, justify="left" if col == "fault" else "right")
    for fault, f in zip(summary["history"], result.faults, strict=True):
        recovered = "-" if fault["recovery_s"] is None else f"{fault['recovery_s']:.2f}"
        name = f.describe() + (f" [red]{f.error}[/red]" if f.error else "")
        history.add_row(f"{fault['at_s']:.1f}", f"{fault['held_s']:.1f}", name, recovered)
    console.print(history)
    verdict = Table(title="the checker's verdict")
    verdict.add_column("measure")
    verdict.add_column("value", justify="right")
    verdict.add_column("target", justify="right")
    rows = [
        ("kinds", ", ".join(summary["kinds"]), "all six"),
        ("faults", summary["faults"], ""),
        ("acknowledged jobs", summary["acknowledged"], ">= 2,000"),
        ("lost", summary["lost"], "0"),
        ("duplicated", summary["duplicated"], "0"),
        ("double booked", summary["double_booked"], "0"),
        ("overlapping attempts", summary["overlapping_attempts"], "0"),
        ("audit mismatches", summary["audit_mismatches"], "0"),
        ("max recovery s", f"{summary['max_recovery_s']:.2f}" if summary["max_recovery_s"] else "-", ""),
        ("faults never recovered from", summary["unrecovered_faults"], "0"),
        ("left behind (namespaces, links, mounts)", len(summary["leftovers"]), "0"),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in summary["outcomes"].items()), ""),
        ("wall s", summary["wall_s"], ""),
    ]
    for kind, why in summary["skipped_kinds"].items():
        rows.append((f"SKIPPED {kind}", why, ""))
    for name, value, target in rows:
        verdict.add_row(name, str(value), target)
    console.print(verdict)
    for key in ("lost_jobs", "duplicated_intakes", "double_bookings", "overlaps", "audit"):
        found = result.verdict.get(key)
        if found and any(found.values() if isinstance(found, dict) else found):
            console.print(f"[red]{key}[/red]: {found}")
    if args.json:
        print(json.dumps(summary))
    bad = summary["lost"] + summary["duplicated"] + summary["double_booked"] + summary["overlapping_attempts"]
    bad += summary["audit_mismatches"] + len(summary["leftovers"])
    bad += sum(c.get("lost", 0) for c in cuts if c["sync"] == "always")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
