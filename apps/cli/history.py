"""The log as history: ``events``, ``rescales``, ``replay`` (and its audit)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import difflib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgspec
from rich.progress import Progress
from rich.table import Table

from apps import registry
from apps.cli.common import (
    Folding,
    LogReader,
    console,
    each_record,
    fmt_time,
    open_cli_log,
    plain,
    print_json,
    read_log,
    records_of,
)
from apps.cli.rescales import rescale_rows, rescale_table
from apps.registry import make_decider
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from gpuherd.runtime.audit import Audit, AuditReport


async def _replay(records: Iterable[Record]) -> AsyncIterator[Record]:
    for record in records:
        yield record


def event_types_asked(text: str | None) -> frozenset[str]:
    """The event type names of ``--type`` (comma-separated; none: every type). A name no event
    type has is refused: it would match nothing, and an empty answer reads as "no such events"."""
    names = frozenset(part.strip() for part in (text or "").split(",") if part.strip())
    known = {*ev.EVENT_TYPES, ev.Unreadable.__name__}  # (readers make Unreadable of a damaged record)
    unknown = sorted(names - known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise GpuherdError(
            f"--type: no event type named {', '.join(hints)}; the event types are: {', '.join(sorted(known))}"
        )
    return names


def _matches(event: ev.Event, args: argparse.Namespace, types: frozenset[str]) -> bool:
    if args.job and getattr(event, "job", None) != args.job:
        return False
    if args.node:
        nodes = {getattr(event, "node", None)} | {a.node for a in getattr(event, "allocations", ())}
        if args.node not in nodes:
            return False
    return not (types and type(event).__name__ not in types)


async def _last_matching(log_: Any, n: int, match: Callable[[ev.Event], bool]) -> list[Record]:
    """The last ``n`` records whose event ``match``es (fewer where the log holds fewer): the log's
    tail, read further back until it holds ``n`` of them. (Its last ``n`` events filtered after, a
    ``--type`` of events rarer than every ``n``th was answered with nothing.)"""
    stop = await log_.last_seq()
    want = n
    while True:
        start = await log_.tail_start(want)  # (at least the last `want`: more where a stored message holds several)
        found = collections.deque([r async for r in log_.read(start, stop=stop) if match(r.event)], n)
        if len(found) >= n or start <= 1:
            return list(found)
        want *= 8


def cmd_events(args: argparse.Namespace) -> int:
    if args.dead_letter:
        return cmd_dead_letters(args)
    if args.last < 0:
        raise GpuherdError(f"--last takes the number of latest events to show (0: all), got {args.last}")
    types = event_types_asked(args.type)

    async def run() -> int:
        log_ = await open_cli_log(args)
        try:
            records: AsyncIterator[Record]
            if args.last and not args.follow:
                records = _replay(await _last_matching(log_, args.last, lambda e: _matches(e, args, types)))
            else:
                records = log_.read(1, follow=args.follow)
            async for record in records:
                if not _matches(record.event, args, types):
                    continue
                if args.json:
                    print_json({"seq": record.seq, **msgspec.to_builtins(record.event)})
                    continue
                data = msgspec.to_builtins(record.event)
                kind = data.pop("type")
                for key in ("id", "v", "at"):
                    data.pop(key, None)
                console.print(
                    f"[dim]{record.seq:>8} {fmt_time(record.event.at)}[/dim] [bold]{kind}[/bold] "
                    f"{plain(msgspec.json.encode(data).decode())}",
                    highlight=False,
                    soft_wrap=True,
                )
        finally:
            await log_.close()
        return 0

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0


def cmd_dead_letters(args: argparse.Namespace) -> int:
    async def run() -> list[Any]:
        log_ = await open_cli_log(args)
        try:
            return await log_.dead_letters()
        finally:
            await log_.close()

    letters = asyncio.run(run())
    if args.json:
        for letter in letters:
            data = msgspec.to_builtins(letter)
            data["data"] = base64.b64encode(letter.data).decode()
            print(msgspec.json.encode(data).decode())
        return 0
    table = Table(title=f"dead letters ({len(letters)})", title_justify="left")
    for col in ("stream", "seq", "subject", "consumer", "deliveries", "reason", "data"):
        table.add_column(col)
    for letter in letters:
        preview = letter.data[:60].decode("utf-8", errors="replace")
        cells = (
            letter.stream,
            str(letter.seq),
            letter.subject,
            letter.consumer,
            str(letter.deliveries),
            letter.reason,
            preview + ("..." if len(letter.data) > 60 else ""),
        )
        table.add_row(*map(plain, cells))
    console.print(table)
    return 0


def cmd_rescales(args: argparse.Namespace) -> int:
    rows = rescale_rows(records_of(args), args.job)
    if args.json:
        print_json(rows)
    else:
        console.print(rescale_table(rows, f"rescales of elastic jobs ({len(rows)})"))
    return 0


async def _audited(args: argparse.Namespace, check: Audit, progress: Progress) -> AuditReport:
    """Two reads of the log (``Audit``), a record at a time: what it holds is the decider's own
    decisions, not the log."""
    async with LogReader.open(args) as reader:
        await each_record(reader, check.see, progress, "reading its decisions")
        await each_record(reader, check.fold, progress, "re-running decisions")
    return check.finish()


def cmd_replay(args: argparse.Namespace) -> int:
    if not args.audit:
        core = Folding()
        events = read_log(args, core.take)
        state = core.state
        summary = {
            "events": events,
            "jobs": len(state.jobs),
            "nodes": len(state.nodes),
            "by_status": dict(Counter(j.status for j in state.jobs.values())),
        }
        if args.json:
            print_json(summary)
            return 0
        nodes = len(state.nodes)
        console.print(f"the log folded: {events:,} events, {nodes:,} node{'s' if nodes != 1 else ''}")
        table = Table()
        table.add_column("job status")
        table.add_column("jobs", justify="right")
        for status, count in sorted(summary["by_status"].items(), key=lambda item: -item[1]):
            table.add_row(status, f"{count:,}")
        table.add_row("all", f"{len(state.jobs):,}", style="bold")
        console.print(table)
        return 0
    decider = make_decider(args.decider, policy=args.policy)
    # (on a terminal only: piped, a finished bar left an empty line before the report)
    with Progress(console=console, transient=True, disable=args.json or not console.is_terminal) as progress:
        report = asyncio.run(_audited(args, Audit(decider), progress))
    if args.json:
        print_json(msgspec.to_builtins(report) | {"ok": report.ok})
        return 0 if report.ok else 1
    console.print(
        f"audited {report.events} events: {report.batches_checked} decision batches, "
        f"{report.decisions_checked} decisions of {report.decider}"
    )
    if report.ok:
        console.print("[green]no mismatches[/green]: every decision would be made again")
    else:
        table = Table(title=f"{len(report.mismatches)} mismatches")
        for col in ("seq", "event", "kind", "detail"):
            table.add_column(col)
        for m in report.mismatches:
            table.add_row(*map(plain, (m.seq, m.event_id, m.kind, m.detail)))
        console.print(table)
    return 0 if report.ok else 1


def add_commands(sub: Any) -> None:
    rs = sub.add_parser("rescales", help="elastic jobs' rescales: kind, sizes, and each phase's duration")
    rs.add_argument("--job", default=None, help="only this job's rescales")
    rs.add_argument("--log", help="a log file instead of the live log")
    rs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rs.set_defaults(func=cmd_rescales)

    e = sub.add_parser("events", help="print the event log (filter by job, node, type)")
    e.add_argument("--job", default=None, help="only events about this job")
    e.add_argument("--node", default=None, help="only events about this node")
    e.add_argument("--type", default=None, help="event type(s), comma-separated, e.g. JobPlaced,JobFinished")
    e.add_argument("--last", type=int, default=0, help="only the last N events")
    e.add_argument(
        "--follow", "-f", action="store_true", help="then print new events as they are appended (Ctrl-C ends)"
    )
    e.add_argument("--json", action="store_true", help="one JSON object per event")
    e.add_argument(
        "--dead-letter",
        action="store_true",
        help="the dead letters instead: messages no consumer could handle, and why",
    )
    e.set_defaults(func=cmd_events)

    r = sub.add_parser("replay", help="re-fold the log; with --audit, re-run a decider at every decision")
    r.add_argument(
        "--audit",
        action="store_true",
        help="re-run the decider on the state each decision was made on and list every decision that differs",
    )
    r.add_argument("--decider", default="scheduler", choices=registry.auditable(), help="whose decisions to audit")
    r.add_argument("--policy", default="fifo", help="the scheduler's policy until the log records one")
    r.add_argument("--json", action="store_true", help="print the summary (or the audit's report) as JSON")
    r.add_argument("--log", help="a log file (a simulation's events.jsonl) instead of the live log")
    r.set_defaults(func=cmd_replay)
