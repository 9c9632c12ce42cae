"""Operability of a running service: Prometheus metrics, health over HTTP, and its status in the log.

Each process builds one ``ServiceMetrics`` (its own registry, no process-global metric state) and
may serve it with ``serve_http`` on ``--metrics-port``:

- ``GET /metrics``: Prometheus text format;
- ``GET /healthz``: 200 while the process is connected to NATS and its loops run, else 503 (what
  a container health check and a restart policy want);
- ``GET /readyz``: 200 once it leads and has caught up with the log (standbys answer 503).

``status_reporter`` writes what the service says about itself (role, folded sequence, lag, decisions,
metrics address) to the ``herd_services`` KV bucket every few seconds; the entry expires when the
service stops saying it, and ``gpuherd status`` reads them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuherd.aio import serve_until_signal
from gpuherd.errors import UNDECODABLE
from gpuherd.log import STATUS_BUCKET, EventLog
from gpuherd.obs import get_logger

log = get_logger("gpuherd.metrics")

# Reports a relay stored per commit (one commit holds up to the log's max_batch, 1000).
RELAY_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000)
# Decision latency: from an event reaching the decider to its decisions being stored in the log.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
STATUS_EVERY_S = 5.0


class ServiceMetrics:
    """The metrics every gpuherd service exposes; the cluster gauges come from ``watch_cluster``."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        r = self.registry
        self.events_consumed = Counter("gpuherd_events_consumed", "Events folded from the log", registry=r)
        self.decisions = Counter("gpuherd_decisions", "Decisions appended to the log", ["type"], registry=r)
        self.decision_latency = Histogram(
            "gpuherd_decision_latency_seconds",
            "From an event reaching the decider to its decisions stored in the log",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.coalesced = Counter(
            "gpuherd_passes_coalesced", "Waiting events whose pass a later waiting event made", registry=r
        )
        self.consumer_lag = Gauge(
            "gpuherd_consumer_lag_events",
            "Stored log messages not yet folded (a page of several events counts once)",
            registry=r,
        )
        self.folded_seq = Gauge("gpuherd_folded_sequence", "Last log sequence folded", registry=r)
        self.leader = Gauge("gpuherd_leader", "1 while this instance leads its service", registry=r)
        self.dead_letters = Counter(
            "gpuherd_dead_letters", "Messages this service gave up on (kept in HERD_DEAD)", registry=r
        )
        self.intake = Counter("gpuherd_intake_submissions", "Intake submissions judged", ["verdict"], registry=r)
        self.snapshots_missed = Counter(
            "gpuherd_snapshots_missed",
            "Snapshots of this service's state that could not be stored (a restart folds from the last one stored)",
            registry=r,
        )
        self.nats_connected = Gauge("gpuherd_nats_connected", "1 while connected to NATS", registry=r)
        self.healthy = True  # set False by a loop that found itself broken

    def watch_connection(self, is_connected: Callable[[], bool]) -> None:
        """``gpuherd_nats_connected`` read at scrape time (not only when a health check asks)."""
        self.nats_connected.set_function(lambda: 1.0 if is_connected() else 0.0)

    def watch_cluster(self, get_state: Callable[[], Any]) -> None:
        """Expose jobs and GPUs by state from a ``ClusterState`` read at scrape time (never on the hot path)."""
        self.registry.register(_ClusterCollector(get_state))

    def watch_usage(self, get_usage: Callable[[], dict[tuple[str, str], float]]) -> None:
        """``gpuherd_gpu_seconds_total{vc,user}``: GPU-seconds used, read at scrape time from
        ``get_usage`` ((VC, user) -> GPU-seconds so far, running jobs included)."""
        self.registry.register(_UsageCollector(get_usage))

    def count_relayed(self) -> tuple[Counter, Histogram]:
        """The report relay's own: the agents' reports it took by outcome (stored; refused, not the
        asking agent's to write; failed, the log did not take them and their agents appended them),
        and the reports stored per commit."""
        reports = Counter(
            "gpuherd_relay_reports",
            "Agents' reports this relay took: stored, refused (not the asking agent's to write), or "
            "failed (the log did not take them; their agents append them themselves)",
            ["outcome"],
            registry=self.registry,
        )
        batches = Histogram(
            "gpuherd_relay_batch_reports",
            "Reports stored per commit (a run of starts and ends of tasks as pages, or of other reports)",
            buckets=RELAY_BATCH_BUCKETS,
            registry=self.registry,
        )
        return reports, batches

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gpu_state(node: Any, slot: Any) -> str:
    """One word for a GPU: what ``gpuherd_gpus{state}`` counts."""
    if node.status == "lost":
        return "lost"
    if node.power != "on":
        return "powered_off"
    if not slot.healthy:
        return "unhealthy"
    if slot.job is not None:
        return "busy"
    return "drained" if node.status == "drained" else "free"


class _ClusterCollector(Collector):
    def __init__(self, get_state: Callable[[], Any]) -> None:
        self._get_state = get_state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._get_state()
        if state is None:
            return
        jobs = GaugeMetricFamily("gpuherd_jobs", "Jobs by state, as this service folded them", labels=["state"])
        counts: dict[str, int] = dict(state.ended)  # jobs that ended (a service's state drops them)
        counts["pending"] = len(state.queue)
        for job in state.active_jobs():
            counts[job.status] = counts.get(job.status, 0) + 1
        for name in ("pending", "placed", "running", "completed", "failed", "cancelled", "timeout"):
            jobs.add_metric([name], counts.get(name, 0))
        yield jobs
        gpus = GaugeMetricFamily("gpuherd_gpus", "GPUs by state", labels=["state"])
        by_state: dict[str, int] = {}
        for node in state.nodes.values():
            for slot in node.gpus:
                word = gpu_state(node, slot)
                by_state[word] = by_state.get(word, 0) + 1
        for name in ("free", "busy", "unhealthy", "drained", "powered_off", "lost"):
            gpus.add_metric([name], by_state.get(name, 0))
        yield gpus
        queue_jobs = GaugeMetricFamily("gpuherd_queue_jobs", "Waiting jobs per VC", labels=["vc"])
        queue_gpus = GaugeMetricFamily("gpuherd_queue_gpus", "GPUs the waiting jobs ask for, per VC", labels=["vc"])
        waiting = dict.fromkeys(state.vcs, 0)
        asked = dict.fromkeys(state.vcs, 0)
        for job in state.waiting():
            vc = job.spec.vc
            waiting[vc] = waiting.get(vc, 0) + 1
            asked[vc] = asked.get(vc, 0) + job.spec.gpus
        for vc in sorted(waiting):
            queue_jobs.add_metric([vc], waiting[vc])
            queue_gpus.add_metric([vc], asked[vc])
        yield queue_jobs
        yield queue_gpus


class _UsageCollector(Collector):
    """A counter never goes down: a running job's use is read as of the newest event, and its final
    charge (made when it ends, from the same clock) only adds to it; any step back is held."""

    def __init__(self, get_usage: Callable[[], dict[tuple[str, str], float]]) -> None:
        self._get_usage = get_usage
        self._exported: dict[tuple[str, str], float] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        counter = CounterMetricFamily(
            "gpuherd_gpu_seconds", "GPU-seconds used by jobs, per VC and user", labels=["vc", "user"]
        )
        for key, value in sorted(self._get_usage().items()):
            value = max(value, self._exported.get(key, 0.0))
            self._exported[key] = value
            counter.add_metric(list(key), value)
        yield counter


Health = Callable[[], tuple[bool, dict[str, Any]]]


async def serve_http(
    metrics: ServiceMetrics, health: Health, ready: Health, *, host: str = "0.0.0.0", port: int = 0
) -> asyncio.AbstractServer:
    """Serve /metrics, /healthz and /readyz. Plain asyncio: three read-only routes need no framework."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing in them matters here
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else "/"
            if path == "/metrics":
                status, body, kind = 200, metrics.render(), "text/plain; version=0.0.4; charset=utf-8"
            elif path in ("/healthz", "/readyz"):
                ok, detail = (health if path == "/healthz" else ready)()
                status, body, kind = (200 if ok else 503), msgspec.json.encode(detail), "application/json"
            else:
                status, body, kind = 404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host, port)
    bound = server.sockets[0].getsockname()[1]
    log.info("serving metrics and health", port=bound, service=metrics.service)
    return server


async def http_get(port: int, path: str, *, host: str = "127.0.0.1", timeout: float = 5.0) -> tuple[int, str]:
    """GET ``path`` from a process's endpoints: (status, body). Raises OSError or TimeoutError."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample with its labels, as printed: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def server_port(server: asyncio.AbstractServer) -> int:
    return int(server.sockets[0].getsockname()[1])


class Served(Protocol):
    """A long-running process with endpoints: a decider runner, a node agent."""

    metrics: ServiceMetrics
    metrics_port: int | None

    def health(self) -> tuple[bool, dict[str, Any]]: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...

    async def run(self, stop: asyncio.Event) -> None: ...


async def serve_until_signal_with_http(process: Served, metrics_port: int | None) -> None:
    """Run ``process`` until SIGTERM, serving its /metrics, /healthz and /readyz on ``metrics_port``
    (0: any free port; None: none)."""
    server = None
    if metrics_port is not None:
        server = await serve_http(process.metrics, process.health, process.readiness, port=metrics_port)
        process.metrics_port = server_port(server)
    try:
        await serve_until_signal(process.run)
    finally:
        if server is not None:
            server.close()


def metrics_port_from_env(default: int | None = None) -> int | None:
    """``GPUHERD_METRICS_PORT`` (0: any free port), else ``default`` (None: no HTTP server)."""
    value = os.environ.get("GPUHERD_METRICS_PORT")
    return int(value) if value not in (None, "") else default


class ServiceStatus(msgspec.Struct, kw_only=True):
    """What a running service says about itself in ``herd_services`` (key ``<service>.<instance>``)."""

    service: str
    instance: str
    role: str  # a decider's "leader", "standby" or "starting"; any other process names its kind
    seq: int = 0
    head: int = 0
    lag: int = 0
    decisions: int = 0
    dead_letters: int = 0
    host: str = ""
    pid: int = 0
    metrics_url: str = ""
    started_at: float = 0.0
    updated_at: float = 0.0


def read_statuses(entries: dict[str, bytes]) -> tuple[list[ServiceStatus], list[dict[str, str]]]:
    """The statuses of ``herd_services``' entries (key -> value), services first and leaders before
    standbys, and the entries that cannot be read (garbled, or written by another version of a
    service during an upgrade), each named with its error: said, never a traceback."""
    statuses: list[ServiceStatus] = []
    unreadable: list[dict[str, str]] = []
    for key, value in sorted(entries.items()):
        try:
            statuses.append(msgspec.json.decode(value, type=ServiceStatus))
        except UNDECODABLE as exc:
            unreadable.append({"key": key, "error": str(exc)})
    statuses.sort(key=lambda s: (s.service.startswith("agent-"), s.service, s.role != "leader"))
    return statuses, unreadable


async def status_reporter(
    log_: EventLog,
    metrics: ServiceMetrics,
    *,
    instance: str,
    role: Callable[[], str],
    folded: Callable[[], int] | None,
    decisions: Callable[[], int],
    metrics_port: int | None,
    every_s: float = STATUS_EVERY_S,
) -> None:
    """Every ``every_s``: measure the lag against the log's head, update the gauges, and say it in the
    KV. ``folded`` None: a process that folds no log (the report relay) says no position or lag."""
    started = time.time()
    host = socket.gethostname()
    key = f"{metrics.service}.{instance}".replace(" ", "_")
    url = f"http://{host}:{metrics_port}/metrics" if metrics_port else ""
    while True:
        try:
            head = await log_.last_seq()
            seq = folded() if folded is not None else 0
            lag = log_.behind(seq, head) if folded is not None else 0
            if folded is not None:
                metrics.consumer_lag.set(lag)
                metrics.folded_seq.set(seq)
            status = ServiceStatus(
                service=metrics.service,
                instance=instance,
                role=role(),
                seq=seq,
                head=head,
                lag=lag,
                decisions=decisions(),
                dead_letters=int(metrics.dead_letters._value.get()),
                host=host,
                pid=os.getpid(),
                metrics_url=url,
                started_at=started,
                updated_at=time.time(),
            )
            await log_.kv_put(STATUS_BUCKET, key, msgspec.json.encode(status))
        except Exception as exc:  # NATS away: the gauges keep their last value, the KV entry expires
            log.debug("status not reported", error=repr(exc))
        await asyncio.sleep(every_s)
