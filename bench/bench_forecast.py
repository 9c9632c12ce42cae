"""How good are start-time forecasts? philly.csv replayed through the simulator, and at each
sampled submission a forecast of the job's start made from the scheduler's state at that moment
(``services/scheduler/forecast.py``: the scheduler's own passes run forward), compared with when
the job actually started in the same simulation.

Baseline, in the same run: the naive forecast, now + (GPU-seconds still to run of its VC's running
jobs + GPU-seconds of its VC's jobs that wait ahead of it) / its VC's GPUs (VCs do not borrow here).

The trace's jobs declare their durations and the simulation runs them exactly that long, so both
forecasts know every duration: the error is what the forecast cannot know (jobs submitted later
that overtake or are backfilled, the order of ends within a pass) and, for the naive one, the
fragmentation and order it ignores. Rows: the job's position in the policy's order at submission.

``--predicted``: the scheduler is not told the durations (``declared_durations`` 0, as for jobs that
declare none): the duration model's predictions drive backfill in the simulation and the forecast's
expected ends (and the naive forecast's work), while the jobs still run their trace durations. Then
the error also holds what the predictions miss. Target: >= 70% of forecasts within 2x.

Usage: python bench/bench_forecast.py [--limit 20000] [--scale 0.5] [--policy fifo] [--samples 2000]
                                     [--predicted] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from apps.sim.cluster import ClusterSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from services.analytics.traces import load_trace, submissions, vc_peak_demand
from services.scheduler.decide import SchedulerDecider
from services.scheduler.forecast import forecast_starts
from services.scheduler.policy import make_policy

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "philly" / "philly.csv"
BUCKETS = (("1st", 1, 1), ("2nd-10th", 2, 10), ("11th-100th", 11, 100), ("beyond 100th", 101, 1 << 30))
console = Console(stderr=True)


def within_2x(forecast_wait: float, actual_wait: float, slack_s: float = 60.0) -> bool:
    """Within a factor of 2 of the actual wait (waits both under a minute count as right)."""
    low, high = sorted((max(forecast_wait, 0.0), max(actual_wait, 0.0)))
    return high <= slack_s or (low > 0 and high / low <= 2.0)


def naive(state, job_id: str, vc_gpus: int) -> float:
    """now + (work left of its VC's running jobs + work of its VC's jobs waiting ahead) / the VC's GPUs."""
    now, vc = state.now, state.jobs[job_id].spec.vc
    work = 0.0
    for job in state.active_jobs():
        if job.spec.vc == vc:
            work += job.held * max(0.0, state.expected_end(job) - now)
    for queued in state.queue:
        if queued == job_id:
            break
        job = state.jobs[queued]
        if job.spec.vc == vc:
            work += job.spec.gpus * (state.expected_duration(job) or 0.0)
    return now + work / max(1, vc_gpus)


def run(args: argparse.Namespace) -> dict:
    trace = load_trace(args.trace)
    if args.limit:
        trace.jobs = trace.jobs.head(args.limit)
    cluster = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=args.scale)
    with console.status(f"simulating {len(trace.jobs):,} jobs ({args.policy})"):
        result = simulate(
            submissions(trace, start=trace.origin),
            cluster,
            args.policy,
            start=trace.origin,
            policy_params={"declared_durations": 0.0} if args.predicted else None,
        )
    started: dict[str, float] = {}
    for record in result.records:
        e = record.event
        if isinstance(e, ev.JobPlaced) and e.job not in started:
            started[e.job] = e.at
    submitted = [r for r in result.records if isinstance(r.event, ev.JobSubmitted)]
    every = max(1, len(submitted) // args.samples)
    sample = {r.seq for r in submitted[::every]}
    decider = SchedulerDecider(make_policy(args.policy))
    policy = decider.policy
    state = decider.initial_state()
    rows: list[dict] = []
    forecast_s = 0.0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("forecasting at each sampled submission", total=len(sample))
        for record in result.records:
            decider.evolve(state, record.seq, record.event)
            if record.seq not in sample:
                continue
            job_id = record.event.job  # type: ignore[attr-defined]
            progress.advance(task)
            if job_id not in state.queue or job_id not in started:
                continue
            position = state.queue.index(job_id) + 1 if args.policy == "fifo" else _position(decider, state, job_id)
            t0 = time.perf_counter()
            forecast = forecast_starts(state, policy, [job_id]).get(job_id)
            forecast_s += time.perf_counter() - t0
            rows.append(
                {
                    "position": position,
                    "submitted": state.now,
                    "actual": started[job_id],
                    "forecast": forecast,
                    "naive": naive(state, job_id, cluster.vc_gpus(state.jobs[job_id].spec.vc)),
                }
            )
    out: dict = {
        "jobs": len(trace.jobs),
        "gpus": cluster.total_gpus,
        "policy": args.policy,
        "durations": "predicted" if args.predicted else "declared",
        "samples": len(rows),
        "forecast_mean_ms": forecast_s / max(1, len(rows)) * 1e3,
        "buckets": {},
    }
    for name, low, high in (("all", 1, 1 << 30), *BUCKETS):
        part = [r for r in rows if low <= r["position"] <= high]
        told = [r for r in part if r["forecast"] is not None]
        out["buckets"][name] = {
            "samples": len(part),
            "forecast_told": len(told),
            "forecast_median_abs_error_s": statistics.median(abs(r["forecast"] - r["actual"]) for r in told)
            if told
            else None,
            "forecast_within_2x": sum(
                within_2x(r["forecast"] - r["submitted"], r["actual"] - r["submitted"]) for r in told
            )
            / max(1, len(told)),
            "naive_median_abs_error_s": statistics.median(abs(r["naive"] - r["actual"]) for r in part)
            if part
            else None,
            "naive_within_2x": sum(within_2x(r["naive"] - r["submitted"], r["actual"] - r["submitted"]) for r in part)
            / max(1, len(part)),
        }
    return out


def _position(decider: SchedulerDecider, state, job_id: str) -> int:
    pending = decider.plan(state).pending.get(job_id)
    return pending.position if pending is not None else 1


def print_table(r: dict) -> None:
    title = (
        f"start-time forecasts: {r['jobs']:,} philly.csv jobs, {r['gpus']:,} GPUs, {r['policy']}, "
        f"{r['durations']} durations, "
        f"{r['samples']:,} sampled submissions (forecast mean {r['forecast_mean_ms']:.1f} ms)"
    )
    table = Table(title=title)
    for col in ("position at submission", "samples", "forecast: median |error| s", "forecast within 2x",
                "naive: median |error| s", "naive within 2x"):  # fmt: skip
        table.add_column(col, justify="right")
    for name, b in r["buckets"].items():
        f_err = b["forecast_median_abs_error_s"]
        n_err = b["naive_median_abs_error_s"]
        table.add_row(
            name,
            f"{b['samples']:,}"
            + (f" ({b['samples'] - b['forecast_told']} untold)" if b["forecast_told"] < b["samples"] else ""),
            "" if f_err is None else f"{f_err:,.0f}",
            f"{b['forecast_within_2x']:.0%}",
            "" if n_err is None else f"{n_err:,.0f}",
            f"{b['naive_within_2x']:.0%}",
        )
    Console(width=140).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--limit", type=int, default=20_000)
    parser.add_argument("--scale", type=float, default=0.5, help="each VC at this x its peak demand")
    parser.add_argument("--policy", default="fifo")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--predicted", action="store_true", help="the scheduler is told no durations: predictions")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures instead")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
