"""Scheduler benchmark: the latency of one scheduling pass, per policy.

The state: 1,000 nodes x 8 GPUs (2 NVLink islands of 4, racks of 40), about 95% of the GPUs held
by running jobs, 1,000 jobs waiting (1-16 GPUs, 2-node gangs, three VCs with quotas, known
durations, priorities), built by the scheduler's own decisions. For each policy:

- **the decider's pass** (what the live scheduler and the simulator run: ``explain=False``, node
  views kept between passes by a ``ViewCache``, and the queue's order by a ``RankIndex`` under a
  policy whose ranks are static or timed (LAS): the first run builds it), timed ``--repeats`` times;
- **the explained pass**, the baseline, in the same run: the same decisions plus every waiting
  job's reason (``gpuherd why``), with the node views built afresh.

Target: the decider's pass <= 20 ms p99 for every policy. (Placements per second end to end,
through NATS with every service running: ``bench_load.py``.)

Usage: python bench/bench_scheduler.py [--repeats 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from functools import partial

from rich.console import Console
from rich.table import Table

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.placement import ViewCache
from services.scheduler.policy import POLICIES, make_policy
from services.scheduler.ranks import RankIndex
from services.scheduler.schedule import plan
from services.scheduler.state import SchedulerState

console = Console(width=160)
NODES, GPUS = 1000, 8


def gpu_infos(name: str) -> tuple[ev.GpuInfo, ...]:
    return tuple(
        ev.GpuInfo(
            index=i,
            uuid=f"{name}-{i}",
            model="SIM",
            memory_mb=81920,
            nvlink_peers=tuple(j for j in range(4 * (i // 4), 4 * (i // 4) + 4) if j != i),
        )
        for i in range(GPUS)
    )


def registrations() -> list[ev.NodeRegistered]:
    return [
        ev.NodeRegistered(
            id=f"reg-{n}", at=0.0, source="bench", node=f"n{n:04d}", gpus=gpu_infos(f"n{n:04d}"), rack=f"r{n // 40}"
        )
        for n in range(NODES)
    ]


def loaded_state(seed: int = 1) -> SchedulerState:
    """A busy cluster with 1,000 jobs waiting, built by the scheduler's own decisions."""
    rng = random.Random(seed)
    decider = SchedulerDecider()
    state = decider.initial_state()
    seq = 0

    def fold(event: ev.Event) -> None:
        nonlocal seq
        seq += 1
        decider.evolve(state, seq, event)

    for event in [
        ev.VcConfigured(id="vc-a", vc="a", gpu_quota=3000, can_borrow=True),
        ev.VcConfigured(id="vc-b", vc="b", gpu_quota=2000, can_borrow=False),
        ev.PolicyConfigured(id="pc", policy="fifo", backfill=False),  # fill the cluster in arrival order
        *registrations(),
    ]:
        fold(event)
    n = 0

    def job(at: float) -> ev.JobSubmitted:
        nonlocal n
        n += 1
        gpus = rng.choice([1, 1, 1, 2, 2, 4, 8, 8, 16])
        spec = ev.JobSpec(
            name=f"j{n}",
            user=f"u{rng.randrange(50)}",
            gpus=gpus,
            nodes=2 if gpus == 16 else None,
            vc=rng.choice(["a", "b", "default"]),
            duration_s=rng.choice([60.0, 600.0, 3600.0, 36000.0]),
            priority=rng.choice([0, 0, 0, 0, 1]),
        )
        return ev.JobSubmitted(id=f"sub-{n}", at=at, source="bench", job=f"j{n}", spec=spec, intake_source="bench")

    # Fill to ~95%: place jobs as they come, then start them.
    while state.free_gpus() > 0.05 * NODES * GPUS:
        fold(job(0.0))
        for placed in decider.plan(state).placed:
            fold(placed)
            for alloc in placed.allocations:
                fold(
                    ev.JobStarted(
                        id=f"start-{placed.job}-{alloc.node}", at=0.0, job=placed.job, attempt=0, node=alloc.node
                    )
                )
    while len(state.queue) < 1000:
        fold(job(10.0))
    return state


TARGET_P99_MS = 20.0


def timed(repeats: int, one_pass) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = one_pass()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times), result


def quantile(times: list[float], q: float) -> float:
    return times[int(q * (len(times) - 1))]


def time_passes(state: SchedulerState, repeats: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in sorted(POLICIES, key=lambda p: (p != "fifo", p)):
        policy = make_policy(name)
        decider_pass = partial(plan, state, policy, backfill=True, cache=ViewCache(), ranks=RankIndex(), explain=False)
        decider_times, fast = timed(repeats, decider_pass)
        explained_times, full = timed(repeats, partial(plan, state, policy, backfill=True))
        assert fast.placed == full.placed and fast.preempted == full.preempted, f"{name}: the passes disagree"
        out[name] = {
            "p50_ms": statistics.median(decider_times),
            "p99_ms": quantile(decider_times, 0.99),
            "explained_p50_ms": statistics.median(explained_times),
            "explained_p99_ms": quantile(explained_times, 0.99),
            "placed": len(fast.placed),
            "preempted": len(fast.preempted),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures instead")
    args = parser.parse_args()

    started = time.perf_counter()
    state = loaded_state()
    used = NODES * GPUS - state.free_gpus()
    built_s = time.perf_counter() - started
    passes = time_passes(state, args.repeats)
    result = {
        "nodes": NODES,
        "gpus_per_node": GPUS,
        "busy_gpus": used,
        "waiting": len(state.queue),
        "repeats": args.repeats,
        "policies": passes,
        "all_within_target": all(p["p99_ms"] <= TARGET_P99_MS for p in passes.values()),
    }
    if args.json:
        print(json.dumps(result))
        return
    console.print(f"state: {NODES} nodes x {GPUS} GPUs, {used} GPUs busy, {len(state.queue)} jobs waiting "
                  f"(built in {built_s:.1f}s)")  # fmt: skip
    title = f"one scheduling pass, {len(state.queue)} waiting jobs, {NODES:,} nodes x {GPUS} GPUs ({args.repeats} runs)"
    table = Table(title=title)
    columns = ("policy", "pass p50 ms", "pass p99 ms", "explained p50 ms", "explained p99 ms", "x explained p50",
               "placed", "preempted", "p99 <= 20 ms")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for name, p in passes.items():
        table.add_row(
            name, f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.2f}", f"{p['explained_p50_ms']:.1f}",
            f"{p['explained_p99_ms']:.1f}", f"{p['p50_ms'] / p['explained_p50_ms']:.2f}", str(p["placed"]),
            str(p["preempted"]), "ok" if p["p99_ms"] <= TARGET_P99_MS else "MISSED",
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
