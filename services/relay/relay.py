"""The report relay's process: it takes node agents' reports on ``herd.report.<node>`` and stores
those that arrived while its last append was out together (starts and ends of tasks as one page),
then answers each agent.

What a relay may store, and why an agent loses nothing through it, is in ``gpuherd.log.relay``. One
append is out at a time, as in a decider's runner: a relay under load stores what piled up meanwhile
together (up to the log's ``max_batch``), and an idle one stores a lone report at once. A report it
cannot store it answers with the reason, and the agent appends the report itself."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import socket
from typing import Any, NamedTuple

from gpuherd import events as ev
from gpuherd.log import open_log
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.log.relay import PAGED_REPORTS, RELAY_QUEUE, REPORT_PREFIX, RelayAnswer, check_report, encode_answer
from gpuherd.log.streams import TRACEPARENT
from gpuherd.metrics import ServiceMetrics, serve_until_signal_with_http, status_reporter
from gpuherd.obs import configure, get_logger
from gpuherd.runtime.serve import close_promptly, run_process
from gpuherd.service_args import service_parser

log = get_logger("gpuherd.relay")


class _Report(NamedTuple):
    event: ev.Event  # (to check it, and for its subject and id)
    data: bytes  # what its agent wrote: stored as it is
    trace: str | None
    reply: str


class ReportRelay:
    """Served by ``serve_until_signal_with_http``: ``run`` until stopped, with /metrics and /healthz."""

    def __init__(self, log_: JetStreamLog, *, max_batch: int | None = None, instance: str = "") -> None:
        self.log = log_
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}"
        self.max_batch = min(max_batch or log_.max_batch, log_.max_batch)
        self.metrics = ServiceMetrics("relay")
        self.reports, self.batches = self.metrics.count_relayed()
        self.metrics.watch_connection(log_.is_connected)
        self.metrics_port: int | None = None
        self._pending: list[_Report] = []
        self._arrived = asyncio.Event()
        self._listening = False

    def health(self) -> tuple[bool, dict[str, Any]]:
        connected = self.log.is_connected()
        return self._listening and connected, {"service": "relay", "nats_connected": connected}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return self.health()

    async def _on_report(self, msg: Any) -> None:
        node = msg.subject[len(REPORT_PREFIX) + 1 :]
        event, problem = check_report(node, msg.data)
        if event is None:
            self.reports.labels("refused").inc()
            log.warning("report refused", subject=msg.subject, error=problem)
            await self._answer(msg.reply, RelayAnswer(ok=False, error=problem))
            return
        self._pending.append(_Report(event, msg.data, (msg.headers or {}).get(TRACEPARENT), msg.reply))
        self._arrived.set()

    async def _answer(self, reply: str, answer: RelayAnswer) -> None:
        if not reply:
            return
        with contextlib.suppress(Exception):  # (the connection is gone: the agent falls back on its timeout)
            await self.log.nc.publish(reply, encode_answer(answer))

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.log.nc.subscribe(f"{REPORT_PREFIX}.*", queue=RELAY_QUEUE, cb=self._on_report)
        self._listening = True
        # In `gpuherd status` (role "relay"; its "decisions" are the reports it stored).
        status = asyncio.ensure_future(
            status_reporter(
                self.log,
                self.metrics,
                instance=self.instance,
                role=lambda: "relay",
                folded=None,
                decisions=lambda: int(self.reports.labels("stored")._value.get()),
                metrics_port=self.metrics_port,
            )
        )
        log.info("relaying reports", subject=f"{REPORT_PREFIX}.*", queue=RELAY_QUEUE, max_batch=self.max_batch)
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                if not self._pending:
                    self._arrived.clear()
                    arrived = asyncio.ensure_future(self._arrived.wait())
                    await asyncio.wait({arrived, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    arrived.cancel()
                    continue
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                storing = asyncio.ensure_future(self.store(batch))
                await asyncio.wait({storing, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not storing.done():  # stopped while the log is slow: its agents append these
                    storing.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await storing
                    self._pending = batch + self._pending
                elif storing.exception() is not None:  # (a defect: said, and its agents append these)
                    log.error("reports not relayed", reports=len(batch), error=repr(storing.exception()))
                    for report in batch:
                        await self._answer(report.reply, RelayAnswer(ok=False, error="the relay failed"))
        finally:
            stopping.cancel()
            status.cancel()
            self._listening = False
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            # What arrived and is not stored is answered at once: its agents append it themselves.
            left, self._pending = self._pending, []
            for report in left:
                await self._answer(report.reply, RelayAnswer(ok=False, error="the relay is stopping"))
            with contextlib.suppress(Exception):
                await self.log.nc.flush(timeout=1)

    async def store(self, batch: list[_Report]) -> None:
        """Store ``batch``, in the order it came, each report once (an agent may ask twice for one,
        e.g. after its restart), and answer every asker: each run of ``PAGED_REPORTS`` as a page,
        each run of other reports as messages of their own (``gpuherd.log.relay``)."""
        first: dict[str, _Report] = {}
        for report in batch:
            first.setdefault(report.event.id, report)
        positions: dict[str, int] = {}
        try:
            for paged, run in itertools.groupby(first.values(), key=lambda r: type(r.event) in PAGED_REPORTS):
                reports = list(run)
                append = self.log.append_relayed if paged else self.log.append_each
                stored = await append(
                    [r.event for r in reports], trace=[r.trace for r in reports], encoded=[r.data for r in reports]
                )
                positions.update(zip((r.event.id for r in reports), stored, strict=True))
                self.batches.observe(len(reports))
        except Exception as exc:  # the log away or refusing: the agents store the rest themselves
            left = [r for r in batch if r.event.id not in positions]
            self.reports.labels("failed").inc(len(left))
            log.warning("reports not stored; their agents append them", reports=len(left), error=repr(exc))
            for report in left:
                await self._answer(report.reply, RelayAnswer(ok=False, error=f"not stored: {exc!r}"))
        stored_now = [r for r in batch if r.event.id in positions]
        self.reports.labels("stored").inc(len(stored_now))
        for report in stored_now:
            await self._answer(report.reply, RelayAnswer(ok=True, position=positions[report.event.id]))


async def serve(args: argparse.Namespace) -> None:
    log_ = await open_log(args.nats_url, name="relay")
    if not isinstance(log_, JetStreamLog):
        raise SystemExit(f"the relay stores into a JetStream log; {args.nats_url} is not one")
    try:
        relay = ReportRelay(log_, max_batch=args.max_batch, instance=args.instance or "")
        await serve_until_signal_with_http(relay, args.metrics_port)
    finally:
        await close_promptly(log_)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"want 1 or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("relay", "gpuherd report relay: stores the node agents' reports many at a time")
    parser.add_argument(
        "--max-batch",
        type=_at_least_one,
        default=None,
        help="reports stored in one commit at most (default and upper bound: the log's atomic batch limit, 1000)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure("relay")
    run_process(lambda: serve(args))
