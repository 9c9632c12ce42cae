"""What a sweep's ends cost the analytics decider: each end revises the predictions of the sweep's
open jobs (its burst-mates) that what the end taught moves enough.

One sweep of ``--jobs`` alike jobs, submitted a tenth of a second apart, then ended one by one
(each ran 20, 60 or 400 s, at random with a fixed seed), through the analytics decider alone: its
fold and its decisions, every revision folded back as the live service's would be.

Baseline, in the same run: the same ends revised by walking every open mate of the sweep and
weighing each (``DurationModel.mates`` + ``revise``), as the decider did before its bursts kept
their jobs in groups. Both must decide the same revisions (checked at every end).

Columns: the wall time of all the ends, the revisions recorded (log events), and the mates walked
and groups weighed per end. Revisions grow with the square of the sweep where the burst's median
keeps moving (mixed durations): that is the model's revision rule, not the cost of its code.

Usage: python bench/bench_revisions.py [--jobs 2000,8000] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from apps.registry import make_decider
from gpuherd import events as ev
from services.analytics.decide import AnalyticsDecider, _moved, _predicted
from services.analytics.state import AnalyticsState

ROOT = Path(__file__).resolve().parents[1]
Revise = Callable[[AnalyticsDecider, AnalyticsState, ev.JobFinished], list[ev.Event]]


def grouped(decider: AnalyticsDecider, state: AnalyticsState, end: ev.JobFinished) -> list[ev.Event]:
    return decider.decide(state, end)


def every_mate(decider: AnalyticsDecider, state: AnalyticsState, end: ev.JobFinished) -> list[ev.Event]:
    """The baseline: every open mate with a recorded prediction, weighed one by one."""
    current = {m: state.predicted[m] for m in state.model.mates(end.job) if m in state.predicted}
    return [_predicted(m, g) for m, g in state.model.revise(current, _moved).items()]


def sweep(jobs: int, revise: Revise) -> tuple[float, list[list[str]], dict[str, int]]:
    """All the ends of one sweep: (their wall time, the jobs revised at each end, counts)."""
    decider = make_decider("analytics")
    assert isinstance(decider, AnalyticsDecider)
    state, seq = decider.initial_state(), 0

    def fold(event: ev.Event) -> None:
        nonlocal state, seq
        seq += 1
        state = decider.evolve(state, seq, event)

    gpus = tuple(ev.GpuInfo(index=i, uuid=f"g{i}", model="sim", memory_mb=1000) for i in range(8))
    fold(ev.NodeRegistered(id="r", node="n1", gpus=gpus))
    spec = ev.JobSpec(name="sweep", user="bo", gpus=1, duration_s=50)
    for i in range(jobs):
        submitted = ev.JobSubmitted(id=f"s{i}", at=i / 10, job=f"b{i}", spec=spec, intake_source="t")
        fold(submitted)
        for made in decider.decide(state, submitted):
            fold(made)
    rng = np.random.default_rng(0)
    revised: list[list[str]] = []
    counts = {"mates": 0, "groups": 0}
    clock = jobs / 10
    took = 0.0
    for i in range(jobs):
        job, clock = f"b{i}", clock + 1.0
        fold(ev.JobPlaced(id=f"p{job}", at=clock, job=job, attempt=0, allocations=(ev.Allocation("n1", (0,)),)))
        fold(ev.JobStarted(id=f"st{job}", at=clock, job=job, attempt=0, node="n1"))
        runs = float(rng.choice([20.0, 60.0, 400.0]))
        end = ev.JobFinished(id=f"f{job}", at=clock + runs, job=job, attempt=0, outcome="completed")
        fold(end)
        burst = state.model.bursts.get(state.model.ended_in.get(job, ""))
        counts["mates"] += len(burst.open_jobs) if burst is not None else 0
        counts["groups"] += len(burst.groups) if burst is not None else 0
        t0 = time.perf_counter()
        made = revise(decider, state, end)
        took += time.perf_counter() - t0
        revised.append([e.job for e in made])  # type: ignore[attr-defined]
        for event in made:
            fold(event)
    return took, revised, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default="2000,8000", help="sweep sizes, comma-separated")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = parser.parse_args()
    rows = []
    for jobs in (int(n) for n in args.jobs.split(",")):
        base_s, base_revised, counts = sweep(jobs, every_mate)
        grouped_s, grouped_revised, _ = sweep(jobs, grouped)
        if grouped_revised != base_revised:
            raise SystemExit(f"sweep of {jobs}: the groups revised other jobs than weighing every mate did")
        rows.append(
            {
                "jobs": jobs,
                "revisions": sum(len(r) for r in grouped_revised),
                "mates_per_end": counts["mates"] / jobs,
                "groups_per_end": counts["groups"] / jobs,
                "every_mate_s": round(base_s, 3),
                "grouped_s": round(grouped_s, 3),
                "speedup": round(base_s / grouped_s, 2) if grouped_s else None,
            }
        )
    if args.json:
        print(json.dumps({"sweeps": rows}))
        return
    table = Table(title="a sweep's ends through the analytics decider (revisions of its open jobs)")
    columns = ("jobs", "revisions", "mates / end", "groups / end", "every mate (baseline) s", "grouped s", "ratio")
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            f"{r['jobs']:,}",
            f"{r['revisions']:,}",
            f"{r['mates_per_end']:.0f}",
            f"{r['groups_per_end']:.1f}",
            f"{r['every_mate_s']:.2f}",
            f"{r['grouped_s']:.2f}",
            f"{r['speedup']}x",
        )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
