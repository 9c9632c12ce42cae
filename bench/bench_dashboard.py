"""The dashboard on a big log: 1,000 nodes and 20,000 jobs, in a real browser.

The history is made by the simulator (the production deciders) with jobs arriving at 95% of the
cluster's capacity, cut at the last arrival (thousands of jobs run), then a burst of ``--burst``
large submissions at once, which wait; it is
appended to an embedded nats-server. Then the dashboard starts as its own process (``gpuherd serve
dashboard``) and headless Chromium (Debian's ``chromium``, driven by Playwright) measures:

* **first load**: from navigation to the overview's GPU heatmap (every GPU drawn) and to the queue's
  table, in a fresh browser context each time (median of ``--repeats``);
* **API**: ``/api/overview`` and ``/api/queue`` answered by the running dashboard;
* **an event on an open page**: a running job's ``JobFinished`` appended to the log, until its GPUs
  leave the open overview (median of ``--repeats``);
* **memory**: the dashboard process's resident and peak memory.

The baseline is what the CLI does for the same answers: ``gpuherd nodes --json`` and ``gpuherd jobs
--status pending --json`` (each reads and folds the whole log), timed in the same run.
Targets: first loads < 1 s, an event visible < 1 s, the dashboard < 300 MB.

Usage: python bench/bench_dashboard.py [--jobs 20000] [--nodes 1000] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_restart import synthetic_jobs
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from apps.cluster.local import Supervised, service_argv, stop_together
from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.log import open_log
from gpuherd.natsd import NatsServer, free_port

console = Console(stderr=True)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"]
CHROMIUM_ARGS += ["--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
LOAD_TARGET_S = 1.0
EVENT_TARGET_S = 1.0
MEMORY_TARGET_MB = 300.0
LOAD = 0.95  # arrivals against capacity: busy, with a queue at times (overload makes the simulation crawl)


def history(jobs: int, nodes: int, seed: int, burst: int) -> list[ev.Event]:
    """The log up to the last arrival of ``jobs - burst`` jobs arriving at LOAD x capacity, then a
    burst of ``burst`` large submissions at once (accepted, waiting: no scheduler runs here)."""
    cluster = ClusterSpec(vcs={"default": VcSpec(nodes=nodes)}, can_borrow=True)
    start = time.time() - 86_400.0
    submissions = synthetic_jobs(jobs - burst, cluster.total_gpus, seed, start, load=LOAD)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"simulating the history: {jobs - burst:,} jobs on {nodes:,} nodes", total=jobs)
        result = simulate(submissions, cluster, "fifo", start=start, on_submit=lambda n: progress.advance(task, n))
    cut = submissions[-1].at
    events = [r.event for r in result.records if r.event.at <= cut]
    for i in range(burst):
        spec = ev.JobSpec(name=f"burst{i}", user=f"u{i % 50}", gpus=(8, 16, 32)[i % 3], duration_s=1800.0)
        events.append(
            ev.JobSubmitted(
                id=f"bench:burst:{i}",
                at=cut + i * 0.01,
                source="scheduler",
                job=f"burst{i}",
                spec=spec,
                intake_source="bench",
                intake_seq=i + 1,
            )
        )
    return events


def rss_mb(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MB of a process, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def get_s(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        response.read()
    return time.perf_counter() - started


def cli_s(nats_url: str, *args: str) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "apps", "--nats-url", nats_url, *args, "--json"],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=600,
    )
    return time.perf_counter() - started


def wait_ready(url: str, started: float, timeout: float = 600.0) -> float:
    """Seconds from ``started`` (the process's start) until /readyz says it has caught up."""
    while time.monotonic() - started < timeout:
        try:
            with urllib.request.urlopen(url + "readyz", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError("the dashboard did not catch up with the log")


def first_loads(browser: Any, url: str, gpus: int, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"overview": [], "queue": []}
    for _ in range(repeats):
        for view, ready in (
            ("overview", f"[data-testid=heatmap] .gpu >> nth={gpus - 1}"),
            ("queue", "[data-testid=queue-table] tbody tr, #view[data-view=queue] p.dim"),  # rows, or "no job waits"
        ):
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            page = context.new_page()
            started = time.perf_counter()
            page.goto(f"{url}#/{view}")
            page.wait_for_selector(ready, state="attached", timeout=60_000)
            out[view].append(time.perf_counter() - started)
            context.close()
    return out


class Appender:
    """Appends to the log from a thread of its own (Playwright's sync API holds this one's loop),
    over one connection opened in advance, so an append costs what an append costs."""

    def __init__(self, nats_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.log = self._call(open_log(nats_url, name="bench-dashboard-event"))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def finish(self, job: str, attempt: int) -> None:
        event = ev.JobFinished(
            id=f"bench:finish:{job}", at=time.time(), source="scheduler", job=job, attempt=attempt, outcome="completed"
        )
        self._call(self.log.append([event]))

    def close(self) -> None:
        self._call(self.log.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def event_latencies(browser: Any, url: str, nats_url: str, running: list[tuple[str, int]], repeats: int) -> list[float]:
    appender = Appender(nats_url)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = context.new_page()
        page.goto(f"{url}#/overview")
        page.wait_for_selector("#live.on", timeout=60_000)
        out = []
        for job, attempt in running[:repeats]:
            page.wait_for_selector(f"[data-job='{job}']", state="attached", timeout=30_000)
            started = time.perf_counter()
            appender.finish(job, attempt)
            page.wait_for_selector(f"[data-job='{job}']", state="detached", timeout=30_000)
            out.append(time.perf_counter() - started)
        return out
    finally:
        context.close()
        appender.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if CHROMIUM is None:
        raise SystemExit("bench_dashboard needs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    events = history(args.jobs, args.nodes, args.seed, args.burst)
    jobs: dict[str, str] = {}
    attempts: dict[str, int] = {}
    for e in events:
        if isinstance(e, ev.JobPlaced):
            jobs[e.job], attempts[e.job] = "placed", e.attempt
        elif isinstance(e, ev.JobFinished):
            jobs[e.job] = "ended"
        elif isinstance(e, ev.JobSubmitted):
            jobs[e.job] = "waiting"
    running = [(j, attempts[j]) for j, s in jobs.items() if s == "placed"]
    data_dir = Path(tempfile.mkdtemp(prefix="gpuherd-dashboard-bench-"))
    server = NatsServer(data_dir / "nats").start()
    dashboard: Supervised | None = None
    try:

        async def append() -> None:
            log_ = await open_log(server.url, name="bench-dashboard")
            try:
                await log_.append_pipelined(events, window=512)
            finally:
                await log_.close()

        with console.status(f"appending the history: {len(events):,} events"):
            asyncio.run(append())
        out: dict[str, Any] = {"nodes": args.nodes, "jobs": args.jobs, "events": len(events)}
        out["running"] = len(running)
        out["waiting"] = sum(1 for s in jobs.values() if s == "waiting")
        with console.status("the baseline: the CLI reading the whole log"):
            out["cli_nodes_s"] = min(cli_s(server.url, "nodes") for _ in range(2))
            out["cli_queue_s"] = min(cli_s(server.url, "jobs", "--status", "pending") for _ in range(2))
        port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", GPUHERD_LOG_LEVEL="WARNING")
        argv = service_argv("dashboard", "--nats-url", server.url, "--port", str(port))
        dashboard = Supervised("dashboard", argv, data_dir, env)
        url = f"http://127.0.0.1:{port}/"
        with console.status("the dashboard catches up with the log"):
            started = time.monotonic()
            dashboard.start()
            out["catch_up_s"] = wait_ready(url, started)
        out["api_overview_s"] = statistics.median(get_s(url + "api/overview") for _ in range(5))
        out["api_queue_s"] = statistics.median(get_s(url + "api/queue") for _ in range(5))
        gpus = args.nodes * 8
        with console.status("Chromium: first loads and live updates"), sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                loads = first_loads(browser, url, gpus, args.repeats)
                latencies = event_latencies(browser, url, server.url, running, args.repeats)
            finally:
                browser.close()
        out["load_overview_s"] = statistics.median(loads["overview"])
        out["load_queue_s"] = statistics.median(loads["queue"])
        out["event_visible_s"] = statistics.median(latencies)
        out["event_visible_max_s"] = max(latencies)
        assert dashboard.proc is not None
        out["rss_mb"], out["peak_rss_mb"] = rss_mb(dashboard.proc.pid)
        return out
    finally:
        if dashboard is not None:
            stop_together([dashboard], timeout=10.0)
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def print_table(r: dict[str, Any]) -> None:
    title = (
        f"dashboard: {r['nodes']:,} nodes, {r['jobs']:,} jobs ({r['events']:,} events; "
        f"{r['running']:,} running, {r['waiting']:,} waiting when the log ends)"
    )
    table = Table(title=title)
    for col in ("measure", "dashboard", "baseline: the CLI", "x faster", "target"):
        table.add_column(col, justify="right")

    def row(label: str, value: float, baseline: float | None, target: str) -> None:
        ratio = f"{baseline / value:.0f}x" if baseline else ""
        table.add_row(label, f"{value:.3f} s", f"{baseline:.2f} s" if baseline else "", ratio, target)

    row("catch up with the log at start", r["catch_up_s"], None, "")
    row("GET /api/overview", r["api_overview_s"], r["cli_nodes_s"], "")
    row("GET /api/queue", r["api_queue_s"], r["cli_queue_s"], "")
    row("first load: overview, every GPU drawn", r["load_overview_s"], r["cli_nodes_s"], f"< {LOAD_TARGET_S:.0f} s")
    row("first load: queue", r["load_queue_s"], r["cli_queue_s"], f"< {LOAD_TARGET_S:.0f} s")
    row("a job's end visible on an open page (median)", r["event_visible_s"], None, f"< {EVENT_TARGET_S:.0f} s")
    row("... slowest", r["event_visible_max_s"], None, "")
    table.add_row("dashboard memory: resident / peak", f"{r['rss_mb']:.0f} / {r['peak_rss_mb']:.0f} MB", "", "",
                  f"< {MEMORY_TARGET_MB:.0f} MB")  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--burst", type=int, default=1000, help="of the jobs, this many arrive at once at the end")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
