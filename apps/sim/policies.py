"""Which policy suits a history? Replay it under each, with the live deciders, and compare.

``compare`` simulates one history (a trace, or jobs folded from gpuherd's own log) under each
policy on one cluster and measures, per policy: average and p95 JCT, average queueing,
preemptions, and for policies that rank by predictions, how good the predictions in force were
when each job started. ``recommend`` picks the policy the table justifies. ``gpuherd policy
advise`` and ``bench/bench_policy.py`` are built on it.

SJF with the trace's true durations is the *oracle*: QSSF's share of the oracle's gain is
``(FIFO JCT / QSSF JCT - 1) / (FIFO JCT / SJF JCT - 1)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from apps.sim.cluster import ClusterSpec
from apps.sim.model import GPUHERD, SimModel
from apps.sim.run import simulate
from apps.sim.sweep import sweep
from services.analytics.jobs import summarize
from services.analytics.traces import Trace, submissions

ORACLE = "sjf"  # with the trace's true durations (declared to the scheduler)
BASELINE = "fifo"
# How much worse than FIFO a policy may be at p95 JCT and still be recommended for its average.
P95_SLACK = 1.10


@dataclass
class PolicyRun:
    policy: str
    jobs: int
    finished: int
    avg_jct_s: float
    p95_jct_s: float
    avg_queue_s: float
    preemptions: int
    wall_s: float
    events: int
    # Predictions in force when each job started (policies that rank by them), against its run time
    predicted_jobs: int = 0
    median_relative_error: float | None = None
    within_2x: float | None = None
    vs_fifo: float | None = None  # FIFO's average JCT / this one's (> 1: better)
    oracle_share: float | None = None  # of the oracle's gain over FIFO (QSSF, LAS, ...)
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def prediction_error(table: pd.DataFrame) -> tuple[int, float | None, float | None]:
    """(jobs, median relative error, share within 2x) of the predictions in a run's job table."""
    done = table[table["predicted"].notna() & table["jct"].notna() & (table["duration"] > 0)]
    if done.empty:
        return 0, None, None
    actual = np.maximum(done["duration"].to_numpy(dtype=np.float64), 1.0)
    guess = np.maximum(done["predicted"].to_numpy(dtype=np.float64), 1.0)
    ratio = np.maximum(guess / actual, actual / guess)
    return len(done), float(np.median(np.abs(guess - actual) / actual)), float((ratio <= 2.0).mean())


def run_policy(
    trace: Trace,
    cluster: ClusterSpec,
    policy: str,
    *,
    model: SimModel = GPUHERD,
    params: Mapping[str, float] | None = None,
    predictor: Mapping[str, Any] | None = None,
    measure_from: float | None = None,
) -> PolicyRun:
    """One simulation of ``trace`` under ``policy``; ``measure_from``: only jobs submitted from then
    (seconds after the trace's first submission) count in the figures (a time split)."""
    start = trace.origin if trace.absolute_time else 0.0
    t0 = time.perf_counter()
    result = simulate(
        submissions(trace, start=start),
        cluster,
        policy,
        start=start,
        model=model,
        policy_params=dict(params or {}),
        predictor=predictor,
        keep_log=False,
    )
    wall = time.perf_counter() - t0
    table = result.table.jobs
    if measure_from is not None:
        table = table[table["submit_time"] >= start + measure_from]
    stats = summarize(table)["all"]
    predicted, error, within = prediction_error(table)
    return PolicyRun(
        policy=policy,
        jobs=int(stats["jobs"]),
        finished=int(stats["finished"]),
        avg_jct_s=float(stats["avg_jct_s"]),
        p95_jct_s=float(stats["p95_jct_s"]),
        avg_queue_s=float(stats["avg_queue_s"]),
        preemptions=int(stats["preemptions"]),
        wall_s=wall,
        events=result.events,
        predicted_jobs=predicted,
        median_relative_error=error,
        within_2x=within,
    )


def compare(
    trace: Trace,
    cluster: ClusterSpec,
    policies: Iterable[str],
    *,
    workers: int = 1,
    on_done: Callable[[PolicyRun], None] | None = None,
    **kwargs: Any,
) -> list[PolicyRun]:
    """Each policy on the same history and cluster (``workers`` processes at a time), with the
    ratios against FIFO and the share of the oracle's gain where those runs are among them."""
    names = list(dict.fromkeys(policies))
    runs: dict[str, PolicyRun] = {}
    for name, run in sweep(names, lambda policy, _: run_policy(trace, cluster, policy, **kwargs), workers=workers):
        runs[name] = run
        if on_done is not None:
            on_done(run)
    out = [runs[p] for p in names]
    add_ratios(out)
    return out


def add_ratios(runs: list[PolicyRun]) -> None:
    by_name = {r.policy: r for r in runs}
    fifo, oracle = by_name.get(BASELINE), by_name.get(ORACLE)
    for run in runs:
        if fifo is not None and run.avg_jct_s > 0:
            run.vs_fifo = fifo.avg_jct_s / run.avg_jct_s
        if fifo is not None and oracle is not None and run.policy not in (BASELINE, ORACLE):
            run.oracle_share = oracle_share(fifo.avg_jct_s, oracle.avg_jct_s, run.avg_jct_s)


def oracle_share(fifo_jct: float, oracle_jct: float, jct: float) -> float | None:
    """The share of the oracle's speed-up over FIFO a policy keeps (None: the oracle gains < 5%)."""
    gain = fifo_jct / oracle_jct - 1.0
    if not gain > 0.05 or not jct > 0:
        return None
    return (fifo_jct / jct - 1.0) / gain


@dataclass(frozen=True)
class Advice:
    policy: str
    reason: str


def recommend(runs: list[PolicyRun], *, oracle: str = ORACLE) -> Advice:
    """The policy of the lowest average JCT whose p95 JCT is within ``P95_SLACK`` of FIFO's (the
    oracle is left out: it needs durations no scheduler is told)."""
    candidates = [r for r in runs if r.policy != oracle and math.isfinite(r.avg_jct_s)]
    if not candidates:
        raise ValueError("no policy to recommend: every run failed or only the oracle ran")
    fifo = next((r for r in runs if r.policy == BASELINE), None)
    bound = fifo.p95_jct_s * P95_SLACK if fifo is not None else math.inf
    fair = [r for r in candidates if r.p95_jct_s <= bound] or candidates
    best = min(fair, key=lambda r: (r.avg_jct_s, r.preemptions))
    parts = [f"lowest average JCT ({best.avg_jct_s:,.0f} s)"]
    if fifo is not None and best.policy != BASELINE:
        parts.append(f"{fifo.avg_jct_s / best.avg_jct_s:.2f}x better than FIFO")
    skipped = [r.policy for r in candidates if r not in fair]
    if skipped:
        parts.append(f"{', '.join(skipped)} left out: p95 JCT over {P95_SLACK:.2f}x FIFO's")
    return Advice(best.policy, "; ".join(parts))


def recent(trace: Trace, days: float | None) -> Trace:
    """The jobs submitted in the last ``days`` of the history (all of it: None)."""
    if days is None or trace.jobs.empty:
        return trace
    last = float(trace.jobs["submit_time"].max())
    jobs = trace.jobs[trace.jobs["submit_time"] >= last - days * 86400.0].reset_index(drop=True)
    return Trace(
        name=trace.name,
        jobs=jobs,
        rows_read=len(jobs),
        rejected=dict(trace.rejected),
        absolute_time=trace.absolute_time,
    )
