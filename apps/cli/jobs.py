"""Jobs: ``submit``, ``jobs``, ``why``, ``cancel``, ``logs``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import msgspec
from rich.table import Table

from apps.cli.common import client_call, console, fmt_time, open_cli_log, print_json, read_cluster
from apps.registry import make_decider, replay_state
from gpuherd import events as ev
from gpuherd.client import load_spec_file
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from gpuherd.output import fetch_output
from services.scheduler.forecast import forecast_starts


def why_waiting(records: list[Record], *, forecast: bool = True) -> tuple[str, dict[str, Any], dict[str, float]]:
    """The policy in force, why each waiting job waits (the scheduler's own pass, on the state its
    own fold makes of the log), and when each is expected to start (``forecast_starts``)."""
    scheduler = make_decider("scheduler")
    state = replay_state(scheduler, records)
    policy = scheduler.policy_for(state)
    if not state.queue:
        return policy.name, {}, {}
    starts = forecast_starts(state, policy) if forecast else {}
    return policy.name, scheduler.plan(state).pending, starts


def _in(at: float | None, now: float) -> str:
    return "?" if at is None else f"in {max(0.0, at - now):,.0f}s"


def _starts_in(at: float | None, now: float) -> str:
    if at is None:
        return "unknown (it waits for a job of unknown duration)"
    return f"{fmt_time(at)} (in {max(0.0, at - now):,.0f}s)"


def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec_file(args.file)
    job_id = client_call(args, lambda c: c.submit(spec, timeout=args.timeout), source=args.source)
    if args.json:
        print_json({"ok": True, "job_id": job_id})
    else:
        console.print(f"submitted [bold]{job_id}[/bold]")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    client_call(args, lambda c: c.cancel(args.job, args.reason))
    console.print(f"cancel requested for {args.job}")
    return 0


def cmd_why(args: argparse.Namespace) -> int:
    state, records = read_cluster(args)
    job = state.jobs.get(args.job)
    if job is None:
        raise GpuherdError(f"no job {args.job!r}: see `gpuherd jobs` for the ids")
    policy, why, starts = why_waiting(records) if job.status == "pending" else ("", {}, {})
    pending = why.get(job.job)
    answer: dict[str, Any] = {"job": job.job, "status": job.status, "attempt": job.attempt}
    if pending is not None:
        answer |= {
            "kind": pending.kind,
            "why": pending.detail,
            "position": pending.position,
            "waiting": len(state.queue),
            "policy": policy,
            "estimated_start": starts.get(job.job),
        }
    elif job.status == "pending":
        answer["why"] = "nothing holds it back: it is placed on the scheduler's next pass"
    else:
        answer["why"] = job.reason or job.placement_reason or job.status
    if args.json:
        print_json(answer)
        return 0
    if pending is not None:
        console.print(
            f"{job.job} ({job.spec.name}) waits: [bold]{pending.kind}[/bold] - {pending.detail}\n"
            f"position {pending.position} of {len(state.queue)} waiting jobs in {policy} order; "
            f"waiting {state.now - job.waiting_since:.0f}s\n"
            f"expected to start: {_starts_in(starts.get(job.job), state.now)}"
        )
    else:
        console.print(f"{job.job} ({job.spec.name}) is {job.status}: {answer['why']}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    state, records = read_cluster(args)
    _, pending, starts = why_waiting(records, forecast=args.status in (None, "pending"))
    jobs = sorted(state.jobs.values(), key=lambda j: j.order)
    if args.status:
        jobs = [j for j in jobs if j.status == args.status]
    if args.json:
        out = [msgspec.to_builtins(j) for j in jobs]
        for row, j in zip(out, jobs, strict=True):
            if j.status == "pending":
                row["estimated_start"] = starts.get(j.job)
        print_json(out)
        return 0
    table = Table(title=f"jobs ({len(jobs)})")
    columns = ("job", "name", "user", "vc", "gpus", "status", "attempt", "submitted", "waited s", "starts")
    for col in (*columns, "nodes", "why"):
        table.add_column(col)
    for j in jobs[-args.limit :]:
        waited = (j.first_placed_at or state.now) - j.submitted_at
        nodes = ",".join(a.node for a in j.allocations)
        why = j.reason or j.placement_reason
        if j.job in pending:
            p = pending[j.job]
            why = f"#{p.position} {p.kind}: {p.detail}"
        gpus = str(j.gpus)
        if j.spec.elastic is not None:  # elastic: GPUs now, and its range
            gpus = f"{len(j.workers) if j.allocations else j.gpus} ({j.spec.elastic.min}..{j.spec.elastic.max})"
        table.add_row(
            j.job,
            j.spec.name,
            j.spec.user,
            j.spec.vc,
            gpus,
            j.status,
            str(j.attempt),
            fmt_time(j.submitted_at),
            f"{waited:.1f}",
            _in(starts.get(j.job), state.now) if j.status == "pending" else "",
            nodes,
            why,
        )
    console.print(table)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """A job's output, fetched from the agents of the nodes its attempts ran on."""

    async def run() -> list[dict[str, Any]]:
        log_ = await open_cli_log(args)
        try:
            placed = [
                r.event for r in await log_.read_all() if isinstance(r.event, ev.JobPlaced) and r.event.job == args.job
            ]
            if not placed:
                raise GpuherdError(f"job {args.job} has never been placed, so it has no output yet")
            if args.attempt is not None:
                placed = [p for p in placed if p.attempt == args.attempt]
            placements = [(p.attempt, [a.node for a in p.allocations]) for p in placed]
            answers = await fetch_output(log_, args.job, placements, max_bytes=args.bytes)
            return answers
        finally:
            await log_.close()

    answers = asyncio.run(run())
    if args.json:
        print_json(answers)
        return 0
    for answer in answers:
        header = f"attempt {answer['attempt']} on {answer['node']}"
        if not answer.get("ok"):
            console.print(f"[yellow]== {header}: {answer.get('error')}[/yellow]")
            continue
        files = answer["attempts"].get(str(answer["attempt"]), {})
        if not files:
            console.print(f"[dim]== {header}: no output[/dim]")
        for name, text in files.items():
            console.print(f"[bold]== {header}: {name}[/bold]")
            sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
            sys.stdout.flush()
    return 0


def add_commands(sub: Any) -> None:
    s = sub.add_parser("submit", help="submit a job spec (JSON or YAML) through intake")
    s.add_argument("file")
    s.add_argument("--source", default="cli", help="intake source (herd.intake.<source>)")
    s.add_argument("--timeout", type=float, default=30.0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_submit)

    j = sub.add_parser("jobs", help="list jobs and why they wait")
    j.add_argument("--status", default=None)
    j.add_argument("--limit", type=int, default=50)
    j.add_argument("--json", action="store_true")
    j.set_defaults(func=cmd_jobs)

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job")
    c.add_argument("--reason", default="cancelled by user")
    c.set_defaults(func=cmd_cancel)

    w = sub.add_parser("why", help="why a job waits (or where it is), from the scheduler's own pass")
    w.add_argument("job")
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=cmd_why)

    lg = sub.add_parser("logs", help="a job's output, from the agents it ran on")
    lg.add_argument("job")
    lg.add_argument("--attempt", type=int, default=None, help="only this attempt (default: all)")
    lg.add_argument("--bytes", type=int, default=65536, help="the last N bytes of each rank's log")
    lg.add_argument("--json", action="store_true")
    lg.set_defaults(func=cmd_logs)
