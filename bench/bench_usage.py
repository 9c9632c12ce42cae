"""Accounting: how fast ``gpuherd usage`` folds a long history into usage figures, and in how much memory.

The history is a real one: ``--jobs`` (default 100,000) synthetic jobs over 4 VCs and 200 users
(1-8 GPUs, 1 min to 1 h, a tenth with a time limit shorter than some of them run, so some end as
``timeout``) run to the end by the simulator (the production deciders, ``apps.sim``), its log
written as a log file (one JSON event per line, as ``gpuherd sim -o`` writes it).

Each measurement runs in a fresh process (its peak resident memory is its own) and reads the file
line by line:

- **accounting** (``gpuherd.fold.accounting``, what ``gpuherd usage --log`` runs): fold each event
  as stored (decoding only what accounting reads), and report GPU-hours, jobs by how they ended
  and the average queueing per VC and user per day;
- **baseline**: the analytics job table (``services.analytics.jobs``, what ``gpuherd report`` folds
  a log into) and the same GPU-hours per VC and user from it with pandas.

The figures must be exact: the accounting's GPU-seconds are checked against a plain sum over the
run records (GPUs of each attempt x its first start to its end). Targets: < 5 s and < 500 MB.

Usage: python bench/bench_usage.py [--jobs 100000] [--nodes 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.log.files import write_log_file

console = Console(stderr=True)
TARGET_S = 5.0
TARGET_MB = 500.0
VCS = ("vision", "nlp", "speech", "rl")

# Each runs in a fresh interpreter and prints one JSON object: its time, peak memory, figures. The
# peak is the process's own high-water mark (VmHWM: a new address space at exec, unlike ru_maxrss,
# which would count the forking benchmark's memory too).
_PEAK = """
def peak_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""
_ACCOUNTING = (
    _PEAK
    + """
import json, sys, time
t0 = time.perf_counter()
from gpuherd.fold.accounting import Accounting
acc = Accounting(by=("vc", "user"), per="day")
with open(sys.argv[1], "rb") as f:
    for seq, line in enumerate(f, 1):
        acc.fold_stored(seq, line)
report = acc.report()
elapsed = time.perf_counter() - t0
peak = peak_mb()
print(json.dumps({"s": elapsed, "peak_mb": peak, "rows": len(report["rows"]),
                  "gpu_s": report["total"]["gpu_seconds"], "ended": report["total"]["jobs"]}))
"""
)

_BASELINE = (
    _PEAK
    + """
import json, sys, time
t0 = time.perf_counter()
from gpuherd import events as ev
from services.analytics.jobs import JobTable
table = JobTable()
with open(sys.argv[1], "rb") as f:
    for line in f:
        table.add(ev.decode(line))
jobs = table.trace().jobs
jobs["gpu_s"] = jobs["gpus"] * jobs["duration"].fillna(0.0)
jobs["day"] = (jobs["submit_time"] // 86400).astype("int64")
figures = jobs.groupby(["vc", "user", "day"])["gpu_s"].sum()
elapsed = time.perf_counter() - t0
peak = peak_mb()
print(json.dumps({"s": elapsed, "peak_mb": peak, "rows": len(figures), "gpu_s": float(figures.sum())}))
"""
)


def synthetic_jobs(n: int, gpus: int, seed: int, load: float = 0.8) -> list[ev.JobSubmitted]:
    """``n`` jobs arriving at about ``load`` of the cluster's capacity: 1-8 GPUs, 1 min to 1 h; a
    tenth of them limited to 30 min (those that run longer end as ``timeout``)."""
    rng = random.Random(seed)
    sizes = [1] * 50 + [2] * 20 + [4] * 15 + [8] * 15
    mean_gpus, mean_s = sum(sizes) / len(sizes), 1830.0
    rate = load * gpus / (mean_gpus * mean_s)
    at, out = 1.7e9, []
    for i in range(n):
        at += rng.expovariate(rate)
        user = rng.randrange(200)
        spec = ev.JobSpec(
            name=f"h{i}",
            user=f"u{user}",
            vc=VCS[user % len(VCS)],
            gpus=rng.choice(sizes),
            duration_s=rng.uniform(60.0, 3600.0),
            time_limit_s=1800.0 if rng.random() < 0.1 else None,
            intake_id=f"h{i}",
        )
        out.append(ev.JobSubmitted(at=at, job=f"h{i}", spec=spec, intake_source="history"))
    return out


def make_history(jobs: int, nodes: int, seed: int, path: Path) -> int:
    per_vc = max(1, nodes // len(VCS))
    cluster = ClusterSpec(vcs={vc: VcSpec(nodes=per_vc) for vc in VCS}, can_borrow=True)
    submissions = synthetic_jobs(jobs, cluster.total_gpus, seed)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"simulating the history: {jobs:,} jobs on {cluster.total_nodes:,} nodes", total=jobs)
        result = simulate(
            submissions, cluster, "fifo", predict=False, start=submissions[0].at,
            on_submit=lambda k: progress.advance(task, k),
        )  # fmt: skip
    return write_log_file(result.records, path)


def run_records_gpu_s(path: Path) -> tuple[float, int]:
    """GPU-seconds summed from the run records, independently of any fold: each attempt's GPUs
    (its placement) from its first start to the end of the attempt; and the jobs that ended."""
    gpus: dict[tuple[str, int], int] = {}
    start: dict[tuple[str, int], float] = {}
    total, ended = 0.0, 0
    with path.open("rb") as f:
        for line in f:
            e = ev.decode(line)
            if isinstance(e, ev.JobPlaced):
                gpus[(e.job, e.attempt)] = sum(len(a.gpus) for a in e.allocations)
            elif isinstance(e, ev.JobStarted):
                start.setdefault((e.job, e.attempt), e.at)
            elif isinstance(e, ev.JobFinished | ev.JobRequeued):
                key = (e.job, e.attempt)
                if key in start:
                    total += gpus[key] * (e.at - start.pop(key))
                ended += isinstance(e, ev.JobFinished)
    return total, ended


def measure(program: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", program, str(path)], capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuherd-bench-usage-") as tmp:
        path = Path(tmp) / "events.jsonl"
        t0 = time.perf_counter()
        events = make_history(args.jobs, args.nodes, args.seed, path)
        console.print(f"history: {args.jobs:,} jobs, {events:,} events, {path.stat().st_size / 1e6:.0f} MB "
                      f"(simulated in {time.perf_counter() - t0:.0f} s)")  # fmt: skip
        expected_gpu_s, finished = run_records_gpu_s(path)
        accounting = measure(_ACCOUNTING, path)
        baseline = measure(_BASELINE, path)
    ended = sum(accounting["ended"].values())
    exact = abs(accounting["gpu_s"] - expected_gpu_s) <= 1e-6 * max(1.0, expected_gpu_s) and ended == finished
    result = {
        "jobs": args.jobs,
        "events": events,
        "accounting_s": round(accounting["s"], 3),
        "accounting_peak_mb": round(accounting["peak_mb"], 1),
        "baseline_s": round(baseline["s"], 3),
        "baseline_peak_mb": round(baseline["peak_mb"], 1),
        "x_faster": round(baseline["s"] / accounting["s"], 2),
        "rows": accounting["rows"],
        "gpu_hours": round(accounting["gpu_s"] / 3600, 3),
        "gpu_hours_from_run_records": round(expected_gpu_s / 3600, 3),
        "exact": exact,
        "ended": accounting["ended"],
        "target_s": TARGET_S,
        "target_mb": TARGET_MB,
        "meets_targets": accounting["s"] < TARGET_S and accounting["peak_mb"] < TARGET_MB and exact,
    }
    if args.json:
        print(json.dumps(result))
        return 0 if result["meets_targets"] else 1
    table = Table(title=f"usage: {args.jobs:,} finished jobs ({events:,} events) -> GPU-hours by VC, user and day")
    for column in ("measure", "accounting", "baseline: analytics job table + pandas", "x faster", "target"):
        table.add_column(column, justify="right")
    table.add_row("fold + report (s)", f"{accounting['s']:.2f}", f"{baseline['s']:.2f}",
                  f"{result['x_faster']:.1f}x", f"< {TARGET_S:.0f} s")  # fmt: skip
    table.add_row("peak memory (MB)", f"{accounting['peak_mb']:.0f}", f"{baseline['peak_mb']:.0f}", "",
                  f"< {TARGET_MB:.0f} MB")  # fmt: skip
    table.add_row("GPU-hours", f"{accounting['gpu_s'] / 3600:,.1f}", f"{baseline['gpu_s'] / 3600:,.1f}", "", "")
    table.add_row("... summed from the run records", f"{expected_gpu_s / 3600:,.1f}", "", "",
                  "exact" if exact else "[red]differs[/red]")  # fmt: skip
    table.add_row("jobs by end", ", ".join(f"{k} {v:,}" for k, v in accounting["ended"].items()), "", "", "")
    Console().print(table)
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
