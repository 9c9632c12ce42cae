"""Scheduler benchmark: the latency of one scheduling pass per policy, and placements per second
end to end through NATS.

1. **One pass**: 1,000 nodes x 8 GPUs (2 NVLink islands of 4, racks of 40), about 95% of the
   GPUs held by running jobs, 1,000 jobs waiting (1-8 GPUs, some 2-node gangs, three VCs, known
   and unknown durations). ``plan()`` (placement, quotas, backfill, preemption, pending reasons)
   is timed ``--repeats`` times for each policy; FIFO is the baseline of the ratio column.
2. **End to end**: a real scheduler process on an embedded nats-server, 1,000 sim nodes x 8 GPUs
   registered through the log; ``--jobs`` submissions go through the intake path (pipelined,
   1,000 in flight) and the clock stops when the last JobPlaced is in the log.

Targets (issue 4): a pass <= 20 ms p99 at that size; >= 2,000 placed jobs/s end to end.

Usage: python bench/bench_scheduler.py [--repeats 30] [--jobs 3000] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import open_log
from gpuherd.natsd import NatsServer
from services.scheduler.decide import SchedulerDecider
from services.scheduler.policy import POLICIES, make_policy
from services.scheduler.schedule import plan
from services.scheduler.state import SchedulerState

console = Console()
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


def time_passes(state: SchedulerState, repeats: int) -> list[tuple[str, float, float, int, int]]:
    rows = []
    for name in sorted(POLICIES, key=lambda p: (p != "fifo", p)):
        policy = make_policy(name)
        times, result = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            result = plan(state, policy, backfill=True)
            times.append((time.perf_counter() - started) * 1000)
        times.sort()
        assert result is not None
        rows.append(
            (
                name,
                statistics.median(times),
                times[int(0.99 * (len(times) - 1))],
                len(result.placed),
                len(result.preempted),
            )
        )
    return rows


async def end_to_end(jobs: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="gpuherd-bench-") as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        scheduler = None
        log = await open_log(server.url, name="bench", persistent=False)
        try:
            await log.append_pipelined(registrations())
            with open(Path(tmp) / "scheduler.log", "wb") as out:
                scheduler = subprocess.Popen(
                    [sys.executable, "-m", "services.scheduler", "--nats-url", server.url, "--lost-after", "3600"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            for _ in range(300):
                try:
                    await log.request("scheduler.ready", b"", timeout=1.0)
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            client = await Client.connect(server.url, source="bench")
            window = asyncio.Semaphore(1000)

            async def submit(i: int) -> None:
                async with window:
                    await client.submit({"name": f"e{i}", "user": "u", "gpus": 1, "duration_s": 3600.0}, timeout=120)

            placed = 0
            all_placed = asyncio.Event()

            async def count_placements() -> None:  # one follower, not repeated full reads
                nonlocal placed
                async for record in log.read(await log.last_seq() + 1, follow=True):
                    if isinstance(record.event, ev.JobPlaced):
                        placed += 1
                        if placed >= jobs:
                            all_placed.set()

            counter = asyncio.create_task(count_placements())
            started = time.perf_counter()
            await asyncio.gather(*(submit(i) for i in range(jobs)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_placed.wait(), 600)
            counter.cancel()
            elapsed = time.perf_counter() - started
            await client.close()
            return elapsed, placed
        finally:
            if scheduler is not None:
                scheduler.terminate()
                scheduler.wait(10)
            await log.close()
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()

    started = time.perf_counter()
    state = loaded_state()
    used = NODES * GPUS - state.free_gpus()
    console.print(
        f"state: {NODES} nodes x {GPUS} GPUs, {used} GPUs busy, {len(state.queue)} jobs waiting "
        f"(built in {time.perf_counter() - started:.1f}s)"
    )
    rows = time_passes(state, args.repeats)
    baseline = rows[0][1]
    table = Table(title=f"one scheduling pass, {len(state.queue)} waiting jobs, {NODES} nodes x {GPUS} GPUs")
    for col in ("policy", "p50 ms", "p99 ms", "x fifo p50", "placed", "preempted", "target"):
        table.add_column(col, justify="right")
    for name, p50, p99, placed, preempted in rows:
        table.add_row(
            name,
            f"{p50:.1f}",
            f"{p99:.1f}",
            f"{p50 / baseline:.2f}",
            str(placed),
            str(preempted),
            "ok (<= 20 ms)" if p99 <= 20 else "MISSED (> 20 ms)",
        )
    console.print(table)
    if args.skip_e2e:
        return
    elapsed, placed = asyncio.run(end_to_end(args.jobs))
    e2e = Table(title="end to end through NATS: intake -> JobSubmitted -> JobPlaced")
    for col in ("jobs", "placed", "seconds", "placed jobs/s", "target"):
        e2e.add_column(col, justify="right")
    rate = placed / elapsed
    e2e.add_row(
        str(args.jobs), str(placed), f"{elapsed:.1f}", f"{rate:,.0f}", "ok" if rate >= 2000 else "MISSED (< 2,000/s)"
    )
    console.print(e2e)


if __name__ == "__main__":
    main()
