"""Elastic jobs at the cluster level: the same trace, cluster and policy with elasticity off and on.

A seeded share of each trace's jobs is made elastic (``--elastic-share``, sizes ``--elastic-range``
clipped around each job's asked GPUs, a scaling drawn per job; ``apps/sim/elastic.py``); with
elasticity on, the elastic service's live decider proposes rescales and the scheduler commits
them, each rescale costing what bench_elastic measured (grow warm/cold, shrink, the pause). The
same jobs run with elasticity off: the elastic ones then hold the GPUs they asked for throughout.

Per trace, policy and elastic off/on: average and p95 JCT, average queueing, utilization (GPU-
seconds held over capacity x makespan), rescales, GPU-seconds paused by rescales, and the p95 JCT
of the jobs that are not elastic; the ratio of average JCT off/on (> 1: elastic helps).

Targets (issue 32): on philly.csv at --scale 0.25 with 30% elastic jobs, average JCT >= 30% lower
with elastic on, utilization not lower, the non-elastic jobs' p95 JCT no more than 5% worse.

    python bench/bench_elastic_cluster.py [--traces philly,cluster02] [--policies fifo,qssf] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import pandas as pd
from rich.console import Console
from rich.table import Table
from shared_traces import SHARED

from apps.sim.cluster import ClusterSpec
from apps.sim.elastic import ElasticWorkload, make_elastic, parse_range
from apps.sim.run import simulate
from services.analytics import traces
from services.analytics.traces import load_trace, vc_peak_demand

console = Console(stderr=True)


def figures(jobs: pd.DataFrame, capacity: int) -> dict:
    """The row's figures from a simulated job table."""
    done = jobs[jobs["jct"].notna()]
    rigid = done[~done["elastic"]]
    makespan = float(done["end_time"].max() - jobs["submit_time"].min()) if len(done) else 0.0
    return {
        "jobs": len(jobs),
        "avg_jct_s": round(float(done["jct"].mean()), 1),
        "p95_jct_s": round(float(done["jct"].quantile(0.95)), 1),
        "avg_queue_s": round(float(done["queue"].mean()), 1),
        "utilization": round(float(jobs["gpu_seconds"].sum()) / max(capacity * makespan, 1e-9), 4),
        "rescales": int(jobs["rescales"].sum()),
        "paused_gpu_s": round(float(jobs["paused_gpu_s"].sum()), 1),
        "rigid_p95_jct_s": round(float(rigid["jct"].quantile(0.95)), 1) if len(rigid) else None,
    }


def _simulate(trace: traces.Trace, cluster: ClusterSpec, policy: str, workload: ElasticWorkload, elastic: bool):
    """The trace with the workload's elastic jobs; the elastic service on or off (off: they run at
    the GPUs they asked for, as rigid jobs do)."""
    jobs = list(make_elastic(traces.submissions(trace, start=0.0), workload))
    return simulate(jobs, cluster, policy, keep_log=False, elastic=elastic)


def run(args: argparse.Namespace) -> dict:
    low, high = parse_range(args.elastic_range)
    workload = ElasticWorkload(share=args.elastic_share, min_gpus=low, max_gpus=high, seed=args.seed)
    rows = []
    for name in [t.strip() for t in args.traces.split(",") if t.strip()]:
        trace = load_trace(str(SHARED.get(name, name)))
        if args.limit:
            trace.jobs = trace.jobs.head(args.limit)
        scale = args.philly_scale if name == "philly" else args.scale
        cluster = ClusterSpec.from_peaks(
            vc_peak_demand(trace), scale=scale, gpus_per_node=8, can_borrow=args.can_borrow
        )
        for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
            for elastic in (False, True):
                t0 = time.perf_counter()
                result = _simulate(trace, cluster, policy, workload, elastic)
                row = {
                    "trace": name,
                    "policy": policy,
                    "elastic": elastic,
                    **figures(result.table.jobs, cluster.total_gpus),
                    "wall_s": round(time.perf_counter() - t0, 1),
                }
                rows.append(row)
                console.print(f"{name} {policy} elastic {'on' if elastic else 'off'}: {row}")
    return {
        "elastic_share": args.elastic_share,
        "elastic_range": args.elastic_range,
        "seed": args.seed,
        "can_borrow": args.can_borrow,
        "rows": rows,
        "targets": targets(rows),
    }


def targets(rows: list[dict]) -> dict:
    """Per trace and policy: JCT off/on (> 1: elastic helps), utilization on/off, the non-elastic
    jobs' p95 JCT on/off, and whether issue 32's targets hold."""
    out = {}
    for off in (r for r in rows if not r["elastic"]):
        on = next(r for r in rows if r["elastic"] and (r["trace"], r["policy"]) == (off["trace"], off["policy"]))
        jct = off["avg_jct_s"] / max(on["avg_jct_s"], 1e-9)
        util = on["utilization"] / max(off["utilization"], 1e-9)
        rigid = (on["rigid_p95_jct_s"] or 0.0) / max(off["rigid_p95_jct_s"] or 1e-9, 1e-9)
        out[f"{off['trace']}/{off['policy']}"] = {
            "jct_off_over_on": round(jct, 3),
            "avg_jct_lower_by": round(1 - on["avg_jct_s"] / max(off["avg_jct_s"], 1e-9), 3),
            "utilization_on_over_off": round(util, 3),
            "rigid_p95_on_over_off": round(rigid, 3),
            "met": jct >= 1 / 0.7 and util >= 1.0 and rigid <= 1.05,
        }
    return out


def print_tables(results: dict) -> None:
    table = Table(
        title=f"elastic off vs on ({results['elastic_share']:.0%} elastic, sizes {results['elastic_range']}, "
        f"seed {results['seed']})"
    )
    for column in ("trace", "policy", "elastic", "avg JCT s", "p95 JCT s", "avg queue s", "utilization"):
        table.add_column(column, justify="right")
    for column in ("rescales", "paused GPU-s", "rigid p95 JCT s", "wall s"):
        table.add_column(column, justify="right")
    for r in results["rows"]:
        table.add_row(
            r["trace"],
            r["policy"],
            "on" if r["elastic"] else "off",
            f"{r['avg_jct_s']:,.0f}",
            f"{r['p95_jct_s']:,.0f}",
            f"{r['avg_queue_s']:,.0f}",
            f"{r['utilization']:.1%}",
            f"{r['rescales']:,}",
            f"{r['paused_gpu_s']:,.0f}",
            f"{r['rigid_p95_jct_s']:,.0f}" if r["rigid_p95_jct_s"] is not None else "-",
            f"{r['wall_s']:.1f}",
        )
    Console(width=max(Console().width, 170)).print(table)
    summary = Table(
        title="elastic on against off (targets: JCT lower by >= 30%, utilization >= 1x, rigid p95 <= 1.05x)"
    )
    for column in ("trace/policy", "JCT off/on", "JCT lower by", "util on/off", "rigid p95 on/off", "met"):
        summary.add_column(column, justify="right")
    for key, t in results["targets"].items():
        summary.add_row(
            key,
            f"{t['jct_off_over_on']:.2f}x",
            f"{t['avg_jct_lower_by']:.1%}",
            f"{t['utilization_on_over_off']:.2f}x",
            f"{t['rigid_p95_on_over_off']:.2f}x",
            "yes" if t["met"] else "no",
        )
    Console(width=max(Console().width, 170)).print(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default="philly,cluster02", help=f"names ({', '.join(SHARED)}) or trace files")
    parser.add_argument("--policies", default="fifo,qssf")
    parser.add_argument("--scale", type=float, default=0.2, help="each VC at this x its peak demand")
    parser.add_argument("--philly-scale", type=float, default=0.25)
    parser.add_argument("--elastic-share", type=float, default=0.3)
    parser.add_argument("--elastic-range", default="1-8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--can-borrow", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--limit", type=int, default=0, help="only the first N jobs of each trace")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        json.dump(results, sys.stdout)
        sys.stdout.write("\n")
    else:
        print_tables(results)


if __name__ == "__main__":
    main()
