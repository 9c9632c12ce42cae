"""Policies on every real trace: FIFO, the oracle (SJF with the true durations), QSSF on predicted
durations, and LAS with hysteresis, each simulated with the live deciders and a preemption cost.

Per trace (each with its cluster at ``--scale`` x its VCs' peak demand; philly.csv at
``--philly-scale``) and policy: average and p95 JCT, average queueing, preemptions, the ratio
against FIFO in the same run (> 1: better), QSSF's and LAS's share of the oracle's gain
(``(FIFO/policy - 1) / (FIFO/SJF - 1)``), and for QSSF the predictions in force when each job
started (median relative error, share within 2x). A second table replays each trace's duration
model on its own (time-ordered: it learns only from jobs finished before each prediction) and
gives its accuracy and its cost: time spent refitting and per prediction.

``--split-days D``: a time split. The figures count only jobs submitted after the first D days
(the model learned from the first weeks, the policy parameters were fixed beforehand), and the
accuracy table adds the model frozen after those D days (no refit, no online update), to show
what learning as jobs finish is worth.

Targets: QSSF keeps >= 75% of the oracle's gain on philly.csv and >= 40% on every other
contended trace; QSSF and LAS >= 0.98x FIFO on every trace.

    python bench/bench_policy.py [--traces philly,cluster01,...] [--policies fifo,sjf,qssf,las] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from shared_traces import SHARED as ALL

from apps.sim.cluster import ClusterSpec
from apps.sim.policies import compare
from services.analytics import predict
from services.analytics.traces import Trace, load_trace, vc_peak_demand

console = Console(stderr=True)


def accuracy(trace: Trace, split_s: float | None) -> dict:
    """The duration model replayed on the trace: accuracy (of the jobs after the split, if any) and cost."""
    jobs = trace.jobs
    model = predict.DurationModel()
    t0 = time.perf_counter()
    acc, guesses = predict.evaluate(jobs, model)
    wall = time.perf_counter() - t0
    out: dict = {
        "jobs": acc.jobs,
        "fit_s": round(acc.fit_s, 2),
        "refits": model.version,
        "predict_us": round(acc.predict_s / max(acc.jobs, 1) * 1e6, 1),
        "wall_s": round(wall, 1),
    }
    test = (jobs["submit_time"] >= jobs["submit_time"].min() + split_s).to_numpy() if split_s else None
    duration = jobs["duration"].to_numpy(dtype="float64")
    part = predict.accuracy(guesses[test], duration[test]) if test is not None else acc
    out |= {"median_relative_error": round(part.median_relative_error, 3), "within_2x": round(part.within_2x, 3)}
    ladder = predict.evaluate(jobs, predict.DurationModel(learner="ladder"))[1]
    base = predict.accuracy(ladder[test], duration[test]) if test is not None else predict.accuracy(ladder, duration)
    out |= {
        "ladder_median_relative_error": round(base.median_relative_error, 3),
        "ladder_within_2x": round(base.within_2x, 3),
    }
    if test is not None:
        frozen = predict.evaluate(
            jobs, predict.DurationModel(), freeze_after=float(jobs["submit_time"].min() + split_s)
        )[1]
        f = predict.accuracy(frozen[test], duration[test])
        out |= {
            "frozen_median_relative_error": round(f.median_relative_error, 3),
            "frozen_within_2x": round(f.within_2x, 3),
        }
        out["test_jobs"] = int(test.sum())
    return out


def run(args: argparse.Namespace) -> dict:
    results: dict = {
        "scale": args.scale,
        "philly_scale": args.philly_scale,
        "split_days": args.split_days,
        "traces": {},
    }
    for name in args.traces.split(","):
        path = ALL.get(name, Path(name))
        trace = load_trace(path)
        if args.limit:
            trace.jobs = trace.jobs.head(args.limit)
        scale = args.philly_scale if name == "philly" else args.scale
        cluster = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=scale)
        split_s = args.split_days * 86400.0 if args.split_days else None
        console.log(f"{trace.describe()}; {cluster.total_gpus:,} GPUs at scale {scale}")
        runs = compare(
            trace,
            cluster,
            args.policies.split(","),
            workers=args.workers,
            measure_from=split_s,
            on_done=lambda r, n=trace.name: console.log(
                f"  {n} {r.policy}: avg JCT {r.avg_jct_s:,.0f} s ({r.wall_s:.0f} s)"
            ),
        )
        results["traces"][trace.name] = {
            "gpus": cluster.total_gpus,
            "jobs": len(trace.jobs),
            "runs": [r.as_dict() for r in runs],
            "prediction": accuracy(trace, split_s) if not args.no_accuracy else None,
        }
    results["targets"] = targets(results)
    return results


def targets(results: dict) -> dict:
    """Each target, met or not, with the figure it rests on."""
    out: dict = {}
    for name, t in results["traces"].items():
        by = {r["policy"]: r for r in t["runs"]}
        share = by.get("qssf", {}).get("oracle_share")
        need = 0.75 if name == "philly" else 0.40
        if share is not None:
            out[f"{name}: qssf oracle share >= {need:.0%}"] = {"value": round(share, 3), "met": share >= need}
        for policy in ("qssf", "las"):
            ratio = by.get(policy, {}).get("vs_fifo")
            if ratio is not None:
                out[f"{name}: {policy} >= 0.98x fifo"] = {"value": round(ratio, 3), "met": ratio >= 0.98}
    return out


def print_tables(results: dict) -> None:
    out = Console(width=200)
    split = f", jobs after day {results['split_days']:g}" if results["split_days"] else ""
    table = Table(
        title=f"policies on real traces (philly.csv at {results['philly_scale']}x its VC peaks, the rest at "
        f"{results['scale']}x; preemption cost on{split})",
        title_justify="left",
    )
    for col in ("trace", "GPUs", "policy", "avg JCT s", "p95 JCT s", "avg queue s", "preemptions", "vs FIFO",
                "oracle share", "pred. median rel. err", "pred. within 2x", "sim s"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("trace", "policy") else "right")
    for name, t in results["traces"].items():
        for i, r in enumerate(t["runs"]):
            table.add_row(
                name if i == 0 else "",
                f"{t['gpus']:,}" if i == 0 else "",
                r["policy"],
                f"{r['avg_jct_s']:,.0f}",
                f"{r['p95_jct_s']:,.0f}",
                f"{r['avg_queue_s']:,.0f}",
                f"{r['preemptions']:,}",
                "" if r["vs_fifo"] is None else f"{r['vs_fifo']:.2f}x",
                "" if r["oracle_share"] is None else f"{r['oracle_share']:.0%}",
                "" if r["median_relative_error"] is None else f"{r['median_relative_error']:.2f}",
                "" if r["within_2x"] is None else f"{r['within_2x']:.0%}",
                f"{r['wall_s']:.0f}",
            )
        table.add_section()
    out.print(table)
    acc = Table(
        title="duration model replayed on each trace (time-ordered: learns only from finished jobs)"
        + (" - accuracy on the jobs after the split" if results["split_days"] else ""),
        title_justify="left",
    )
    frozen = bool(results["split_days"])
    cols = ["trace", "jobs", "median rel. err", "within 2x", "back-off median: err", "within 2x "]
    if frozen:
        cols += ["frozen at split: err", "within 2x  "]
    cols += ["refits", "refit s (total)", "µs / prediction"]
    for col in cols:
        acc.add_column(col, justify="left" if col == "trace" else "right")
    for name, t in results["traces"].items():
        p = t["prediction"]
        if p is None:
            continue
        row = [name, f"{p.get('test_jobs', p['jobs']):,}", f"{p['median_relative_error']:.2f}", f"{p['within_2x']:.0%}",
               f"{p['ladder_median_relative_error']:.2f}", f"{p['ladder_within_2x']:.0%}"]  # fmt: skip
        if frozen:
            row += [f"{p['frozen_median_relative_error']:.2f}", f"{p['frozen_within_2x']:.0%}"]
        row += [str(p["refits"]), f"{p['fit_s']:.1f}", f"{p['predict_us']:,.0f}"]
        acc.add_row(*row)
    out.print(acc)
    goals = Table(title="targets", title_justify="left")
    for col in ("target", "value", "met"):
        goals.add_column(col)
    for name, g in results["targets"].items():
        goals.add_row(name, f"{g['value']:.2f}", "yes" if g["met"] else "[red]NO[/red]")
    out.print(goals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=",".join(ALL), help=f"names ({', '.join(ALL)}) or trace files")
    parser.add_argument("--policies", default="fifo,sjf,qssf,las")
    parser.add_argument("--scale", type=float, default=0.2, help="each VC at this x its peak demand")
    parser.add_argument("--philly-scale", type=float, default=0.25)
    parser.add_argument("--limit", type=int, default=0, help="only the first N jobs of each trace")
    parser.add_argument("--split-days", type=float, default=0.0, help="count only jobs after the first D days")
    parser.add_argument("--workers", type=int, default=1, help="simulations at a time")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the model's replay on its own")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        json.dump(results, sys.stdout, default=lambda v: None if isinstance(v, float) and not math.isfinite(v) else v)
        print()
    else:
        print_tables(results)


if __name__ == "__main__":
    main()
