"""The ``make run`` demo: a slice of the real Philly trace, replayed fast against a live cluster.

Jobs come from ``philly.csv`` in arrival order. Time is compressed so the
arrivals span ``--demo-seconds``; each duration is compressed by the same
factor and capped (a two-week job would otherwise keep the demo running), and
the cap is printed. Jobs asking for more GPUs than the demo cluster has are
submitted anyway: intake rejects them with a reason, which the summary shows.

With cpu agents up, real training jobs go first. An elastic ``train_cnn.py``
shows both ways a job is resized while it trains: the demo holds the elastic
service's growth (``grow_after_start_s``) until the job has trained its first
steps, then lets it grow into the idle cpu GPUs; then a job that needs its GPUs
arrives and the service shrinks it. Then a 2-node DDP run of
``examples/train_cnn.py`` and a single-process ``examples/train_mlp.py`` start
next to the trace. They really train, on CPU; the summary shows their final loss
and every rescale with its pause and total, and says in one line how long the
grow and the shrink stood training still (what ``bench/bench_elastic.py`` measures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from apps.cli.rescales import rescale_rows, rescale_table
from apps.registry import make_decider
from gpuherd import events as ev
from gpuherd.client import Client, load_spec_file
from gpuherd.errors import GpuherdError, SubmissionError
from gpuherd.fold import TERMINAL, ClusterState, apply
from gpuherd.log import open_log
from gpuherd.runtime.audit import audit

console = Console()
TRACE_OFFSET = 40_000  # a busy stretch of the trace, fixed so every demo run is the same workload


def find_trace(explicit: str | None) -> Path:
    """The demo's trace: the path given (which must be there: another trace in its place would be
    used unsaid), else philly.csv in ``shared/traces`` beside or above this folder."""
    if explicit:
        path = Path(explicit)
        if path.is_dir():
            raise GpuherdError(f"--trace {explicit}: is a folder, not a file: give the path of philly.csv")
        try:
            with path.open("rb"):
                pass
        except FileNotFoundError:
            where = "" if path.is_absolute() else f" (looked in {Path.cwd()})"
            raise GpuherdError(
                f"--trace {explicit}: no such file{where}: give the path of philly.csv (../shared/traces/philly/)"
            ) from None
        except OSError as exc:
            raise GpuherdError(f"--trace {explicit}: cannot read it: {exc.strerror or exc}") from None
        return path
    here = Path.cwd()
    candidates: list[Path] = []
    candidates += [p / "shared" / "traces" / "philly" / "philly.csv" for p in (here.parent, here, *here.parents)]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise GpuherdError("philly.csv not found: pass --trace PATH (it lives in ../shared/traces/philly/)")


def demo_workload(path: Path, jobs: int, span_s: float) -> tuple[list[tuple[float, dict[str, Any]]], float, float]:
    """(arrival offset s, spec) pairs, the time compression factor, and the duration cap."""
    import pandas as pd

    frame = pd.read_csv(path)
    frame["timestamp"] = pd.to_datetime(frame["timestamp"], errors="coerce")
    frame = frame.dropna(subset=["timestamp"]).sort_values("timestamp", kind="stable")
    window = frame.iloc[TRACE_OFFSET : TRACE_OFFSET + jobs]
    start = window["timestamp"].iloc[0]
    offsets = (window["timestamp"] - start).dt.total_seconds()
    factor = max(float(offsets.iloc[-1]) / span_s, 1.0)
    cap = span_s / 3
    out = []
    for i, (offset, row) in enumerate(zip(offsets, window.itertuples(index=False), strict=True)):
        spec = {
            "name": f"philly-{TRACE_OFFSET + i}",
            "user": f"vc-{row.cluster}",
            "gpus": int(row.num_gpus),
            "duration_s": round(min(max(float(row.duration) / float(factor), 0.2), float(cap)), 3),
            "intake_id": f"demo-{TRACE_OFFSET + i}",
        }
        out.append((float(offset) / factor, spec))
    return out, factor, cap


REAL_JOBS = ("examples/train_cnn_ddp.json", "examples/train_mlp.json", "examples/train_cnn_elastic.json")
REAL_JOBS_ALLOWANCE_S = 240.0
# The elastic service's parameters for the demo's short run: a shrink may follow a grow within
# seconds; growth is held (a job younger than an hour is not grown) until the elastic job trains.
ELASTIC_HOLD = {"grow_after_start_s": 3600.0, "min_interval_s": 3.0, "hold_after_shrink_s": 600.0}
ELASTIC_LET_GROW = ELASTIC_HOLD | {"grow_after_start_s": 0.0}
ELASTIC_TRAINED_STEPS = 25  # (its second progress report)
ELASTIC_ACT_TIMEOUT_S = 120.0


def real_jobs() -> list[dict[str, Any]]:
    """The example training jobs, run from the current folder (where their scripts are)."""
    specs = []
    for path in REAL_JOBS:
        spec = dict(load_spec_file(path))
        spec.update(workdir=str(Path.cwd()), intake_id=f"demo-{Path(path).stem}")
        specs.append(spec)
    return specs


def real_jobs_table(state: ClusterState, job_ids: list[str]) -> Table:
    table = Table(title="real training jobs (cpu agents)")
    for col in ("job", "name", "ranks on", "locality", "status", "steps", "final loss", "run s"):
        table.add_column(col)
    for job_id in job_ids:
        job = state.jobs.get(job_id)
        if job is None:
            continue
        metrics = job.final_metrics or {}
        ran = (job.finished_at or state.now) - (job.started_at or job.finished_at or state.now)
        table.add_row(
            job_id,
            job.spec.name,
            ",".join(job.last_nodes),
            job.locality or "",
            job.status,
            f"{metrics['step']:.0f}" if "step" in metrics else "",
            f"{metrics['loss']:.4f}" if "loss" in metrics else "",
            f"{ran:.1f}",
        )
    return table


def needs_the_gpus(state: ClusterState, elastic_job: str) -> dict[str, Any]:
    """A job (not elastic) that fits the cpu agents only if the elastic job gives GPUs back."""
    cpu_gpus = sum(len(n.gpus) for n in state.nodes.values() if n.runs_processes() and n.status == "up")
    held = len(state.jobs[elastic_job].workers)
    return {
        "name": "needs-the-gpus",
        "user": "demo",
        "gpus": cpu_gpus - held + 1,
        "command": ["python", "-c", "import time; time.sleep(2)"],
        "intake_id": "demo-needs-the-gpus",
    }


async def elastic_act(
    client: Client,
    log_: Any,
    state: ClusterState,
    rescales: list[ev.RescaleCompleted],
    elastic_job: str,
    supervise: Callable[[], None],
    stopping: Callable[[], bool],
) -> str | None:
    """The elastic job trains (growth held), grows into idle GPUs once let, then a job that needs
    them arrives and it shrinks; each rescale once the cpu agents' warm pools are full again (as
    ``bench/bench_elastic.py`` measures them: no worker importing torch beside them). Returns that
    job's id (None if the grow did not come in time: the demo goes on, and says so)."""
    trained = 0
    warm: dict[str, int] = {}  # cpu node -> warm workers waiting, from its latest heartbeat
    cpu_nodes = {n.node for n in state.nodes.values() if n.runs_processes()}

    async def follow_progress() -> None:  # its progress reports, as the agent relays them
        nonlocal trained
        async for delivery in log_.telemetry(f"*.job.{elastic_job}", since_s=600):
            with contextlib.suppress(ValueError, KeyError, TypeError, msgspec.DecodeError):
                trained = max(trained, int(msgspec.json.decode(delivery.data)["step"]))

    async def follow_heartbeats() -> None:
        async for delivery in log_.telemetry("*.heartbeat"):
            with contextlib.suppress(ValueError, KeyError, TypeError, msgspec.DecodeError):
                beat = msgspec.json.decode(delivery.data)
                warm[beat["node"]] = int(beat.get("warm_workers", 0))

    def pools_full() -> bool:
        return all(warm.get(node, 0) >= 1 for node in cpu_nodes)

    async def until(done: Callable[[], bool], what: str) -> bool:
        deadline = time.monotonic() + ELASTIC_ACT_TIMEOUT_S
        while not done():
            supervise()
            if stopping() or time.monotonic() > deadline:
                console.print(f"[yellow]the elastic job did not {what} within {ELASTIC_ACT_TIMEOUT_S:.0f}s[/yellow]")
                return False
            await asyncio.sleep(0.1)
        return True

    def rescaled(grow: bool) -> bool:
        return any(r.job == elastic_job and (r.world > r.world_before) == grow for r in rescales)

    followers = [asyncio.create_task(follow_progress()), asyncio.create_task(follow_heartbeats())]
    try:
        with console.status("the elastic job trains at its first size"):
            await until(lambda: trained >= ELASTIC_TRAINED_STEPS, f"train {ELASTIC_TRAINED_STEPS} steps")
            await until(pools_full, "see the warm pools full")
        await client.configure_elastic(ELASTIC_LET_GROW)
        with console.status("the elastic service grows it into the idle GPUs"):
            if not await until(lambda: rescaled(grow=True), "grow"):
                return None
            # The pools and the job's own standby refill after the grow; they are warm again (no
            # torch import beside the job) by the time the job reported twice more.
            warm.clear()
            grown_at = trained
            await until(pools_full, "see the warm pools full again")
            await until(lambda: trained >= grown_at + 2 * ELASTIC_TRAINED_STEPS, "train at its new size")
        rigid = await client.submit(needs_the_gpus(state, elastic_job), timeout=30)
        with console.status(f"{rigid} needs the elastic job's GPUs: it shrinks"):
            await until(lambda: rescaled(grow=False), "shrink")
            await until(lambda: state.jobs[rigid].status in TERMINAL, "see the job it shrank for end")
        return rigid
    finally:
        for follower in followers:
            follower.cancel()


def elastic_line(rescales: list[ev.RescaleCompleted], elastic_job: str) -> str | None:
    """One line: how long the elastic job's first grow and first shrink stood training still."""
    parts = []
    for grow, verb in ((True, "grew"), (False, "shrank")):
        done = next((r for r in rescales if r.job == elastic_job and (r.world > r.world_before) == grow), None)
        if done is not None:
            d = done.durations()
            parts.append(
                f"{verb} {done.world_before} -> {done.world} with training still for {d['pause_s']:.2f}s "
                f"({d['total_s']:.2f}s decision -> first step)"
            )
    if not parts:
        return None
    return (
        f"elastic job {elastic_job} {' and '.join(parts)}: the pause (quiesce -> first step at the new size) "
        "and decision -> first step that bench/bench_elastic.py measures"
    )


def summarize(state: ClusterState, rejected: int) -> dict[str, Any]:
    jobs = list(state.jobs.values())
    placed = [j for j in jobs if j.first_placed_at is not None]
    waits = sorted(j.first_placed_at - j.submitted_at for j in placed)  # type: ignore[operator]
    done = [j for j in jobs if j.status == "completed" and j.finished_at is not None]
    jcts = [j.finished_at - j.submitted_at for j in done]  # type: ignore[operator]
    busy = sum(j.gpus * (j.finished_at - j.placed_at) for j in done if j.placed_at is not None)  # type: ignore[operator]
    t0 = min((j.submitted_at for j in jobs), default=0.0)
    t1 = max((j.finished_at or 0.0 for j in jobs), default=0.0)
    capacity = state.capacity_gpus()
    return {
        "accepted": len(jobs),
        "rejected": rejected,
        "completed": len(done),
        "by_status": dict(Counter(j.status for j in jobs)),
        "mean_queue_s": statistics.fmean(waits) if waits else 0.0,
        "median_queue_s": statistics.median(waits) if waits else 0.0,
        "p95_queue_s": waits[int(0.95 * (len(waits) - 1))] if waits else 0.0,
        "mean_jct_s": statistics.fmean(jcts) if jcts else 0.0,
        "utilization": busy / (capacity * (t1 - t0)) if capacity and t1 > t0 else 0.0,
        "makespan_s": t1 - t0,
    }


async def run_demo(
    url: str, args: argparse.Namespace, supervise: Callable[[], None], stopping: Callable[[], bool]
) -> int:
    workload, factor, cap = demo_workload(find_trace(args.trace), args.demo_jobs, args.demo_seconds)
    console.print(
        f"demo: {len(workload)} Philly jobs (from row {TRACE_OFFSET}), time compressed {factor:.0f}x, "
        f"durations capped at {cap:.0f}s"
    )
    log_ = await open_log(url, name="gpuherd-demo")
    client = await Client.connect(url, source="demo")
    state = ClusterState()
    rejections: Counter[str] = Counter()
    rescales: list[ev.RescaleCompleted] = []

    rejected = 0

    async def follow() -> None:
        nonlocal rejected
        async for record in log_.read(1, follow=True):
            apply(state, record.seq, record.event)
            rejected += isinstance(record.event, ev.JobRejected)
            if isinstance(record.event, ev.RescaleCompleted):
                rescales.append(record.event)

    follower = asyncio.create_task(follow())
    try:
        deadline = time.monotonic() + 60
        agents = args.agents + args.cpu_agents + (1 if getattr(args, "nvml", False) else 0)
        while len([n for n in state.nodes.values() if n.status == "up"]) < agents:
            supervise()
            if time.monotonic() > deadline or stopping():
                raise GpuherdError(f"only {len(state.nodes)} of {agents} agents registered within 60s")
            await asyncio.sleep(0.2)
        console.print(f"{len(state.nodes)} nodes registered, {state.capacity_gpus()} GPUs")
        real: list[str] = []
        elastic_job: str | None = None
        if args.cpu_agents:
            specs = real_jobs()
            # The elastic act comes before the trace and the other jobs: a job waiting for GPUs would
            # come first for the elastic service (no grow while one waits), and the machine is quiet.
            for spec in [s for s in specs if s.get("elastic")]:
                await client.configure_elastic(ELASTIC_HOLD)
                elastic_job = await client.submit(spec, timeout=30)
                real.append(elastic_job)
                console.print(f"submitted an elastic training job to the cpu agents: {elastic_job}")
                rigid = await elastic_act(client, log_, state, rescales, elastic_job, supervise, stopping)
                real += [rigid] if rigid is not None else []
            others = [await client.submit(s, timeout=30) for s in specs if not s.get("elastic")]
            real += others
            console.print(f"submitted {len(others)} more real training jobs to the cpu agents: {', '.join(others)}")

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            submitted_bar = progress.add_task("submitted", total=len(workload))
            finished_bar = progress.add_task("finished ", total=len(workload) + len(real))
            started = time.monotonic()
            accepted: set[str] = set(real)
            for offset, spec in workload:
                while time.monotonic() - started < offset:
                    supervise()
                    progress.update(finished_bar, completed=sum(1 for j in state.jobs.values() if j.status in TERMINAL))
                    await asyncio.sleep(min(0.05, offset - (time.monotonic() - started)))
                if stopping():
                    return 130
                try:
                    accepted.add(await client.submit(spec, timeout=30))
                except SubmissionError as exc:
                    rejections[str(exc)] += 1
                progress.update(submitted_bar, advance=1)
            # Real training takes its own time, however compressed the trace is.
            finish_deadline = time.monotonic() + args.demo_seconds * 4 + cap + (REAL_JOBS_ALLOWANCE_S if real else 0)
            while not stopping():
                supervise()
                finished = sum(1 for j in accepted if j in state.jobs and state.jobs[j].status in TERMINAL)
                progress.update(finished_bar, completed=finished + sum(rejections.values()))
                if finished >= len(accepted) or time.monotonic() > finish_deadline:
                    break
                await asyncio.sleep(0.2)
    finally:
        follower.cancel()
        await client.close()
        await log_.close()

    summary = summarize(state, rejected)
    table = Table(title="demo summary (times in compressed seconds)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if real:
        console.print(real_jobs_table(state, real))
    for reason, count in rejections.most_common():
        console.print(f"rejected x{count}: {reason}")

    log_ = await open_log(url, name="gpuherd-audit")
    try:
        records = await log_.read_all()
    finally:
        await log_.close()
    rows = rescale_rows(records)
    if rows:
        console.print(
            rescale_table(rows, "rescales of the elastic job (s; gpuherd rescales: every phase)", compact=True)
        )
    line = elastic_line(rescales, elastic_job) if elastic_job is not None else None
    if line is not None:
        console.print(line)
    report = audit(records, make_decider("scheduler", policy=args.policy))
    verdict = "[green]no mismatches[/green]" if report.ok else f"[red]{len(report.mismatches)} mismatches[/red]"
    console.print(
        f"audit: re-ran {report.decisions_checked} scheduler decisions over {report.events} events: {verdict}"
    )
    elastic = audit(records, make_decider("elastic"))
    console.print(
        f"audit: re-ran {elastic.decisions_checked} elastic-service decisions: "
        + ("[green]no mismatches[/green]" if elastic.ok else f"[red]{len(elastic.mismatches)} mismatches[/red]")
    )
    unfinished = (
        summary["accepted"] - summary["by_status"].get("completed", 0) - summary["by_status"].get("cancelled", 0)
    )
    return 0 if report.ok and elastic.ok and unfinished == 0 else 1
