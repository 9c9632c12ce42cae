"""Load: 1,000 sim nodes x 8 GPUs and 20,000 jobs submitted through NATS.

The real services run as processes (scheduler, elastic, memory broker, analytics) on an embedded
nats-server. This benchmark plays the other two parties:

- **submitters**: 20,000 intake messages (plain NATS, ``--window`` in flight), each awaiting its
  verdict;
- **the fleet**: 1,000 nodes registered as agents would register them; for every ``JobPlaced`` it
  reports what each node's agent would (``JobStarted``, then ``TaskEnded`` after the job's
  duration), so GPUs free up and the queue keeps moving. Each report goes as its agent's would: a
  request to the report relay (``services/relay``, started with the services), appended by the
  node itself when no relay answers; ``--no-relay`` appends every report directly, as agents
  without a relay do. (1,000 agent processes do not fit on one machine; at the log they are
  indistinguishable from this.)

It prints submissions/s (verdicts received), placements/s (sustained, first to last), decision
latency p50/p99 (a scheduler decision stored minus its cause stored, from the log's own
timestamps), verdict latency (submit to verdict, at the submitter), the scheduler's consumer lag,
each service's peak memory and its time to exit after SIGTERM, the CPU every process spent per job
(steadier than the rates on a shared machine), and checks that no job was lost:
every accepted job submitted once, placed, and finished exactly once. The baseline, measured in
the same run, is raw JetStream appends of the same number of events (pipelined).
``--intake-storage memory`` keeps the submissions waiting for their verdict in memory
(``GPUHERD_INTAKE_STORAGE``: an operator's choice; the log itself still fsyncs every write).

Targets (2 cores, the log fsyncing every acknowledged write): at the default window >= 2,000
submissions/s and placements/s with decision p99 <= 250 ms; at ``--window 8`` (a few users) decision
p50 <= 10 ms and p99 <= 50 ms; every service < 500 MB, 0 lost, and every process gone within 1 s of
SIGTERM.

``--trace-decisions N`` breaks N submissions (spread over the run) into the stages of their path,
from the submitter's publish to the launch, with p50/p99 of each (``gpuherd.runtime.stages``
records the scheduler's side): where a decision's time goes.

Usage: python bench/bench_load.py [--nodes 1000] [--jobs 20000] [--window 512] [--no-relay] [--trace-decisions N]
       [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import msgspec
import nats
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from apps import registry
from apps.cluster.local import Supervised, service_argv, stop_together
from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import Record, open_log
from gpuherd.log.relay import RelayClient
from gpuherd.metrics import http_get, parse_metrics
from gpuherd.natsd import NatsServer, free_port
from gpuherd.obs import configure
from gpuherd.runtime.runner import append_reliably
from gpuherd.runtime.stages import TRACE_DIR_ENV, TRACE_MAX_ENV, BatchTrace, read_traces

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parents[1]
SERVICES = registry.required()  # every decider a deployment runs
CLEAN_EXIT_S = 1.0  # every process must be gone this long after SIGTERM
TARGET_RATE = 2_000  # submissions/s and placements/s at the default window
FEW_USERS_WINDOW = 8  # up to this many submissions in flight, decisions are judged by their latency alone


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


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class Fleet:
    """Plays every node's agent at the log: start what is placed, end it after its duration."""

    def __init__(self, log_, durations: dict[str, float], *, relay: bool) -> None:
        self.log = log_
        self.durations = durations
        self.relays: dict[str, RelayClient] | None = {} if relay else None  # node -> its agent's relay client
        self._reporting: set[asyncio.Task] = set()
        self.placed: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.place_times: list[float] = []
        self.seen_at: dict[str, float] = {}  # job -> when the fleet saw its first JobPlaced (wall)
        self.outbox: asyncio.Queue[ev.Event] = asyncio.Queue()

    async def follow(self, start: int) -> None:
        async for record in self.log.read(start, follow=True):
            e = record.event
            if isinstance(e, ev.JobPlaced):
                self.placed[e.job] += 1
                self.place_times.append(time.monotonic())
                self.seen_at.setdefault(e.job, time.time())
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
            if self.relays is None:
                await self.log.append_pipelined(batch)
                continue
            for report in batch:  # (each node's agent asks on its own, concurrently with the others)
                task = asyncio.create_task(self._report(report))
                self._reporting.add(task)
                task.add_done_callback(self._reporting.discard)

    async def _report(self, report: ev.JobStarted | ev.TaskEnded) -> None:
        assert self.relays is not None
        client = self.relays.get(report.node)
        if client is None:
            client = self.relays[report.node] = RelayClient(self.log.nc, report.node)
        if not await client.store(report):
            await append_reliably(self.log, [report])

    def relayed(self) -> tuple[int, int]:
        """Reports a relay stored, and reports the nodes appended themselves."""
        clients = list((self.relays or {}).values())
        return sum(c.stored for c in clients), sum(c.fell_back for c in clients)


async def scrape(port: int) -> dict[str, float]:
    return parse_metrics((await http_get(port, "/metrics"))[1])


async def baseline(url: str, n: int) -> float:
    """Raw JetStream appends of ``n`` events (pipelined, 512 in flight, as ``append_pipelined``):
    the log's own speed on this machine. They go to a stream of their own, where no service reads."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="BENCH_BASELINE", subjects=["bench.baseline.>"])
        events = [ev.JobCancelRequested(id=f"bench:base:{i}", at=0.0, source="bench", job=f"base{i}") for i in range(n)]
        window = asyncio.Semaphore(512)

        async def append(event: ev.Event) -> None:
            async with window:
                await js.publish(f"bench.baseline.{event.job}", ev.encode(event), headers={"Nats-Msg-Id": event.id})

        started = time.perf_counter()
        await asyncio.gather(*(append(e) for e in events))
        return n / (time.perf_counter() - started)
    finally:
        await nc.close()


def decision_latencies(records: list[Record]) -> dict[str, list[float]]:
    """Per scheduler decision: its stored time minus its cause's stored time (seconds), by
    ``<decision> <- <cause>`` (the event types)."""
    stored: dict[str, tuple[str, float]] = {}
    out: dict[str, list[float]] = defaultdict(list)
    for record in records:
        event, at = record.event, record.stored_at or 0.0
        stored[event.id] = (type(event).__name__, at)
        if event.source == "scheduler" and isinstance(event, ev.Decision) and event.cause in stored:
            cause, cause_at = stored[event.cause]
            out[f"{type(event).__name__} <- {cause}"].append(at - cause_at)
    return out


# The path of one submission, stage by stage: (label, from, to), each a point named below.
STAGES = (
    ("submitter publish -> intake stored", "submit", "intake_stored"),
    ("intake stored -> scheduler fetched it", "intake_stored", "fetched"),
    ("fetched -> verdict pass starts", "fetched", "verdict_start"),
    ("verdict pass (judge)", "verdict_start", "verdict_decided"),
    ("verdict decided -> append acked", "verdict_decided", "verdict_acked"),
    ("verdict acked -> submitter has it", "verdict_acked", "reply"),
    ("verdict acked -> scheduler folded it back", "verdict_acked", "verdict_folded"),
    ("folded back -> placement pass starts", "verdict_folded", "place_start"),
    ("placement pass (decide)", "place_start", "place_decided"),
    ("placement decided -> append acked", "place_decided", "place_acked"),
    ("placement stored -> agent sees it", "place_stored", "agent_seen"),
    ("agent sees it -> launch stored", "agent_seen", "launch_stored"),
    ("= verdict at submitter (end to end)", "submit", "reply"),
    ("= decision latency (submitted -> placed, stored)", "verdict_stored", "place_stored"),
    ("= submit -> launch (end to end)", "submit", "launch_stored"),
)


def stage_points(
    traces: list[BatchTrace],
    records: list[Record],
    sent: dict[str, tuple[float, float]],
    seen: dict[str, float],
) -> list[dict[str, float]]:
    """Per submitted and placed job: the wall time of each point of its path (see STAGES; a pass that
    placed it may be another event's, coalesced, and includes any wait for GPUs). ``sent``: job ->
    (published, verdict received) at the submitter."""
    stored: dict[str, tuple[type, float]] = {}  # event id -> (type, stored at)
    launched: dict[str, float] = {}
    for record in records:
        event, at = record.event, record.stored_at or 0.0
        stored[event.id] = (type(event), at)
        if isinstance(event, ev.JobStarted):
            launched.setdefault(event.job, at)
    verdicts: dict[str, tuple[BatchTrace, int, str]] = {}  # job -> (batch, its index there, JobSubmitted id)
    placements: dict[str, tuple[BatchTrace, str]] = {}  # job -> (batch, JobPlaced id)
    for trace in traces:
        for index, outputs in enumerate(trace.outputs):
            for out_id, job in outputs:
                kind = stored.get(out_id, (None, 0.0))[0]
                if job is None:
                    continue
                if kind is ev.JobSubmitted:
                    verdicts.setdefault(job, (trace, index, out_id))
                elif kind is ev.JobPlaced:
                    placements.setdefault(job, (trace, out_id))
    points = []
    for job, (submit, reply) in sent.items():
        if job not in verdicts or job not in launched or job not in seen:
            continue
        verdict, index, submitted = verdicts[job]
        if job not in placements:
            continue
        place, placed = placements[job]
        points.append({
            "submit": submit, "reply": reply,
            "intake_stored": verdict.stored[index] or float("nan"), "fetched": verdict.arrived[index],
            "verdict_start": verdict.start, "verdict_decided": verdict.decided, "verdict_acked": verdict.acked,
            "verdict_stored": stored[submitted][1], "verdict_folded": verdict.folded,
            "place_start": place.start, "place_decided": place.decided, "place_acked": place.acked,
            "place_stored": stored[placed][1], "agent_seen": seen[job], "launch_stored": launched[job],
        })  # fmt: skip
    return points


def stage_table(points: list[dict[str, float]], n: int) -> list[dict]:
    """p50/p99 (ms) of each stage over ``n`` of ``points`` spread evenly over the run."""
    points = sorted(points, key=lambda p: p["submit"])
    if n and len(points) > n:
        points = [points[i * len(points) // n] for i in range(n)]
    rows = []
    for label, start, end in STAGES:
        spans = [(p[end] - p[start]) * 1e3 for p in points if p[end] > 0 and p[start] > 0]
        rows.append({"stage": label, "p50_ms": quantile(spans, 0.5), "p99_ms": quantile(spans, 0.99), "n": len(spans)})
    return rows


# A decision's time from its cause stored in the log to its own append acknowledged, stage by stage.
CAUSE_STAGES = (
    ("cause stored -> the scheduler has it", "stored", "arrived"),
    ("has it -> its decision starts", "arrived", "start"),
    ("decision", "start", "decided"),
    ("decided -> append acked", "decided", "acked"),
)


def cause_stage_table(traces: list[BatchTrace], records: list[Record]) -> list[dict]:
    """Per type of cause in the log (submissions come from intake and are traced above): p50/p99 (ms)
    of each of ``CAUSE_STAGES`` over every traced cause of that type that the scheduler decided."""
    kind_of = {r.event.id: type(r.event).__name__ for r in records}
    spans: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for trace in traces:
        for index, cause in enumerate(trace.causes):
            stored = trace.stored[index]
            if stored is None or not trace.outputs[index] or cause not in kind_of:
                continue
            times = {"stored": stored, "arrived": trace.arrived[index], "start": trace.start}
            times |= {"decided": trace.decided, "acked": trace.acked}
            for label, start, end in CAUSE_STAGES:
                spans[kind_of[cause]][label].append((times[end] - times[start]) * 1e3)
    rows = []
    for kind, by_stage in sorted(spans.items(), key=lambda item: -len(next(iter(item[1].values())))):
        for label, _, _ in CAUSE_STAGES:
            values = by_stage[label]
            rows.append({"cause": kind, "stage": label, "n": len(values)})
            rows[-1] |= {"p50_ms": quantile(values, 0.5), "p99_ms": quantile(values, 0.99)}
    return rows


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run(args: argparse.Namespace) -> dict:
    """The whole load; every process it starts is stopped before it returns, also when it fails."""
    rng = random.Random(args.seed)
    data_dir = Path(tempfile.mkdtemp(prefix="gpuherd-load-"))
    server = NatsServer(data_dir / "nats").start()
    services = [*SERVICES, "relay"] if args.relay else list(SERVICES)
    ports = {name: free_port() for name in services}
    env = dict(os.environ, NATS_URL=server.url, PYTHONUNBUFFERED="1", GPUHERD_LOG_LEVEL="WARNING")
    env["GPUHERD_INTAKE_STORAGE"] = args.intake_storage
    stage_dir = data_dir / "stages"
    if args.trace_decisions:
        env |= {TRACE_DIR_ENV: str(stage_dir), TRACE_MAX_ENV: str(10**9)}
    procs: dict[str, Supervised] = {}
    exit_s: dict[str, float | None] = {}
    try:
        base_rate = await baseline(server.url, args.jobs)
        log_ = await open_log(server.url, name="bench-load", intake_storage=args.intake_storage)
        head0 = await log_.last_seq()
        messages0 = int((await log_.js.stream_info("HERD")).state.last_seq)
        with console.status(f"registering {args.nodes} nodes x {args.gpus} GPUs"):
            await log_.append_pipelined([registration(i, args.gpus) for i in range(args.nodes)], window=512)
        for name in services:
            argv = service_argv(name, "--nats-url", server.url, "--metrics-port", str(ports[name]))
            if args.max_in_flight is not None and name != "relay":
                argv += ["--max-in-flight", str(args.max_in_flight)]
            if name == "scheduler":
                argv += ["--lost-after", "36000"]  # the fleet sends no heartbeats
            procs[name] = Supervised(name, argv, data_dir, env)
            procs[name].start()
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
        fleet = Fleet(log_, durations, relay=args.relay)
        follower = asyncio.create_task(fleet.follow(head0 + 1))
        sender = asyncio.create_task(fleet.send())

        lags: list[float] = []

        async def sample_lag() -> None:
            while True:
                await asyncio.sleep(1.0)
                try:
                    metrics = await scrape(ports["scheduler"])
                    lags.append(log_.behind(int(metrics["gpuherd_folded_sequence"]), await log_.last_seq()))
                except Exception:
                    pass

        sampler = asyncio.create_task(sample_lag())
        accepted: list[str] = []
        verdict_s: list[float] = []
        sent: dict[str, tuple[float, float]] = {}  # job -> (published, verdict received), wall clock
        semaphore = asyncio.Semaphore(args.window)

        async def submit(spec: dict) -> None:
            async with semaphore:
                published, wall = time.perf_counter(), time.time()
                verdict = await client.submit_raw(msgspec.json.encode(spec), timeout=600)
                verdict_s.append(time.perf_counter() - published)
            if verdict.ok and verdict.job_id:
                sent[verdict.job_id] = (wall, time.time())
                accepted.append(verdict.job_id)
                durations[verdict.job_id] = spec["duration_s"]

        cpu0 = {name: cpu_s(proc.proc.pid) for name, proc in procs.items() if proc.proc is not None}
        cpu0 |= {"nats-server": cpu_s(server.proc.pid), "bench": cpu_s(os.getpid())}  # type: ignore[union-attr]
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
        for background in (sampler, follower, sender):
            background.cancel()
        metrics = {name: await scrape(port) for name, port in ports.items()}
        memory = {name: peak_rss_mb(proc.proc.pid) for name, proc in procs.items() if proc.proc is not None}
        cpu = {name: cpu_s(proc.proc.pid) - cpu0[name] for name, proc in procs.items() if proc.proc is not None}
        cpu["nats-server"] = cpu_s(server.proc.pid) - cpu0["nats-server"]  # type: ignore[union-attr]
        cpu["bench (submitters, fleet)"] = cpu_s(os.getpid()) - cpu0["bench"]

        records = await log_.read_all(head0 + 1)
        log_messages = int((await log_.js.stream_info("HERD")).state.last_seq) - messages0
        by_kind = decision_latencies(records)
        latencies = [latency for kind in by_kind.values() for latency in kind]
        log_events = len(records)
        stages: list[dict] = []
        cause_stages: list[dict] = []
        if args.trace_decisions:
            traces = read_traces(stage_dir / "scheduler.jsonl")
            stages = stage_table(stage_points(traces, records, sent, fleet.seen_at), args.trace_decisions)
            cause_stages = cause_stage_table(traces, records)
        await client.close()
        await log_.close()
        # Under load to the end: the services have just folded the last events.
        exit_s = stop_together(list(procs.values()), timeout=30.0)
    finally:
        stop_together(list(procs.values()), timeout=5.0)  # (after a failure: whatever still runs)
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)

    place = sorted(fleet.place_times)
    place_rate = (len(place) - 1) / (place[-1] - place[0]) if len(place) > 1 else float("nan")
    submit_rate = args.jobs / submit_s
    lost = [j for j in accepted if fleet.placed[j] < 1 or fleet.finished[j] != 1]
    hist = metrics["scheduler"]
    own_ms = hist["gpuherd_decision_latency_seconds_sum"] / max(1, hist["gpuherd_decision_latency_seconds_count"]) * 1e3
    clean = all(s is not None and s <= CLEAN_EXIT_S for s in exit_s.values()) and len(exit_s) == len(services)
    relayed, appended_by_nodes = fleet.relayed()
    relay_metrics = metrics.get("relay", {})
    commits = relay_metrics.get("gpuherd_relay_batch_reports_count", 0.0)
    return {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "jobs": args.jobs,
        "window": args.window,
        "relay": args.relay,
        "intake_storage": args.intake_storage,
        "reports_relayed": relayed,  # stored by the relay
        "reports_appended_by_nodes": appended_by_nodes,  # (no relay answered: the node appended it)
        "relay_commits": commits,  # the relay's appends (each one commit, one fsync)
        "relay_reports_per_commit": relay_metrics.get("gpuherd_relay_batch_reports_sum", 0.0) / max(commits, 1),
        "baseline_appends_per_s": base_rate,
        "submissions_per_s": submit_rate,
        "placements_per_s": place_rate,
        "decision_p50_ms": quantile(latencies, 0.5) * 1e3,
        "decision_p99_ms": quantile(latencies, 0.99) * 1e3,
        "decisions_by_kind": {
            kind: {"n": len(values), "p50_ms": quantile(values, 0.5) * 1e3, "p99_ms": quantile(values, 0.99) * 1e3}
            for kind, values in sorted(by_kind.items(), key=lambda item: -len(item[1]))
        },
        "verdict_p50_ms": quantile(verdict_s, 0.5) * 1e3,
        "verdict_p99_ms": quantile(verdict_s, 0.99) * 1e3,
        "scheduler_own_mean_ms": own_ms,
        "log_events": log_events,  # every event the run appended (services, fleet), on the durable log
        "log_events_per_s": log_events / total_s,
        "log_messages": log_messages,  # stored messages holding them (a decider's batch is one page)
        "log_messages_per_s": log_messages / total_s,
        "lag_median": statistics.median(lags or [0]),
        "lag_max": max(lags or [0]),
        "peak_rss_mb": memory,
        "cpu_s": cpu,
        # Every process's CPU per job: steadier than the rates on a shared machine, and what bounds
        # them where the run is CPU-bound (n cores reach 2,000 jobs/s only at <= n/2 ms per job).
        "cpu_ms_per_job": 1e3 * sum(cpu.values()) / max(len(accepted), 1),
        "exit_s": exit_s,
        "clean_shutdown": clean,
        "accepted": len(accepted),
        "placed": sum(1 for j in accepted if fleet.placed[j]),
        "finished_once": sum(1 for j in accepted if fleet.finished[j] == 1),
        "lost": len(lost),
        "lost_jobs": lost[:5],
        "wall_s": total_s,
        "stages": stages,
        "cause_stages": cause_stages,
    }


def print_table(r: dict) -> None:
    how = f"reports {'through the relay' if r['relay'] else 'appended by each node'}, intake in {r['intake_storage']}"
    table = Table(
        title=f"load: {r['nodes']:,} sim nodes x {r['gpus_per_node']} GPUs, {r['jobs']:,} jobs through NATS ({how})"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("vs baseline", justify="right")
    table.add_column("target", justify="right")
    base = r["baseline_appends_per_s"]
    table.add_row("raw JetStream appends/s (baseline)", f"{base:,.0f}", "1.00x", "")
    rates = (
        ("submissions_per_s", "submissions/s (verdict received)"),
        ("placements_per_s", "placements/s (sustained)"),
    )
    few_users = r["window"] <= FEW_USERS_WINDOW
    for key, label in rates:
        table.add_row(label, f"{r[key]:,.0f}", f"{r[key] / base:.2f}x", "" if few_users else f">= {TARGET_RATE:,}")
    decisions = f"{r['decision_p50_ms']:.1f} / {r['decision_p99_ms']:.1f}"
    table.add_row("decision latency p50 / p99 (ms)", decisions, "", "<= 10 / <= 50" if few_users else "p99 <= 250")
    table.add_row("verdict latency p50 / p99 (ms)", f"{r['verdict_p50_ms']:.1f} / {r['verdict_p99_ms']:.1f}", "", "")
    per_job = r["log_events"] / max(r["jobs"], 1)
    table.add_row("log events appended, per job", f"{r['log_events']:,} ({per_job:.1f})", "", "")
    table.add_row(
        "log events/s (all writers)", f"{r['log_events_per_s']:,.0f}", f"{r['log_events_per_s'] / base:.2f}x", ""
    )
    table.add_row(
        "log messages stored/s (events per message)",
        f"{r['log_messages_per_s']:,.0f} ({r['log_events'] / max(r['log_messages'], 1):.1f})",
        f"{r['log_messages_per_s'] / base:.2f}x",
        "",
    )
    if r["relay"]:
        table.add_row(
            "agents' reports: relayed / appended by their node",
            f"{r['reports_relayed']:,} / {r['reports_appended_by_nodes']:,}",
            "",
            "",
        )
        per_commit = f"{r['relay_commits']:,.0f} ({r['relay_reports_per_commit']:.1f})"
        table.add_row("relay: commits (reports per commit)", per_commit, "", "")
    table.add_row("scheduler's own wait+decide+append, mean (ms)", f"{r['scheduler_own_mean_ms']:.1f}", "", "")
    table.add_row("consumer lag, median / max (stored messages)", f"{r['lag_median']:.0f} / {r['lag_max']:.0f}", "", "")
    for name, mb in r["peak_rss_mb"].items():
        table.add_row(f"peak memory {name} (MB)", f"{mb:.0f}", "", "< 500")
    cores = os.cpu_count() or 1
    used = sum(r["cpu_s"].values())
    for name, seconds in r["cpu_s"].items():
        table.add_row(f"CPU {name} (s)", f"{seconds:.1f}", "", "")
    table.add_row(f"CPU all / available on {cores} cores (s)", f"{used:.1f} / {cores * r['wall_s']:.1f}", "", "")
    budget = f"<= {1e3 * cores / TARGET_RATE:.2f} for {TARGET_RATE:,}/s"
    table.add_row("CPU per job, all processes (ms)", f"{r['cpu_ms_per_job']:.2f}", "", budget)
    for name, seconds in r["exit_s"].items():
        shown = "killed" if seconds is None else f"{seconds:.2f}"
        table.add_row(f"{name}: exit after SIGTERM (s)", shown, "", f"<= {CLEAN_EXIT_S:g}")
    counts = f"{r['accepted']:,} / {r['placed']:,} / {r['finished_once']:,}"
    table.add_row("accepted / placed / finished once", counts, "", "all")
    table.add_row("jobs lost", str(r["lost"]), "", "0")
    table.add_row("wall time (s)", f"{r['wall_s']:.1f}", "", "")
    Console(width=120).print(table)
    kinds = Table(title="decision latency by decision <- cause (ms)")
    for column in ("decision <- cause", "decisions", "p50", "p99"):
        kinds.add_column(column, justify="left" if column == "decision <- cause" else "right")
    for kind, row in r["decisions_by_kind"].items():
        kinds.add_row(kind, f"{row['n']:,}", f"{row['p50_ms']:.1f}", f"{row['p99_ms']:.1f}")
    Console(width=120).print(kinds)
    if r["stages"]:
        stages = Table(title=f"where a submission's time goes ({r['stages'][0]['n']:,} traced, ms)")
        for column in ("stage", "p50", "p99"):
            stages.add_column(column, justify="left" if column == "stage" else "right")
        for row in r["stages"]:
            stages.add_row(row["stage"], f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}")
        Console(width=120).print(stages)
    if r["cause_stages"]:
        causes = Table(title="where a decision's time goes, by its cause in the log (ms)")
        for column in ("cause", "stage", "decided", "p50", "p99"):
            causes.add_column(column, justify="left" if column in ("cause", "stage") else "right")
        for row in r["cause_stages"]:
            causes.add_row(row["cause"], row["stage"], f"{row['n']:,}", f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}")
        Console(width=120).print(causes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--window", type=int, default=512, help="submissions in flight")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="each service's --max-in-flight (1: every batch folded back before the next is decided)",
    )
    parser.add_argument(
        "--relay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fleet's reports go through a report relay, as agents' do (--no-relay: each appended directly)",
    )
    parser.add_argument(
        "--intake-storage",
        choices=["file", "memory"],
        default="file",
        help="where submissions wait for their verdict (GPUHERD_INTAKE_STORAGE; the log itself always fsyncs)",
    )
    parser.add_argument("--max-duration", type=float, default=1.0, help="longest job (seconds)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trace-decisions", type=int, default=0, metavar="N", help="break N submissions into stages")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures instead")
    args = parser.parse_args()
    configure("bench", level="WARNING", json=False)  # logs to stderr: stdout is the table or the JSON
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    if result["lost"]:
        lost = f"{result['lost']} accepted jobs were not placed and finished exactly once"
        console.print(f"[red]{lost}[/red]: {result['lost_jobs']}")
        sys.exit(1)


if __name__ == "__main__":
    main()
