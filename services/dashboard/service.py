"""The live dashboard: a reader of the log that keeps its view in memory and serves it over HTTP.

It reads the log from the start and then follows it, follows telemetry (GPU samples, training
progress), asks NATS for an answer every second (pages say when it has gone silent), and answers
pages, ``/api/`` and a server-sent event stream from memory. It needs the ``reader`` NATS role, plus
appending operator commands when started with an operator token (the ``dashboard`` role in
``gpuherd.security``). It makes no decision, so it needs no lease: any number of them may run.

The scheduler's explanation of the queue and the audit are other services' code: the application
layer hands it the other services' specs (``peers``), and it takes from them what they offer
(``Tools.from_peers``: an explainer of a queue, the deciders to audit); without them the queue is
shown in submission order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from gpuherd.aio import serve_until_signal
from gpuherd.client import Client
from gpuherd.explain import QueueExplainer
from gpuherd.log import STATUS_BUCKET, EventLog, Record, open_log
from gpuherd.log.health import nats_overview
from gpuherd.metrics import ServiceMetrics, read_statuses, status_reporter
from gpuherd.obs import configure, get_logger
from gpuherd.output import fetch_output
from gpuherd.runtime.audit import Audit
from gpuherd.runtime.serve import close_promptly, run_process
from gpuherd.runtime.spec import ServiceSpec
from gpuherd.service_args import add_yield_arguments, read_linger_s, yield_cpu
from services.dashboard.server import Actions, Backend, make_app
from services.dashboard.spec import SPEC
from services.dashboard.view import ENDED_KEPT, DashboardView

log = get_logger("gpuherd.dashboard")
DEFAULT_PORT = 8080
FOLD_YIELD_EVERY = 500  # events folded between two looks at pending requests while catching up
TELEMETRY_SINCE_S = 600.0
OUTPUT_BYTES = 65536  # the last bytes of each rank's output a job page shows
# A stopping dashboard waits this long for the requests in progress, twice (to end, then once
# cancelled): an open page's event stream never ends by itself, and a stop took 2 s with one open.
PAGES_SHUTDOWN_TIMEOUT_S = 0.1
# How often the dashboard asks NATS for an answer, and how long it waits for one. A frozen or
# partitioned server keeps the connection open (the client notices only after minutes of unanswered
# pings) and the log's follow merely sees no events, as on a quiet cluster: the pages showed "live".
NATS_PROBE_EVERY_S = 1.0
NATS_PROBE_TIMEOUT_S = 2.0
NATS_PROBE_SUBJECT = "$JS.API.INFO"  # (JetStream's account info: cheap, and what the dashboard reads through)
AUDIT_CHUNK = 4096  # records an audit takes at a time, in a thread


@dataclass(frozen=True)
class Tools:
    """Other services' code the dashboard uses, handed in by the composition layer."""

    queue: Callable[[], QueueExplainer] | None = None  # a fresh explainer folding from the start
    audit: Callable[[], dict[str, Audit]] | None = None  # a fresh audit of each auditable decider, by name

    @classmethod
    def from_peers(cls, peers: Sequence[ServiceSpec]) -> Tools:
        """What the other services offer: the first explainer of a queue, and the audit of every
        auditable decider."""
        explainers = [p.explainer for p in peers if p.explainer is not None]
        auditable = [p for p in peers if p.auditable and p.decider is not None]

        def audits() -> dict[str, Audit]:
            return {p.name: Audit(p.decider()) for p in auditable}  # type: ignore[misc]

        return cls(queue=explainers[0] if explainers else None, audit=audits if auditable else None)


def _feed(takers: list[Callable[[Record], None]], chunk: list[Record]) -> None:
    """Each record of ``chunk`` to every one of ``takers`` (an audit's read, in a thread)."""
    for record in chunk:
        for take in takers:
            take(record)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuherd serve dashboard", description="gpuherd live web dashboard (read-only unless given a token)"
    )
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free one)")
    parser.add_argument(
        "--operator-token-file",
        default=None,
        help="a file holding the operator token; without one the dashboard is read-only",
    )
    parser.add_argument("--report-dir", default=None, help="a folder of reports (gpuherd report / sim) to show")
    parser.add_argument(
        "--ended-kept",
        type=_not_negative,
        default=ENDED_KEPT,
        metavar="N",
        help=f"ended jobs the pages remember, the latest N to end (default {ENDED_KEPT:,}); the log keeps them all",
    )
    parser.add_argument("--url-file", default=None, help="write the URL it serves on to this file once ready")
    add_yield_arguments(parser, read_linger_s=SPEC.read_linger_s, nice=SPEC.nice)
    return parser


def _not_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def read_token(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if len(token) < 16:
        raise ValueError(f"the operator token in {path} is too short: use at least 16 characters")
    return token


class Dashboard:
    def __init__(
        self,
        log_: EventLog,
        *,
        tools: Tools,
        operator_token: str | None = None,
        reports_dir: Path | None = None,
        read_linger_s: float = 0.0,
        ended_kept: int = ENDED_KEPT,
    ) -> None:
        self.log = log_
        self.read_linger_s = read_linger_s  # (see EventStore.read): nothing waits on it within milliseconds
        self.tools = tools
        self.view = DashboardView(tools.queue() if tools.queue is not None else None, ended_kept=ended_kept)
        self.metrics = ServiceMetrics("dashboard")
        self.metrics.watch_cluster(lambda: self.view.state)
        self.metrics.watch_connection(log_.is_connected)
        self.metrics.folded_seq.set_function(lambda: self.view.state.seq)  # (read at scrape time)
        self.caught_up = False
        self.operator_token = operator_token
        self.reports_dir = reports_dir
        self.client = Client(getattr(log_, "nc", None), source="dashboard")
        self.nc = getattr(log_, "nc", None)  # (None: an in-process log, which always answers)
        self.nats_answered_at = time.monotonic()

    def backend(self) -> Backend:
        return Backend(
            view=self.view,
            ready=lambda: self.caught_up,
            services=self.services,
            audit=self.audit if self.tools.audit is not None else None,
            actions=Actions(cancel=self.client.cancel, drain=self._drain),
            metrics=self.metrics.render,
            output=self.output,
            operator_token=self.operator_token,
            reports_dir=self.reports_dir,
            nats_silent_s=self.nats_silent_s,
        )

    def nats_silent_s(self) -> float:
        """Seconds since NATS last answered the dashboard (0 for a log without a server)."""
        return 0.0 if self.nc is None else time.monotonic() - self.nats_answered_at

    async def watch_nats(self) -> None:
        """Ask NATS for an answer every ``NATS_PROBE_EVERY_S``, noting when one came. A request, not
        a ping: nats-py's ``flush`` cancels its pong on a timeout, and a pong arriving after that
        ends the client's read loop for good."""
        if self.nc is None:
            return
        while True:
            try:
                if self.nc.is_connected:  # (an answer with an error in it is an answer too)
                    await self.nc.request(NATS_PROBE_SUBJECT, b"", timeout=NATS_PROBE_TIMEOUT_S)
                    self.nats_answered_at = time.monotonic()
            except Exception as exc:  # timed out, or reconnecting: the silence grows
                log.debug("nats did not answer", error=repr(exc))
            await asyncio.sleep(NATS_PROBE_EVERY_S)

    async def output(self, job: str) -> list[dict[str, Any]]:
        return await fetch_output(self.log, job, self.view.placements.get(job, []), max_bytes=OUTPUT_BYTES)

    async def _drain(self, node: str, reason: str, undrain: bool) -> None:
        await self.client.drain(node, reason, undrain=undrain)

    async def follow_log(self) -> None:
        head = await self.log.last_seq()
        if head == 0:
            self.caught_up = True
        n = 0
        async for record in self.log.read(1, follow=True, linger_s=self.read_linger_s):
            self.view.fold(record.seq, record.event, record.stored_at)
            self.metrics.events_consumed.inc()
            if not self.caught_up and record.seq >= head:
                self.caught_up = True
                log.info("caught up with the log", seq=record.seq, jobs=len(self.view.state.jobs))
            n += 1
            if n % FOLD_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let pages be answered while a long log is folded

    async def follow_telemetry(self, subject: str) -> None:
        """GPU samples (``*.gpus``) or training progress (``*.job.*``); never the heartbeats."""
        while True:
            try:
                async for delivery in self.log.telemetry(subject, since_s=TELEMETRY_SINCE_S):
                    with contextlib.suppress(msgspec.DecodeError, TypeError, ValueError, AttributeError):
                        relative = delivery.subject.removeprefix("herd.telemetry.")
                        self.view.telemetry(relative, msgspec.json.decode(delivery.data))
            except Exception as exc:  # telemetry is best effort: follow it again after a pause
                log.warning("telemetry follow stopped", error=repr(exc))
                await asyncio.sleep(2.0)

    async def services(self) -> dict[str, Any]:
        statuses, unreadable = read_statuses(await self.log.kv_entries(STATUS_BUCKET))
        dead = await self.log.dead_letters()
        nats = await nats_overview(self.log) if hasattr(self.log, "js") else {"streams": []}
        return {
            "now": time.time(),
            "services": [msgspec.to_builtins(s) for s in statuses],
            "unreadable": unreadable,
            "nats": nats,
            "dead_letters": [msgspec.to_builtins(d) for d in dead[-50:]],
            "dead_letter_count": len(dead),
        }

    async def audit(self) -> dict[str, Any]:
        """Every auditable decider's audit of the log as it is now: two reads of it, a chunk of
        records at a time, each chunk taken by the audits in a thread (the pages go on being served).
        What it holds is the deciders' own decisions, not the log: a long-running dashboard asked for
        an audit of a year's log does not take a year's log into its memory."""
        assert self.tools.audit is not None
        audits = self.tools.audit()
        started = time.perf_counter()
        last = await self.log.last_seq()
        for read in ("see", "fold"):
            takers = [getattr(check, read) for check in audits.values()]
            chunk: list[Record] = []
            events = 0  # (in the log up to ``last``: each read sees them all)
            async for record in self.log.read(1, stop=last):
                chunk.append(record)
                events += 1
                if len(chunk) >= AUDIT_CHUNK:
                    await asyncio.to_thread(_feed, takers, chunk)
                    chunk = []
            await asyncio.to_thread(_feed, takers, chunk)
        reports = {name: check.finish() for name, check in audits.items()}
        return {
            "ok": all(r.ok for r in reports.values()),
            "deciders": {name: msgspec.to_builtins(r) | {"ok": r.ok} for name, r in reports.items()},
            "events": events,
            "took_s": time.perf_counter() - started,
            "at": time.time(),
        }

    async def report_status(self, port: int) -> None:
        """Its entry in the services' status, as every service writes it (role ``reader``)."""
        await status_reporter(
            self.log,
            self.metrics,
            instance=f"{socket.gethostname()}-{os.getpid()}",
            role=lambda: "reader",
            folded=lambda: self.view.state.seq,
            decisions=lambda: 0,
            metrics_port=port,
        )


async def serve(args: argparse.Namespace, tools: Tools, stop: asyncio.Event) -> None:
    token = read_token(args.operator_token_file)
    log_ = await open_log(args.nats_url, name="gpuherd-dashboard", persistent=True)
    dashboard = Dashboard(
        log_,
        tools=tools,
        operator_token=token,
        reports_dir=Path(args.report_dir) if args.report_dir else None,
        read_linger_s=read_linger_s(args),
        ended_kept=args.ended_kept,
    )
    runner = web.AppRunner(make_app(dashboard.backend()), access_log=None, shutdown_timeout=PAGES_SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://{args.host if args.host not in ('0.0.0.0', '::') else '127.0.0.1'}:{port}/"
    log.info("dashboard serving", url=url, actions=token is not None)
    tasks = [
        asyncio.create_task(dashboard.follow_log()),
        asyncio.create_task(dashboard.follow_telemetry("*.gpus")),
        asyncio.create_task(dashboard.follow_telemetry("*.job.*")),
        asyncio.create_task(dashboard.report_status(port)),
        asyncio.create_task(dashboard.watch_nats()),
    ]
    if args.url_file:
        Path(args.url_file).write_text(url)
    try:
        waiting = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiting, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
        if tasks[0] in done and not waiting.done():
            tasks[0].result()  # the log follow ended: say why
    finally:
        for task in tasks:
            task.cancel()
        # At once, not one after the other: each may wait out its timeout with NATS frozen (the
        # follows' unsubscribing, the open pages, the connection's drain: 0.5 s in a row of the
        # second a stop may take).
        await asyncio.gather(
            asyncio.gather(*tasks, return_exceptions=True),
            runner.cleanup(),
            close_promptly(log_),  # (draining waits for the server: 12 s with NATS frozen)
        )


def main(argv: list[str] | None = None, *, peers: Sequence[ServiceSpec] = ()) -> None:
    """Serve the dashboard, as its process's entry point (it ends the process: ``os._exit``);
    ``peers``: the other services' specs (what they offer it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure("dashboard")
    yield_cpu("dashboard", args.nice)
    try:
        read_token(args.operator_token_file)
    except (OSError, ValueError) as exc:
        parser.error(f"--operator-token-file: {exc}")
    tools = Tools.from_peers(peers)

    run_process(lambda: serve_until_signal(lambda stop: serve(args, tools, stop)))
    # Everything it had to do is done (the pages answered, the connection closed or left): the
    # interpreter's own teardown of its modules took up to a second more on a busy machine, past the
    # second a stop may take.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
