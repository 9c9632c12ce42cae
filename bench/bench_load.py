"""Load: 1,000 sim nodes x 8 GPUs and 20,000 jobs submitted through NATS.

The real services run as processes (scheduler, elastic, memory broker, analytics) on an embedded
nats-server. This benchmark plays the other two parties:

- **submitters**: 20,000 intake messages (plain NATS, ``--window`` in flight), each awaiting its
  verdict;
- **the fleet**: 1,000 nodes registered as agents would register them; for every ``JobPlaced`` it
  appends what each node's agent would (``JobStarted``, then ``TaskEnded`` after the job's
  duration), so GPUs free up and the queue keeps moving. (1,000 agent processes do not fit on one
  machine; at the log they are indistinguishable from this.)

It prints submissions/s and placements/s (sustained, first to last), decision latency p50/p99 (a
scheduler decision stored minus its cause stored, from the log's own timestamps), the scheduler's
consumer lag (sampled each second), each service's peak memory, and checks that no job was lost:
every accepted job submitted once, placed, and finished exactly once. The baseline, measured in
the same run, is raw JetStream appends of the same number of events (pipelined).

Targets: >= 2,000 jobs/s submitted and placed, p99 decision latency <= 50 ms, every service < 500 MB.

Usage: python bench/bench_load.py [--nodes 1000] [--jobs 20000] [--window 512]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import open_log
from gpuherd.log.ordered import ordered_messages, stream_time
from gpuherd.metrics import http_get, parse_metrics
from gpuherd.natsd import NatsServer, free_port

console = Console()
ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("scheduler", "elastic", "memory", "analytics")


def registration(i: int, gpus: int) -> ev.NodeRegistered:
    name = f"sim-{i:04d}"
    infos = tuple(
        ev.GpuInfo(
            index=g,
            uuid=f"{name}-{g}",
            model="SIM",
            memory_mb=81920,
            nvlink_peers=tuple(p for p in range(gpus) if p != g),
        )
        for g in range(gpus)
    )
    return ev.NodeRegistered(
        id=f"bench:reg:{name}", at=time.time(), source=f"agent.{name}", node=name, gpus=infos,
        rack=f"rack-{i // 32}", executor="sim",
    )  # fmt: skip


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Fleet:
    """Plays every node's agent at the log: start what is placed, end it after its duration."""

    def __init__(self, log_, durations: dict[str, float]) -> None:
        self.log = log_
        self.durations = durations
        self.placed: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.place_times: list[float] = []
        self.outbox: asyncio.Queue[ev.Event] = asyncio.Queue()

    async def follow(self, start: int) -> None:
        async for record in self.log.read(start, follow=True):
            e = record.event
            if isinstance(e, ev.JobPlaced):
                self.placed[e.job] += 1
                self.place_times.append(time.monotonic())
                for alloc in e.allocations:
                    stamp = {"at": time.time(), "source": f"agent.{alloc.node}"}
                    started = ev.JobStarted(
                        id=f"bench:start:{e.job}:{e.attempt}:{alloc.node}", **stamp, job=e.job, attempt=e.attempt,
                        node=alloc.node,
                    )  # fmt: skip
                    await self.outbox.put(started)
                    asyncio.get_running_loop().call_later(
                        self.durations.get(e.job, 1.0), self._end, e.job, e.attempt, alloc.node
                    )
            elif isinstance(e, ev.JobFinished):
                self.finished[e.job] += 1

    def _end(self, job: str, attempt: int, node: str) -> None:
        ended = ev.TaskEnded(
            id=f"bench:end:{job}:{attempt}:{node}", at=time.time(), source=f"agent.{node}", job=job, attempt=attempt,
            node=node, outcome="completed", exit_code=0,
        )  # fmt: skip
        self.outbox.put_nowait(ended)

    async def send(self) -> None:
        while True:
            batch = [await self.outbox.get()]
            while not self.outbox.empty() and len(batch) < 1000:
                batch.append(self.outbox.get_nowait())
            await self.log.append_pipelined(batch)


async def scrape(port: int) -> dict[str, float]:
    return parse_metrics((await http_get(port, "/metrics"))[1])


async def baseline(url: str, n: int) -> float:
    """Raw JetStream appends of ``n`` events (pipelined): the log's own speed on this machine."""
    log_ = await open_log(url, name="bench-baseline")
    try:
        events = [ev.JobCancelRequested(id=f"bench:base:{i}", at=0.0, source="bench", job=f"base{i}") for i in range(n)]
        started = time.perf_counter()
        await log_.append_pipelined(events, window=512)
        return n / (time.perf_counter() - started)
    finally:
        await log_.close()


def decision_latencies(messages: list[tuple[int, bytes, float]]) -> list[float]:
    """Per scheduler decision: its stored time minus its cause's stored time (seconds)."""
    stored_at: dict[str, float] = {}
    out = []
    for _, data, at in messages:
        try:
            event = ev.decode(data)
        except Exception:
            continue
        stored_at[event.id] = at
        if event.source == "scheduler" and isinstance(event, ev.Decision) and event.cause in stored_at:
            out.append(at - stored_at[event.cause])
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    data_dir = Path(tempfile.mkdtemp(prefix="gpuherd-load-"))
    server = NatsServer(data_dir / "nats").start()
    ports = {name: free_port() for name in SERVICES}
    env = dict(os.environ, NATS_URL=server.url, PYTHONUNBUFFERED="1", GPUHERD_LOG_LEVEL="WARNING")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        base_rate = await baseline(server.url, args.jobs)
        log_ = await open_log(server.url, name="bench-load")
        head0 = await log_.last_seq()
        with console.status(f"registering {args.nodes} nodes x {args.gpus} GPUs"):
            await log_.append_pipelined([registration(i, args.gpus) for i in range(args.nodes)], window=512)
        for name in SERVICES:
            argv = [
                sys.executable,
                "-m",
                f"services.{name}",
                "--nats-url",
                server.url,
                "--metrics-port",
                str(ports[name]),
            ]
            if name == "scheduler":
                argv += ["--lost-after", "36000"]  # the fleet sends no heartbeats
            with open(data_dir / f"{name}.log", "wb") as service_log:
                procs[name] = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=service_log)
        client = await Client.connect(server.url, source="load", persistent=True)
        while True:  # the scheduler answers once its intake listens
            try:
                await log_.request("scheduler.ready", b"", timeout=1.0)
                break
            except Exception:
                await asyncio.sleep(0.2)

        sizes = [1] * 50 + [2] * 20 + [4] * 15 + [8] * 15
        specs = []
        durations: dict[str, float] = {}
        for i in range(args.jobs):
            spec = {"name": f"l{i}", "user": f"u{i % 50}", "gpus": rng.choice(sizes), "intake_id": f"l{i}"}
            spec["duration_s"] = rng.uniform(0.1, args.max_duration)
            specs.append(spec)
        fleet = Fleet(log_, durations)
        follower = asyncio.create_task(fleet.follow(head0 + 1))
        sender = asyncio.create_task(fleet.send())

        lags: list[float] = []

        async def sample_lag() -> None:
            while True:
                await asyncio.sleep(1.0)
                try:
                    metrics = await scrape(ports["scheduler"])
                    lags.append(await log_.last_seq() - metrics["gpuherd_folded_sequence"])
                except Exception:
                    pass

        sampler = asyncio.create_task(sample_lag())
        accepted: list[str] = []
        semaphore = asyncio.Semaphore(args.window)

        async def submit(spec: dict) -> None:
            async with semaphore:
                verdict = await client.submit_raw(msgspec.json.encode(spec), timeout=600)
            if verdict.ok and verdict.job_id:
                accepted.append(verdict.job_id)
                durations[verdict.job_id] = spec["duration_s"]

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("submitting", total=args.jobs)
            started = time.monotonic()

            async def tracked(spec: dict) -> None:
                await submit(spec)
                progress.advance(task)

            await asyncio.gather(*(tracked(s) for s in specs))
            submit_s = time.monotonic() - started
            placing = progress.add_task("placing and finishing", total=len(accepted))
            while len(fleet.finished) < len(accepted):
                progress.update(placing, completed=len(fleet.finished))
                await asyncio.sleep(0.5)
                if time.monotonic() - started > args.timeout:
                    break
        total_s = time.monotonic() - started
        sampler.cancel()
        follower.cancel()
        sender.cancel()
        metrics = {name: await scrape(port) for name, port in ports.items()}
        memory = {name: peak_rss_mb(proc.pid) for name, proc in procs.items()}

        messages = [
            (seq, msg.data, stream_time(msg.reply))
            async for seq, msg in ordered_messages(
                log_.nc, log_.js, "HERD", head0 + 1, stop=await log_.last_seq(), follow=False
            )
        ]
        latencies = decision_latencies(messages)
        await client.close()
        await log_.close()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(10)
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    place = sorted(fleet.place_times)
    place_rate = (len(place) - 1) / (place[-1] - place[0]) if len(place) > 1 else float("nan")
    submit_rate = args.jobs / submit_s
    lost = [j for j in accepted if fleet.placed[j] < 1 or fleet.finished[j] != 1]

    table = Table(title=f"load: {args.nodes} sim nodes x {args.gpus} GPUs, {args.jobs:,} jobs through NATS")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("vs baseline", justify="right")
    table.add_column("target", justify="right")
    table.add_row("raw JetStream appends/s (baseline)", f"{base_rate:,.0f}", "1.00x", "")
    table.add_row(
        "submissions/s (verdict received)", f"{submit_rate:,.0f}", f"{submit_rate / base_rate:.2f}x", ">= 2,000"
    )
    table.add_row("placements/s (sustained)", f"{place_rate:,.0f}", f"{place_rate / base_rate:.2f}x", ">= 2,000")
    table.add_row("decision latency p50 (ms)", f"{quantile(latencies, 0.5) * 1e3:.1f}", "", "")
    table.add_row("decision latency p99 (ms)", f"{quantile(latencies, 0.99) * 1e3:.1f}", "", "<= 50")
    hist = metrics["scheduler"]
    own_ms = hist["gpuherd_decision_latency_seconds_sum"] / max(1, hist["gpuherd_decision_latency_seconds_count"]) * 1e3
    table.add_row(
        "scheduler's own wait+decide+append, mean (ms)",
        f"{own_ms:.1f}",
        "",
        "",
    )
    table.add_row(
        "consumer lag, median / max (events)", f"{statistics.median(lags or [0]):.0f} / {max(lags or [0]):.0f}", "", ""
    )
    for name in SERVICES:
        table.add_row(f"peak memory {name} (MB)", f"{memory[name]:.0f}", "", "< 500")
    placed_n = sum(1 for j in accepted if fleet.placed[j])
    finished_n = sum(1 for j in accepted if fleet.finished[j] == 1)
    table.add_row(
        "accepted / placed / finished once",
        f"{len(accepted):,} / {placed_n:,} / {finished_n:,}",
        "",
        "all",
    )
    table.add_row("jobs lost", str(len(lost)), "", "0")
    table.add_row("wall time (s)", f"{total_s:.1f}", "", "")
    console.print(table)
    if lost:
        console.print(f"[red]{len(lost)} accepted jobs were not placed and finished exactly once[/red]: {lost[:5]}")
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--window", type=int, default=512, help="submissions in flight")
    parser.add_argument("--max-duration", type=float, default=1.0, help="longest job (seconds)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=1)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
