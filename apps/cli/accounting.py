"""Accounting: ``usage`` (GPU-hours, jobs by how they ended, average queueing; Slurm's sreport) and
``history`` (finished jobs, Slurm's sacct), folded from the log (``gpuherd.fold.accounting``).

Both stream the log (from NATS, or ``--log FILE``, a simulation's) through the fold and keep no
copy of it, so a long history costs its figures, not its events."""

from __future__ import annotations

import argparse
import asyncio
import csv
import sys
from typing import Any

from rich.table import Table

from apps.cli.common import console, fmt_datetime, open_cli_log, parse_when, plain, print_json
from gpuherd import events as ev
from gpuherd.errors import UNDECODABLE, EventDecodeError, GpuherdError
from gpuherd.fold.accounting import Accounting, FinishedJob


def fold_log(args: argparse.Namespace, accounting: Accounting) -> Accounting:
    """The whole log through ``accounting``: a file line by line (decoding only what it reads), or NATS."""
    if getattr(args, "log", None):
        try:
            with open(args.log, "rb") as f:
                for seq, line in enumerate(f, 1):
                    try:
                        accounting.fold_stored(seq, line)
                    except (*UNDECODABLE, EventDecodeError) as exc:  # (a damaged line: say which)
                        why = str(exc).removeprefix("not an event: ")
                        raise GpuherdError(f"{args.log}:{seq}: not an event: {why}") from None
        except OSError as exc:
            raise GpuherdError(f"cannot read the log file {args.log}: {exc}") from None
        return accounting

    async def run() -> None:
        log_ = await open_cli_log(args)
        try:
            async for record in log_.read(1):
                accounting.fold(record.seq, record.event)
        finally:
            await log_.close()

    asyncio.run(run())
    return accounting


def _window(args: argparse.Namespace) -> tuple[float | None, float | None]:
    since = parse_when(args.since) if args.since else None
    until = parse_when(args.until) if args.until else None
    if since is not None and until is not None and until <= since:
        raise GpuherdError("--until must come after --since")
    return since, until


def cmd_usage(args: argparse.Namespace) -> int:
    by = [part.strip() for part in args.by.split(",") if part.strip()]
    if not by or any(part not in ("vc", "user") for part in by):
        raise GpuherdError(f"--by takes vc, user or vc,user; got {args.by!r}")
    since, until = _window(args)
    report = fold_log(args, Accounting(by=by, per=args.per, since=since, until=until)).report()  # type: ignore[arg-type]
    if args.json:
        print_json(report)
        return 0
    group = [*by, *(["period"] if args.per else [])]
    outcomes = list(ev.OUTCOMES)
    if args.csv:
        out = csv.writer(sys.stdout)
        out.writerow([*group, "gpu_hours", "gpu_seconds", *outcomes, "started", "avg_queue_s"])
        for row in report["rows"]:
            out.writerow(
                [*(row[k] for k in group), f"{row['gpu_hours']:.6f}", f"{row['gpu_seconds']:.3f}"]
                + [row["jobs"][o] for o in outcomes]
                + [row["started"], "" if row["avg_queue_s"] is None else f"{row['avg_queue_s']:.3f}"]
            )
        return 0
    window = (
        "the whole log"
        if report["since"] is None and report["until"] is None
        else f"{fmt_day(report['since'])} .. {fmt_day(report['until'])} UTC"
    )
    table = Table(title=f"usage by {', '.join(by)}{' per ' + args.per if args.per else ''} ({window})")
    for col in (*group, "GPU-hours", *outcomes, "started", "avg queue"):
        table.add_column(col, justify="left" if col in group else "right")
    for row in [*report["rows"], {**dict.fromkeys(group, ""), group[0]: "total", **report["total"]}]:
        table.add_row(
            *(plain(row[k]) for k in group),
            f"{row['gpu_hours']:,.2f}",
            *(f"{row['jobs'][o]:,}" for o in outcomes),
            f"{row['started']:,}",
            "-" if row["avg_queue_s"] is None else f"{row['avg_queue_s']:,.1f}s",
        )
    console.print(table)
    if report["running"]:
        console.print(f"[dim]{report['running']} jobs still hold GPUs: their use counts up to the log's end[/dim]")
    return 0


def fmt_day(at: float | None) -> str:
    import datetime as dt

    if at is None:
        return "..."
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M")


_FOLDED = frozenset({"job", "name", "user", "vc", "nodes", "reason"})


def cmd_history(args: argparse.Namespace) -> int:
    if args.limit < 0:  # rows[-args.limit:] would drop the oldest instead
        raise GpuherdError(f"--limit takes the number of latest jobs to show (0: all), got {args.limit}")
    since, until = _window(args)
    finished = fold_log(args, Accounting(history=True)).finished or []
    states = set(args.state.split(",")) if args.state else None
    if states and not states <= set(ev.OUTCOMES):
        raise GpuherdError(f"--state takes {', '.join(ev.OUTCOMES)} (comma separated); got {args.state!r}")
    rows = [job for job in finished if _matches(job, args, since, until, states)]
    rows = rows[-args.limit :] if args.limit else rows
    if args.json:
        print_json(rows)
        return 0
    table = Table(title=f"finished jobs ({len(rows)})")
    columns = ("job", "name", "user", "vc", "state", "submitted", "start", "end", "elapsed", "gpus", "nodes")
    for col in (*columns, "exit", "GPU-h", "reason"):
        # (the id whole on one line: `why`/`logs` take it; names, nodes and reasons fold, never "…")
        table.add_column(col, no_wrap=col == "job", overflow="fold" if col in _FOLDED else "ellipsis")
    for job in rows:
        elapsed = "" if job.start is None else f"{job.end - job.start:,.0f}s"
        cells = (
            job.job,
            job.name,
            job.user,
            job.vc,
            job.state,
            fmt_datetime(job.submitted),
            fmt_datetime(job.start),
            fmt_datetime(job.end),
            elapsed,
            str(job.gpus),
            ",".join(job.nodes),
            "" if job.exit_code is None else str(job.exit_code),
            f"{job.gpu_seconds / 3600:.3f}",
            job.reason,
        )
        table.add_row(*map(plain, cells))
    console.print(table)
    return 0


def _matches(
    job: FinishedJob, args: argparse.Namespace, since: float | None, until: float | None, states: set[str] | None
) -> bool:
    return (
        (args.user is None or job.user == args.user)
        and (args.vc is None or job.vc == args.vc)
        and (args.workflow is None or job.workflow == args.workflow)
        and (states is None or job.state in states)
        and (since is None or job.end >= since)
        and (until is None or job.end < until)
    )


def add_commands(sub: Any) -> None:
    u = sub.add_parser("usage", help="GPU-hours, jobs by how they ended and average queueing, from the log")
    u.add_argument("--by", default="vc", help="vc, user, or vc,user (default vc)")
    u.add_argument("--since", help="from this time (2024-05-01, 2024-05-01T12:00 UTC, or 7d ago)")
    u.add_argument("--until", help="until this time (same forms)")
    u.add_argument("--per", choices=("hour", "day", "week"), help="one row per hour, day or ISO week (UTC)")
    u.add_argument("--log", help="a log file (a simulation's events.jsonl) instead of the live log")
    fmt = u.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fmt.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    u.set_defaults(func=cmd_usage)

    h = sub.add_parser("history", help="finished jobs: start, end, GPUs, nodes, exit (like sacct)")
    h.add_argument("--user", help="only this user's jobs")
    h.add_argument("--vc", help="only this virtual cluster's jobs")
    h.add_argument("--workflow", help="a workflow's id")
    h.add_argument("--since", help="ended from this time (2024-05-01, ..., or 7d ago)")
    h.add_argument("--until", help="ended before this time")
    h.add_argument("--state", help=f"only these ends, comma separated: {', '.join(ev.OUTCOMES)}")
    h.add_argument("--limit", type=int, default=200, help="the latest N (0: all)")
    h.add_argument("--log", help="a log file (a simulation's events.jsonl) instead of the live log")
    h.add_argument("--json", action="store_true", help="print JSON instead of a table")
    h.set_defaults(func=cmd_history)
