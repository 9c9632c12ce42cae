"""``gpuherd why`` on a long log: its time and peak memory as the log grows.

Histories of ``--jobs`` jobs (and of a quarter of them) run to the end by the simulator (1-8 GPU
jobs arriving at ``--load`` of the cluster's capacity, 95%: queues form) are written as log files.
For the job that waited longest in each, ``gpuherd why JOB --log FILE --json`` runs in a process of
its own: it reads the log twice, a record at a time, and folds it once. The baseline, in a process
of its own too, is what ``why`` did before: the whole log read into memory, folded by the core
fold, then by the scheduler's fold for its waits. Each row gives the wall time and the process's
peak RSS; both answers must give the same waits. Target: ``why``'s memory does not grow with the
log (the baseline's grows with every event).

Usage: python bench/bench_why.py [--jobs 40000] [--nodes 200] [--load 0.95] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_restart import history
from rich.console import Console
from rich.table import Table

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.log.files import write_log_file

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parents[1]

# What `why` did before it streamed the log: all of it in memory, then folded (the core fold for
# the job's status, the scheduler's for its waits). Prints the waits as `why --json` does.
HELD_LOG = """
import sys, msgspec
from gpuherd.fold import fold
from gpuherd.log.files import read_log_file
from services.scheduler.explain import wait_history
records = read_log_file(sys.argv[1])
state = fold((r.seq, r.event) for r in records)
job = state.jobs[sys.argv[2]]
waits = wait_history(records, job.job)
print(msgspec.json.encode({"status": job.status, "waits": msgspec.to_builtins(waits)}).decode())
"""
WHY = "import sys, runpy; sys.argv[0] = 'gpuherd'; runpy.run_module('apps', run_name='__main__')"
# Runs a program (the code in argv[1], its arguments after it) and says its peak RSS last on stderr.
# (The peak of its own memory: the RSS wait4 reports for a child counts the parent's at the fork.)
PEAK = """
import sys
code, sys.argv = sys.argv[1], sys.argv[1:]
try:
    exec(compile(code, "<measured>", "exec"), {"__name__": "__main__"})
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    sys.stderr.write(f"\\npeak-kb {peak}\\n")
"""


def longest_wait(events: list[ev.Event]) -> str:
    """The job that waited longest from its submission to its first placement."""
    submitted: dict[str, float] = {}
    waited: dict[str, float] = {}
    for event in events:
        if isinstance(event, ev.JobSubmitted):
            submitted[event.job] = event.at
        elif isinstance(event, ev.JobPlaced) and event.job not in waited:
            waited[event.job] = event.at - submitted[event.job]
    return max(waited, key=waited.__getitem__)


def run(code: str, *args: str) -> tuple[dict[str, Any], float, float]:
    """The program's JSON answer, its wall seconds and its peak RSS in MB."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "libs")])}
    began = time.perf_counter()
    command = [sys.executable, "-c", PEAK, code, *args]
    done = subprocess.run(command, capture_output=True, cwd=ROOT, env=env, check=False)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{args} failed with {done.returncode}: {done.stderr.decode()[-2000:]}")
    peak_kb = int(done.stderr.decode().rsplit("peak-kb ", 1)[1])
    return json.loads(done.stdout), seconds, peak_kb / 1024


def measure(jobs: int, nodes: int, seed: int, load: float, folder: Path) -> dict[str, Any]:
    events, _ = history(jobs, nodes, seed, load)
    path = folder / f"events-{jobs}.jsonl"
    write_log_file((Record(seq, event) for seq, event in enumerate(events, 1)), path)
    job = longest_wait(events)
    streamed, streamed_s, streamed_mb = run(WHY, "why", job, "--log", str(path), "--json")
    held, held_s, held_mb = run(HELD_LOG, str(path), job)
    if streamed["waits"] != held["waits"] or streamed["status"] != held["status"]:
        raise AssertionError(f"why and the baseline disagree on {job}")
    passes = sum(wait["passes_replayed"] for wait in streamed["waits"])
    return {
        "jobs": jobs,
        "events": len(events),
        "log_mb": path.stat().st_size / 2**20,
        "job": job,
        "passes_replayed": passes,
        "why_s": streamed_s,
        "why_peak_mb": streamed_mb,
        "held_s": held_s,
        "held_peak_mb": held_mb,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40_000)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--load", type=float, default=0.95, help="arrivals as a share of capacity (queues form near 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-why-") as folder:
        rows = [measure(n, args.nodes, args.seed, args.load, Path(folder)) for n in (args.jobs // 4, args.jobs)]
    small, large = rows
    figures = {
        "rows": rows,
        "memory_ratio": large["held_peak_mb"] / large["why_peak_mb"],
        "why_growth_mb": large["why_peak_mb"] - small["why_peak_mb"],
        "held_growth_mb": large["held_peak_mb"] - small["held_peak_mb"],
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    table = Table(title="gpuherd why of the job that waited longest, on a log file")
    for column in ("jobs", "events", "log MB", "passes replayed", "why s", "why peak MB", "held log s", "held peak MB"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row['jobs']:,}",
            f"{row['events']:,}",
            f"{row['log_mb']:.0f}",
            f"{row['passes_replayed']:,}",
            f"{row['why_s']:.1f}",
            f"{row['why_peak_mb']:.0f}",
            f"{row['held_s']:.1f}",
            f"{row['held_peak_mb']:.0f}",
        )
    console.print(table)
    console.print(
        f"peak memory: the held log needs {figures['memory_ratio']:.1f}x what why needs at {large['jobs']:,} jobs; "
        f"from {small['jobs']:,} to {large['jobs']:,} jobs why grows {figures['why_growth_mb']:.0f} MB, "
        f"the held log {figures['held_growth_mb']:.0f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
