"""Trace simulation speed and the policy comparison on philly.csv.

For each policy: the full trace through the live scheduler and analytics
deciders on a virtual clock. Prints simulated jobs/s and peak memory, checks
that two runs of one policy give the same log (determinism), then the
FIFO / SJF (oracle) / QSSF (predicted) / SRTF (oracle) table, overall and per
VC, at the trace's own VC capacity (each VC sized to its peak demand) and at
a contended scale. Baseline for speed: FIFO in the same run.

    python bench/bench_sim.py [--limit N] [--scales 1.0,0.25] [--policies fifo,sjf,qssf,srtf]
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from apps.sim.cluster import ClusterSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from services.analytics.jobs import job_table, summarize
from services.analytics.traces import load_trace, submissions, vc_peak_demand

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "philly" / "philly.csv"
console = Console(width=170)


def digest(records: list) -> str:
    h = hashlib.blake2b(digest_size=12)
    for r in records:
        h.update(ev.encode(r.event))
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--scales", default="1.0,0.25")
    parser.add_argument("--policies", default="fifo,sjf,qssf,srtf")
    parser.add_argument("--determinism", action="store_true", help="run FIFO twice and compare the logs")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    if args.limit:
        trace.jobs = trace.jobs.head(args.limit)
    console.print(trace.describe())
    policies = args.policies.split(",")
    for scale in (float(s) for s in args.scales.split(",")):
        cluster = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=scale)
        speed = Table(
            title=f"scale {scale}: {cluster.total_gpus} GPUs on {cluster.total_nodes} nodes", title_justify="left"
        )
        for col in ("policy", "jobs", "events", "wall s", "jobs/s", "vs fifo", "peak RSS MB", "preemptions"):
            speed.add_column(col, justify="right")
        walls: dict[str, float] = {}
        digests: dict[str, str] = {}
        summaries: dict[str, dict] = {}
        preemptions: dict[str, int] = {}
        for policy in policies:
            result = simulate(submissions(trace, start=trace.origin), cluster, policy, start=trace.origin)
            walls[policy] = result.wall_s
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            # Keep what the tables need, not the run: one policy's log and states at a time in memory.
            digests[policy] = digest(result.records)
            jobs = job_table(result.records).jobs
            summaries[policy] = summarize(jobs)
            preemptions[policy] = int(jobs["preemptions"].sum())
            submitted, events = result.submitted, result.events
            del result, jobs
            base = walls[policies[0]]
            speed.add_row(
                policy,
                f"{submitted:,}",
                f"{events:,}",
                f"{walls[policy]:.1f}",
                f"{submitted / walls[policy]:,.0f}",
                f"{walls[policy] / base:.2f}x",
                f"{rss:,.0f}",
                f"{preemptions[policy]:,}",
            )
        speed.add_row("all", "", "", f"{sum(walls.values()):.1f}", "", "", "", "")
        console.print(speed)
        if args.determinism:
            t0 = time.perf_counter()
            again = simulate(submissions(trace, start=trace.origin), cluster, policies[0], start=trace.origin)
            same = digest(again.records) == digests[policies[0]]
            console.print(
                f"determinism: {policies[0]} run twice -> identical logs: {same} ({time.perf_counter() - t0:.1f}s)"
            )
        table = Table(title=f"scale {scale}: average JCT / average queueing (s)", title_justify="left")
        table.add_column("VC")
        for policy in policies:
            table.add_column(f"{policy} JCT", justify="right")
            table.add_column(f"{policy} queue", justify="right")
        vcs = [
            "all",
            *sorted(
                (k for k in summaries[policies[0]] if k != "all"), key=lambda v: -summaries[policies[0]][v]["jobs"]
            ),
        ]
        for vc in vcs:
            row = [vc]
            for policy in policies:
                s = summaries[policy].get(vc, {})
                row += [f"{s.get('avg_jct_s', float('nan')):,.0f}", f"{s.get('avg_queue_s', float('nan')):,.0f}"]
            table.add_row(*row)
        console.print(table)


if __name__ == "__main__":
    main()
