"""Event-log benchmark: append and replay throughput, and submit -> placed latency.

Runs against a fresh embedded nats-server (file storage, as deployed) on this machine:

1. append, one event per round trip (the baseline), pipelined with 256 in flight, and
   appends of 1,000 events (each one stored message, a page);
1b. durability: the same appends on a server that fsyncs before every acknowledgement
   (``sync_interval: always``, gpuherd's default) and on one with nats-server's own default
   (fsync every 2 minutes), in the same run: appends/s and the ack latency (p50/p99) one at a time,
   pipelined, and in appends of 4 and of 100 events, each stored as a page and as an atomic batch
   (one message per event, as before pages): the cost of an acknowledged job surviving a power cut;
2. full replay through gpuherd's ordered reader, against nats-py's ``fetch`` loop (baseline); and
   submissions taken from the intake stream and acknowledged by the scheduler's durable consumer,
   against nats-py's ``fetch`` loop on a durable consumer of its own (baseline): messages/s and
   this process's CPU per message;
3. 2,000 submissions through the intake path (the Python client) to a real scheduler
   process, with 100 sim nodes x 8 GPUs emulated in this process (they register, send
   heartbeats, and finish each job after its duration): latency from publishing the
   submission to the verdict reply, and to the JobPlaced event being readable in the log.

Usage: python bench/bench_log.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
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
from gpuherd.log import HERD_INTAKE, open_log
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.log.pages import PAGE_HEADER, decode_page
from gpuherd.natsd import SYNC_ALWAYS, UNSAFE_SYNC, NatsServer

console = Console()
SPEC = ev.JobSpec(name="bench", user="u", gpus=1, duration_s=1.0)


def job_events(prefix: str, n: int) -> list[ev.Event]:
    return [
        ev.JobSubmitted(
            id=f"{prefix}-{i}",
            at=float(i),
            source="bench",
            job=f"{prefix}{i}",
            spec=SPEC,
            intake_source="bench",
            based_on=i,
            cause=f"c{i}",
        )
        for i in range(n)
    ]


async def bench_appends(log: JetStreamLog, quick: bool) -> list[tuple[str, float, float]]:
    rows = []
    n_single = 500 if quick else 2000
    events = job_events("one", n_single)
    t = time.perf_counter()
    for e in events:
        await log.append([e])
    single = n_single / (time.perf_counter() - t)
    rows.append(("append, one per round trip", single, 1.0))

    n = 5000 if quick else 20_000
    events = job_events("pipe", n)
    t = time.perf_counter()
    await log.append_pipelined(events, window=256)
    rows.append(("append, pipelined (256 in flight)", n / (time.perf_counter() - t), 0.0))

    events = job_events("batch", n)
    t = time.perf_counter()
    for i in range(0, n, 1000):
        await log.append(events[i : i + 1000])
    rows.append(("append, 1,000 events an append (a page)", n / (time.perf_counter() - t), 0.0))
    return [(name, rate, rate / single) for name, rate, _ in rows]


async def timed_appends(log: JetStreamLog, prefix: str, n: int, per_append: int, in_flight: int) -> dict[str, float]:
    """``n`` events in appends of ``per_append`` (1: a publish; more: a page or an atomic batch), ``in_flight``
    appends outstanding at once: events/s, and each append's time to its acknowledgement."""
    events = job_events(prefix, n)
    appends = [events[i : i + per_append] for i in range(0, n, per_append)]
    latencies: list[float] = []
    slots = asyncio.Semaphore(in_flight)

    async def one(part: list[ev.Event]) -> None:
        try:
            t = time.perf_counter()
            await log.append(part)
            latencies.append(1000 * (time.perf_counter() - t))
        finally:
            slots.release()

    start = time.perf_counter()
    tasks = []
    for part in appends:
        await slots.acquire()
        tasks.append(asyncio.create_task(one(part)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    return {"events_per_s": n / elapsed, "ack_p50_ms": statistics.median(latencies), "ack_p99_ms": pct(latencies, 99)}


# (way, events per append, appends in flight, pages): an append of several events is one page (one
# stored message) unless ``pages`` is off, when it is an atomic batch of one message per event.
DURABILITY_WAYS = (
    ("one at a time", 1, 1, True),
    ("pipelined, 256 in flight", 1, 256, True),
    ("appends of 4: atomic batches (before pages)", 4, 1, False),
    ("appends of 4: pages", 4, 1, True),
    ("appends of 100: atomic batches (before pages)", 100, 1, False),
    ("appends of 100: pages", 100, 1, True),
)


async def bench_durability(data_dir: Path, quick: bool) -> list[dict[str, object]]:
    """The same appends against a server that fsyncs before every ack and one that fsyncs every 2
    minutes (nats-server's default), each on a fresh store, in this run."""
    rows: list[dict[str, object]] = []
    counts = {1: 300 if quick else 1500, 256: 3000 if quick else 20_000, 4: 600 if quick else 3000}
    counts[100] = counts[256]
    for sync in (SYNC_ALWAYS, UNSAFE_SYNC):
        server = NatsServer(data_dir / f"nats-sync-{sync}", sync=sync).start()
        try:
            for way, per_append, in_flight, pages in DURABILITY_WAYS:
                log = await open_log(server.url, name="bench-durability", pages=pages)
                assert isinstance(log, JetStreamLog)
                n = counts[in_flight if per_append == 1 else per_append]
                prefix = f"d{sync}{per_append}x{in_flight}{pages}"
                measured = await timed_appends(log, prefix, n, per_append, in_flight)
                rows.append({"sync": sync, "way": way, "events": n, **measured})
                await log.close()
        finally:
            server.stop()
    fast = {r["way"]: r for r in rows if r["sync"] == UNSAFE_SYNC}
    for row in rows:
        row["x_2m"] = float(row["events_per_s"]) / float(fast[row["way"]]["events_per_s"])  # type: ignore[arg-type]
    return rows


async def naive_replay(log: JetStreamLog) -> int:
    """nats-py's own pull consumer and fetch loop: the baseline the ordered reader replaces."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    stored = int((await log.js.stream_info("HERD")).state.messages)
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, mem_storage=True)
    sub = await log.js.pull_subscribe("", stream="HERD", config=config)
    messages = events = 0
    while messages < stored:
        for msg in await sub.fetch(batch=1000, timeout=5):
            messages += 1
            if msg.headers and PAGE_HEADER in msg.headers:  # a page: its events, as the ordered reader does
                for data, _ in decode_page(msg.data):
                    ev.decode(data)
                    events += 1
                continue
            ev.decode(msg.data)
            events += 1
    await sub.unsubscribe()
    return events


async def bench_replay(log: JetStreamLog) -> list[tuple[str, float, float]]:
    t = time.perf_counter()
    n_base = await naive_replay(log)
    base = n_base / (time.perf_counter() - t)
    t = time.perf_counter()
    n = len(await log.read_all())
    ours = n / (time.perf_counter() - t)
    return [
        (f"replay {n_base:,} events, nats-py fetch loop", base, 1.0),
        (f"replay {n:,} events, ordered reader", ours, ours / base),
    ]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def bench_intake_fetch(log: JetStreamLog, quick: bool) -> list[tuple[str, float, float]]:
    """Submissions fetched and acknowledged in 512s, as the scheduler's intake takes them."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    n = 2_000 if quick else 20_000
    payload = b'{"name":"bench","user":"u","gpus":1,"duration_s":60,"intake_id":"%d"}'
    for i in range(n):
        await log.publish_intake("bench", payload % i)

    async def naive() -> int:
        config = ConsumerConfig(
            durable_name="bench-naive", ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL
        )
        sub = await log.js.pull_subscribe("", durable="bench-naive", stream=HERD_INTAKE, config=config)
        seen: set[int] = set()
        got = 0
        while got < n:
            for msg in await sub.fetch(batch=512, timeout=5):
                seen.add(msg.metadata.sequence.stream)  # (the intake reads each one's sequence, time, deliveries)
                await msg.ack()
                got += 1
        await sub.unsubscribe()
        return got

    async def ours() -> int:
        consumer = log.intake_consumer("bench-ours")
        got = 0
        while got < n:
            for delivery in await consumer.fetch(512, timeout=5):
                await consumer.ack(delivery)
                got += 1
        await consumer.close()
        return got

    rows = []
    for name, take in (("nats-py fetch loop", naive), ("intake consumer", ours)):
        cpu, wall = _cpu_s(), time.perf_counter()
        got = await take()
        wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
        rows.append(
            (f"intake: {got:,} submissions fetched + acked, {name} ({cpu / got * 1e6:.1f} us CPU each)", got / wall)
        )
    base = rows[0][1]
    return [(name, rate, rate / base) for name, rate in rows]


class SimNodes:
    """100 sim nodes in one process: registration, heartbeats, and jobs that end after their duration."""

    def __init__(self, log: JetStreamLog, nodes: int, gpus: int) -> None:
        self.log = log
        self.nodes = [f"b{i:03d}" for i in range(nodes)]
        self.gpus = gpus
        self.placed_at: dict[str, float] = {}  # intake id -> perf_counter when JobPlaced was read
        self.intake_of: dict[str, str] = {}  # job -> intake id
        self.tasks: list[asyncio.Task[None]] = []
        self.running: set[asyncio.Task[None]] = set()  # jobs in flight (kept so they are not collected)

    async def start(self) -> None:
        registrations = [
            ev.NodeRegistered(
                id=f"bench-reg-{n}",
                at=time.time(),
                source="bench",
                node=n,
                gpus=tuple(
                    ev.GpuInfo(index=i, uuid=f"{n}-{i}", model="SIM", memory_mb=81920) for i in range(self.gpus)
                ),
            )
            for n in self.nodes
        ]
        await self.log.append(registrations)
        self.tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._follow())]

    async def _heartbeats(self) -> None:
        while True:
            for n in self.nodes:
                await self.log.publish_telemetry(f"{n}.heartbeat", b"{}")
            await asyncio.sleep(2)

    async def _follow(self) -> None:
        async for record in self.log.read(1, follow=True):
            e = record.event
            if isinstance(e, ev.JobSubmitted) and e.spec.intake_id:
                self.intake_of[e.job] = e.spec.intake_id
            elif isinstance(e, ev.JobPlaced):
                intake = self.intake_of.get(e.job)
                if intake is not None:
                    self.placed_at.setdefault(intake, time.perf_counter())
                job = asyncio.create_task(self._run(e))
                self.running.add(job)
                job.add_done_callback(self.running.discard)

    async def _run(self, placed: ev.JobPlaced) -> None:
        node = placed.allocations[0].node
        await self.log.append(
            [
                ev.JobStarted(
                    id=f"bench-start-{placed.job}-{placed.attempt}",
                    at=time.time(),
                    source="bench",
                    job=placed.job,
                    attempt=placed.attempt,
                    node=node,
                )
            ]
        )
        await asyncio.sleep(1.0)
        await self.log.append(
            [
                ev.JobFinished(
                    id=f"bench-fin-{placed.job}-{placed.attempt}",
                    at=time.time(),
                    source="bench",
                    job=placed.job,
                    attempt=placed.attempt,
                    outcome="completed",
                    node=node,
                )
            ]
        )

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def bench_latency(url: str, data_dir: Path, quick: bool) -> list[tuple[str, float, float, float, float]]:
    submissions = 500 if quick else 2000
    rate = 200.0  # per second: well under what 800 GPUs of 1 s jobs absorb, so latency is not queueing
    env = dict(os.environ, GPUHERD_LOG_LEVEL="WARNING")
    with open(data_dir / "scheduler.log", "wb") as scheduler_log:
        scheduler = subprocess.Popen(
            [sys.executable, "-m", "services.scheduler", "--nats-url", url, "--lost-after", "600"],
            stdout=scheduler_log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    log = await open_log(url, name="bench-nodes")
    nodes = SimNodes(log, 100, 8)
    client = await Client.connect(url, source="bench")
    try:
        await nodes.start()
        await asyncio.sleep(2.0)  # the scheduler catches up and registers the nodes
        sent: dict[str, float] = {}
        verdict_at: dict[str, float] = {}

        async def one(i: int) -> None:
            intake = f"lat-{i}"
            sent[intake] = time.perf_counter()
            spec = {"name": f"b{i}", "user": "u", "gpus": 1 + (i % 10 == 0), "duration_s": 1.0, "intake_id": intake}
            await client.submit(spec, timeout=60)
            verdict_at[intake] = time.perf_counter()

        start = time.perf_counter()
        pending = []
        for i in range(submissions):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            pending.append(asyncio.create_task(one(i)))
        await asyncio.gather(*pending)
        deadline = time.monotonic() + 30
        while len(nodes.placed_at) < submissions and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        verdict_ms = [1000 * (verdict_at[k] - sent[k]) for k in verdict_at]
        placed_ms = [1000 * (nodes.placed_at[k] - sent[k]) for k in nodes.placed_at]
        if len(placed_ms) < submissions:
            console.print(f"[red]only {len(placed_ms)} of {submissions} jobs were placed[/red]")
        return [
            (
                f"submit -> verdict reply ({len(verdict_ms)})",
                statistics.median(verdict_ms),
                pct(verdict_ms, 99),
                max(verdict_ms),
                1.0,
            ),
            (
                f"submit -> JobPlaced in log ({len(placed_ms)})",
                statistics.median(placed_ms),
                pct(placed_ms, 99),
                max(placed_ms),
                statistics.median(placed_ms) / statistics.median(verdict_ms),
            ),
        ]
    finally:
        nodes.stop()
        await client.close()
        await log.close()
        scheduler.terminate()
        try:
            scheduler.wait(10)
        except subprocess.TimeoutExpired:  # (said, and stopped: a bench leaves nothing running)
            tail = (data_dir / "scheduler.log").read_text(errors="replace")[-2000:]
            console.print(f"[red]the scheduler did not exit within 10 s of SIGTERM; killed. Log:[/red]\n{tail}")
            scheduler.kill()
            scheduler.wait()


async def main(quick: bool, as_json: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        durability = await bench_durability(Path(tmp), quick)
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            log = await open_log(server.url, name="bench")
            assert isinstance(log, JetStreamLog)
            appends = await bench_appends(log, quick)
            replay = await bench_replay(log) + await bench_intake_fetch(log, quick)
            await log.close()
        finally:
            server.stop()
        # A fresh log: the jobs appended above would otherwise wait at the head of the queue.
        server = NatsServer(Path(tmp) / "nats-latency").start()
        try:
            latency = await bench_latency(server.url, Path(tmp), quick)
        finally:
            server.stop()

    table = Table(title=f"event log on nats-server (file storage), {os.cpu_count()} cores")
    for col in ("measure", "events/s", "x baseline", "target"):
        table.add_column(col, justify="right" if col != "measure" else "left")
    targets = {"atomic": ">= 15,000", "ordered": ">= 40,000"}
    for name, rate, ratio in appends + replay:
        target = next((t for k, t in targets.items() if k in name), "")
        table.add_row(name, f"{rate:,.0f}", f"{ratio:.2f}", target)
    console.print(table)
    lat = Table(title="intake -> placement, 100 sim nodes x 8 GPUs, 200 submissions/s")
    for col in ("path", "p50 ms", "p99 ms", "max ms", "p50 x verdict", "target"):
        lat.add_column(col, justify="right" if col != "path" else "left")
    for name, p50, p99, worst, ratio in latency:
        lat.add_row(
            name, f"{p50:.1f}", f"{p99:.1f}", f"{worst:.1f}", f"{ratio:.2f}", "p99 <= 50" if "JobPlaced" in name else ""
        )
    console.print(lat)
    dur = Table(title="durability: fsync before every ack (always, the default) vs every 2 minutes (nats-server's)")
    for col in ("sync", "appends", "events", "events/s", "x 2m", "ack p50 ms", "ack p99 ms"):
        dur.add_column(col, justify="left" if col in ("sync", "appends") else "right")
    for row in durability:
        dur.add_row(
            str(row["sync"]),
            str(row["way"]),
            f"{row['events']:,}",
            f"{row['events_per_s']:,.0f}",
            f"{row['x_2m']:.2f}",
            f"{row['ack_p50_ms']:.2f}",
            f"{row['ack_p99_ms']:.2f}",
        )
    console.print(dur)
    if as_json:
        print(
            json.dumps(
                {
                    "appends": [{"measure": n, "events_per_s": r, "x_baseline": x} for n, r, x in appends + replay],
                    "latency": [
                        {"path": n, "p50_ms": a, "p99_ms": b, "max_ms": c, "x_verdict": d} for n, a, b, c, d in latency
                    ],
                    "durability": durability,
                }
            )
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events, for a smoke run")
    parser.add_argument("--json", action="store_true", help="also print one JSON object")
    args = parser.parse_args()
    asyncio.run(main(args.quick, args.json))
