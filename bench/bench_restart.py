"""Restart: how soon the scheduler and a node agent are back at work after a long history.

The history is a real one: ``--jobs`` (default 100,000) synthetic jobs run to the end by the
simulator (the production deciders, ``apps.sim``) on ``--nodes`` sim nodes, and its log appended to
an embedded nats-server in order, so every decision keeps its id and ``based_on``. Then, for the
scheduler and for one node agent (``sim`` executor, on a node of that history):

1. **cold**: the process starts with no snapshot and folds the whole log;
2. it saves its snapshot once caught up; it is stopped with SIGTERM (the time to exit is shown);
3. **restart**: the process starts again and reads its snapshot and the log after it.

Times are from process start (``fork``/``exec``, interpreter, imports included) to ``/readyz``
answering 200 (leader or agent, caught up), and for the scheduler also to the verdict on a
submission sent at the moment it starts ("back to deciding"). The cold start is the baseline of
the ratio column. Targets: the scheduler deciding within 3 s of a restart, an agent ready within 2 s.

Usage: python bench/bench_restart.py [--jobs 100000] [--nodes 1000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from apps.cluster.local import Supervised, service_argv, stop_together
from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import SNAPSHOT_BUCKET, EventLog, open_log
from gpuherd.metrics import http_get
from gpuherd.natsd import NatsServer, free_port
from gpuherd.obs import configure
from gpuherd.runtime.snapshots import Snapshot

console = Console(stderr=True)
SCHEDULER_TARGET_S = 3.0
AGENT_TARGET_S = 2.0


def synthetic_jobs(n: int, gpus: int, seed: int, start: float, load: float = 0.75) -> list[ev.JobSubmitted]:
    """``n`` jobs arriving at about ``load`` of the cluster's capacity: 1-8 GPUs, 1 min to 1 h."""
    rng = random.Random(seed)
    sizes = [1] * 50 + [2] * 20 + [4] * 15 + [8] * 15
    mean_gpus, mean_s = sum(sizes) / len(sizes), 1830.0
    rate = load * gpus / (mean_gpus * mean_s)
    at, out = start, []
    for i in range(n):
        at += rng.expovariate(rate)
        spec = ev.JobSpec(
            name=f"h{i}", user=f"u{i % 200}", gpus=rng.choice(sizes), duration_s=rng.uniform(60.0, 3600.0),
            intake_id=f"h{i}",
        )  # fmt: skip
        out.append(ev.JobSubmitted(at=at, job=f"h{i}", spec=spec, intake_source="history"))
    return out


def history(jobs: int, nodes: int, seed: int, load: float = 0.75) -> tuple[list[ev.Event], str]:
    """The log of ``jobs`` jobs (arriving at ``load`` of the capacity) run to the end, ending about
    now; and a node of it."""
    cluster = ClusterSpec(vcs={"default": VcSpec(nodes=nodes)}, can_borrow=True)
    horizon = jobs * 4.0 * 1830.0 / (min(load, 0.75) * cluster.total_gpus)  # ~ the arrivals' span, and a margin
    submissions = synthetic_jobs(jobs, cluster.total_gpus, seed, time.time() - horizon, load)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"simulating the history: {jobs:,} jobs on {nodes:,} nodes", total=jobs)
        result = simulate(
            submissions, cluster, "fifo", start=submissions[0].at, on_submit=lambda n: progress.advance(task, n)
        )
    node = cluster.setup_events()[0].node  # type: ignore[attr-defined]
    return [record.event for record in result.records], node


async def ready_after(port: int, started: float, timeout: float) -> float:
    """Seconds from ``started`` until the process's /readyz answers 200."""
    while time.monotonic() - started < timeout:
        try:
            status, _ = await http_get(port, "/readyz")
            if status == 200:
                return time.monotonic() - started
        except OSError:
            pass
        await asyncio.sleep(0.01)
    raise TimeoutError(f"not ready within {timeout:.0f} s")


async def snapshot_of(log_: EventLog, key: str, at_least: int, timeout: float = 120.0) -> tuple[int, int, int]:
    """Wait for the snapshot under ``key`` to cover ``at_least``: (its seq, stored bytes, state bytes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = await log_.kv_get(SNAPSHOT_BUCKET, key)
        if data is not None:
            snap = msgspec.msgpack.decode(zlib.decompress(data), type=Snapshot)
            if snap.seq >= at_least:
                return snap.seq, len(data), len(snap.state)
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no snapshot {key} at or after {at_least} within {timeout:.0f} s")


class Subject:
    """One process measured: the scheduler or an agent."""

    def __init__(self, name: str, argv: list[str], port: int, data_dir: Path, env: dict[str, str]) -> None:
        self.proc = Supervised(name, [*argv, "--metrics-port", str(port)], data_dir, env)
        self.port = port

    async def start(self, timeout: float) -> float:
        started = time.monotonic()
        self.proc.start()
        return await ready_after(self.port, started, timeout)

    def stop(self) -> float | None:
        return stop_together([self.proc], timeout=30.0)[self.proc.name]


async def scheduler_round(subject: Subject, client: Client, probe: int, timeout: float) -> dict[str, float]:
    """Start the scheduler and submit a job at once: seconds to ready, and to the verdict."""
    started = time.monotonic()
    verdict = asyncio.create_task(
        client.submit({"name": f"probe{probe}", "user": "bench", "gpus": 1, "duration_s": 60.0}, timeout=timeout)
    )
    ready = await subject.start(timeout)
    job = await verdict
    return {"ready_s": ready, "deciding_s": time.monotonic() - started, "job": job}  # type: ignore[dict-item]


async def run(args: argparse.Namespace) -> dict:
    events, node = history(args.jobs, args.nodes, args.seed)
    data_dir = Path(tempfile.mkdtemp(prefix="gpuherd-restart-"))
    server = NatsServer(data_dir / "nats").start()
    env = dict(os.environ, NATS_URL=server.url, PYTHONUNBUFFERED="1", GPUHERD_LOG_LEVEL="WARNING")
    subjects: list[Subject] = []
    try:
        log_ = await open_log(server.url, name="bench-restart")
        with console.status(f"appending the history: {len(events):,} events"):
            appended = time.perf_counter()
            await log_.append_pipelined(events, window=512)
            append_s = time.perf_counter() - appended
        head = await log_.last_seq()
        client = await Client.connect(server.url, source="bench", persistent=True)
        scheduler = Subject(
            "scheduler", service_argv("scheduler", "--nats-url", server.url, "--lost-after", "36000"),
            free_port(), data_dir, env,
        )  # fmt: skip
        agent_dir = data_dir / "agent"
        agent = Subject(
            "agent", service_argv("agent", "--nats-url", server.url, "--node", node, "--data-dir", str(agent_dir)),
            free_port(), data_dir, env,
        )  # fmt: skip
        subjects = [scheduler, agent]
        out: dict = {"jobs": args.jobs, "nodes": args.nodes, "events": len(events), "append_s": append_s}
        for label, n in (("cold", 1), ("restart", 2)):
            with console.status(f"scheduler: {label} start"):
                out[f"scheduler_{label}"] = await scheduler_round(scheduler, client, n, args.timeout)
                seq, stored, state = await snapshot_of(log_, "scheduler", head)
                out["scheduler_snapshot"] = {"seq": seq, "stored_bytes": stored, "state_bytes": state}
                out[f"scheduler_{label}"]["exit_s"] = scheduler.stop()
            with console.status(f"agent: {label} start"):
                out[f"agent_{label}"] = {"ready_s": await agent.start(args.timeout)}
                seq, stored, state = await snapshot_of(log_, f"agent.{node}", head)
                out["agent_snapshot"] = {"seq": seq, "stored_bytes": stored, "state_bytes": state}
                out[f"agent_{label}"]["exit_s"] = agent.stop()
        await client.close()
        await log_.close()
    finally:
        stop_together([s.proc for s in subjects], timeout=5.0)
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    out["scheduler_deciding_s"] = out["scheduler_restart"]["deciding_s"]
    out["agent_ready_s"] = out["agent_restart"]["ready_s"]
    return out


def print_table(r: dict) -> None:
    title = f"restart after {r['jobs']:,} finished jobs ({r['events']:,} events) on {r['nodes']:,} nodes"
    table = Table(title=title)
    for col in ("process", "measure", "cold (no snapshot)", "restart (snapshot)", "x cold", "target"):
        table.add_column(col, justify="right")
    rows = (
        ("scheduler", "ready (s)", "ready_s", ""),
        ("scheduler", "back to deciding: verdict (s)", "deciding_s", f"<= {SCHEDULER_TARGET_S:.0f}"),
        ("scheduler", "exit after SIGTERM (s)", "exit_s", "<= 5"),
        ("agent", "ready (s)", "ready_s", f"<= {AGENT_TARGET_S:.0f}"),
        ("agent", "exit after SIGTERM (s)", "exit_s", "<= 5"),
    )
    for who, label, key, target in rows:
        cold, warm = r[f"{who}_cold"][key], r[f"{who}_restart"][key]
        fmt = lambda v: "killed" if v is None else f"{v:.2f}"  # noqa: E731
        ratio = f"{warm / cold:.2f}" if cold and warm is not None and key != "exit_s" else ""
        table.add_row(who, label, fmt(cold), fmt(warm), ratio, target)
    for who in ("scheduler", "agent"):
        snap = r[f"{who}_snapshot"]
        size = f"{snap['stored_bytes'] / 1e3:,.1f} kB stored ({snap['state_bytes'] / 1e3:,.1f} kB state)"
        table.add_row(who, "snapshot", "", size, "", "")
    Console(width=120).print(table)
    console.print(f"history appended in {r['append_s']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000, help="finished jobs in the history")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures instead")
    args = parser.parse_args()
    configure("bench", level="WARNING", json=False)  # logs to stderr: stdout is the table or the JSON
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
