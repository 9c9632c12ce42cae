"""Jobs: ``submit``, ``jobs``, ``why``, ``cancel``, ``logs`` (also of arrays and workflows)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import typing
from typing import Any, NamedTuple

import msgspec
from rich.progress import Progress
from rich.table import Table

from apps.cli.common import (
    Folding,
    LogReader,
    client_call,
    console,
    each_record,
    fmt_datetime,
    fmt_time,
    log_state,
    open_cli_log,
    parse_duration,
    plain,
    print_json,
    read_log,
)
from apps.registry import make_decider
from gpuherd import events as ev
from gpuherd.client import load_spec_file
from gpuherd.errors import GpuherdError
from gpuherd.fold import TERMINAL, ClusterState, JobState, JobStatus
from gpuherd.output import fetch_output
from services.scheduler.explain import NEXT_PASS, NEXT_PASS_WHY, Wait, WaitFinder, WaitReplay
from services.scheduler.forecast import forecast_starts


def why_waiting(scheduler: Any, state: Any, *, forecast: bool = True) -> tuple[str, dict[str, Any], dict[str, float]]:
    """The policy in force, why each waiting job waits (the scheduler's own pass, on the state its
    own fold makes of the log), and when each is expected to start (``forecast_starts``)."""
    policy = scheduler.policy_for(state)
    if not state.queue:
        return policy.name, {}, {}
    starts = forecast_starts(state, policy) if forecast else {}
    return policy.name, scheduler.plan(state).pending, starts


def _in(at: float | None, now: float) -> str:
    return "?" if at is None else f"in {max(0.0, at - now):,.0f}s"


def _starts_in(at: float | None, now: float) -> str:
    if at is None:  # (a job of unknown duration ahead of it, or more passes away than the forecast looks)
        return "no forecast"
    return f"{fmt_time(at)} (in {max(0.0, at - now):,.0f}s)"


def where_it_is(job: JobState) -> str:
    """Why a job is where it is now ("" if nothing says): an ended job's end, a placed or running
    one's placement, a waiting one's return to the queue. (``job.reason`` keeps the last requeue's
    reason once the job is placed again: "running: node n1 lost" told of an attempt that had ended.)"""
    if job.status in TERMINAL or job.status == "pending":
        return job.reason
    return job.placement_reason


def parse_depends(text: str) -> dict[str, list[str]]:
    """``--depends afterok:ID[:ID...][,afterany:ID...]`` (Slurm's ``--dependency``) as a spec's ``depends_on``."""
    out: dict[str, list[str]] = {}
    for part in text.split(","):
        kind, _, ids = part.strip().partition(":")
        if kind not in ev.DEPENDENCY_KINDS or not ids:
            raise GpuherdError(
                f"--depends takes KIND:ID[:ID...] separated by commas, KIND one of {', '.join(ev.DEPENDENCY_KINDS)}; "
                f"got {part!r}"
            )
        out.setdefault(kind, []).extend(i for i in ids.split(":") if i)
    return out


def spec_with_options(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The file's spec with what the command line adds (dependencies, a time limit, an array)."""
    given = {
        "depends_on": parse_depends(args.depends) if args.depends else None,
        "time_limit_s": parse_duration(args.time_limit) if args.time_limit else None,
        "kill_on_invalid_dep": False if args.keep_on_invalid_dep else None,
    }
    if args.array is not None or args.array_values is not None:
        array: dict[str, Any] = {}
        if args.array is not None:
            array["count"] = args.array
        if args.array_values is not None:
            array["values"] = args.array_values.split(",")
        if args.max_running is not None:
            array["max_running"] = args.max_running
        given["array"] = array
    elif args.max_running is not None:
        raise GpuherdError("--max-running limits an array: give --array N or --array-values too")
    given = {k: v for k, v in given.items() if v is not None}
    if given and ("workflow" in spec or "steps" in spec):
        raise GpuherdError(f"{', '.join(given)}: for a workflow, give them in its steps")
    return spec | given


def cmd_submit(args: argparse.Namespace) -> int:
    spec = spec_with_options(load_spec_file(args.file), args)
    verdict = client_call(args, lambda c: c.submit_verdict(spec, timeout=args.timeout), source=args.source)
    if args.json:
        print_json({k: v for k, v in msgspec.to_builtins(verdict).items() if v is not None})
        return 0
    # A duplicate is the submission made earlier under this intake id, not this one: say so.
    done = "already submitted as" if verdict.duplicate else "submitted"
    if verdict.workflow is not None:
        steps = ", ".join(f"{name} {' '.join(ids)}" for name, ids in (verdict.steps or {}).items())
        console.print(f"{done} workflow [bold]{plain(verdict.workflow)}[/bold]: {plain(steps)}", highlight=False)
    elif verdict.array is not None:
        ids = verdict.job_ids or []
        console.print(
            f"{done} array [bold]{plain(verdict.array)}[/bold]: {len(ids)} jobs {plain(ids[0])} .. {plain(ids[-1])}"
        )
    else:
        console.print(f"{done} [bold]{plain(verdict.job_id)}[/bold]")
    return 0


def members(state: ClusterState, group: str) -> list[JobState]:
    """The jobs of an array or a workflow (by its id, or a workflow by its name), in submission order."""
    found = [
        j
        for j in state.jobs.values()
        if (j.spec.array_of is not None and j.spec.array_of.array == group)
        or (j.spec.workflow_of is not None and group in (j.spec.workflow_of.workflow, j.spec.workflow_of.name))
    ]
    workflows = {j.spec.workflow_of.workflow for j in found if j.spec.workflow_of is not None}
    if len(workflows) > 1:
        live = {j.spec.workflow_of.workflow for j in found if j.spec.workflow_of and j.status not in TERMINAL}
        if len(live) != 1:
            raise GpuherdError(
                f"{len(workflows)} workflows are named {group!r} ({', '.join(sorted(workflows))}): give its id"
            )
        found = [j for j in found if j.spec.workflow_of is not None and j.spec.workflow_of.workflow in live]
    return sorted(found, key=lambda j: j.order)


def _ended(job: JobState) -> str:
    """An ended job's final state, and why where the log says more than the state's name."""
    reason = job.reason.strip()
    return f"{job.status}: {reason}" if reason and reason != job.status else job.status


def cmd_cancel(args: argparse.Namespace) -> int:
    """A job, or every unfinished job of an array or a workflow."""

    if client_call(args, lambda c: c.job_exists(args.job)):
        state = log_state(args)
        job = state.jobs.get(args.job)
        if job is not None and job.status in TERMINAL:
            # (The scheduler would refuse it in the log, unseen: "cancel requested", exit 0, said otherwise.)
            raise GpuherdError(f"nothing to cancel: job {args.job} has already ended ({_ended(job)})")
        client_call(args, lambda c: c.cancel(args.job, args.reason))
        console.print(f"cancel requested for {plain(args.job)}")
        return 0
    state = log_state(args)
    jobs = members(state, args.job)
    if not jobs:
        raise GpuherdError(f"no job, array or workflow {args.job!r}: see `gpuherd jobs` for the ids")
    open_jobs = [j.job for j in jobs if j.status not in TERMINAL]
    if not open_jobs:  # (as of one job that has ended: nothing was asked of the scheduler)
        raise GpuherdError(f"nothing to cancel: the {len(jobs)} jobs of {args.job} have all ended")
    client_call(args, lambda c: c.cancel_jobs(open_jobs, args.reason))
    console.print(
        f"cancel requested for {len(open_jobs)} of the {len(jobs)} jobs of {plain(args.job)}: {', '.join(open_jobs)}"
    )
    return 0


class _JobWhy(NamedTuple):
    """What ``gpuherd why`` learns of a job from its two reads of the log."""

    job: JobState
    now: float  # the log's time at its end
    waiting: int  # jobs waiting at the log's end
    policy: str
    pending: Any  # why the scheduler's pass leaves it waiting (None: it does not wait, or is placed next)
    estimated_start: float | None
    waits: list[Wait]
    history: bool  # whether the waits are part of the answer (their reasons replayed)


async def _job_why(args: argparse.Namespace, progress: Progress) -> _JobWhy:
    """Two reads of the log, a record at a time (nothing of it is held, whatever its length): the
    first finds the job's waits, the second folds the log as the scheduler does and replays its pass
    within them. The waits are the answer for a job that waits no more, or that the pass would place
    (a third read where the second did not replay them), and with ``--history``; a job waiting at
    the log's end is otherwise answered by its pass now."""
    history = getattr(args, "history", False)
    async with LogReader.open(args) as reader:
        finder = WaitFinder(args.job)
        await each_record(reader, finder.see, progress, "finding its waits")
        if not finder.windows:
            raise GpuherdError(f"no job {args.job!r}: see `gpuherd jobs` for the ids")
        replayed = finder.windows[-1].end is not None or history  # (where the waits are likely the answer)
        replay = WaitReplay(args.job, finder.windows, replay_passes=replayed)
        await each_record(reader, replay.fold, progress, "replaying its waits" if replayed else "folding the log")
        state, decider, job = replay.state, replay.decider, replay.job_state
        if job is None:  # (its submission was one the fold ignores: a job id the log held already)
            raise GpuherdError(f"no job {args.job!r} was ever held: see `gpuherd events` for its submission")
        pending, start, policy = None, None, ""
        if job.status == "pending":
            policy_in_force = decider.policy_for(state)
            policy = policy_in_force.name
            pending = decider.plan(state).pending.get(job.job)
            start = forecast_starts(state, policy_in_force, [job.job]).get(job.job)
        show = pending is None or history
        if show and not replayed:
            replay = WaitReplay(args.job, finder.windows)
            await each_record(reader, replay.fold, progress, "replaying its waits")
        return _JobWhy(job, state.now, len(state.queue), policy, pending, start, replay.waits() if show else [], show)


def cmd_why(args: argparse.Namespace) -> int:
    # (on a terminal only: piped, a finished bar left an empty line before the answer)
    with Progress(console=console, transient=True, disable=args.json or not console.is_terminal) as progress:
        found = asyncio.run(_job_why(args, progress))
    job, pending = found.job, found.pending
    answer: dict[str, Any] = {"job": job.job, "status": job.status, "attempt": job.attempt}
    if pending is not None:
        answer |= {
            "kind": pending.kind,
            "why": pending.detail,
            "position": pending.position,
            "waiting": found.waiting,
            "policy": found.policy,
            "estimated_start": found.estimated_start,
        }
    elif job.status == "pending":
        answer["why"] = NEXT_PASS_WHY
    else:
        answer["why"] = where_it_is(job) or job.status
    # "Why did my job wait?": a job that waits no more is answered by its waits, replayed (a waiting
    # one by the pass above; with --history, by its waits so far too).
    waits = found.waits
    if args.json:
        print_json(answer | ({"waits": msgspec.to_builtins(waits)} if found.history else {}))
        return 0
    if pending is not None:
        console.print(
            f"{plain(job.job)} ({plain(job.spec.name)}) waits: "
            f"[bold]{plain(pending.kind)}[/bold] - {plain(pending.detail)}\n"
            f"position {pending.position} of {found.waiting} waiting jobs in {found.policy} order; "
            f"waiting {found.now - job.waiting_since:.0f}s\n"
            f"expected to start: {_starts_in(found.estimated_start, found.now)}"
        )
    else:
        # (the reason only where it says more than the status: a completed job has none, "completed: completed")
        why = "" if answer["why"].strip() in ("", job.status) else f": {plain(answer['why'])}"
        console.print(f"{plain(job.job)} ({plain(job.spec.name)}) is {job.status}{why}")
    _print_waits(waits)
    return 0


def _print_waits(waits: list[Wait]) -> None:
    """Each wait of a job: when, how it ended, and the scheduler's reasons through it."""
    for n, wait in enumerate(waits, 1):
        until = wait.until
        lasted = f"{until - wait.since:,.0f}s" if until is not None else "so far"
        head = f"wait {n}" + (f" (attempt {wait.attempt})" if wait.attempt else "")
        if until is not None and until - wait.since < 1.0 and all(s.kind == NEXT_PASS for s in wait.spans):
            console.print(f"{head}: none - {plain(wait.ended_by)} on the pass after it was queued ({fmt_time(until)})")
            continue
        when = fmt_datetime if (until or wait.since) - wait.since >= 86400 else fmt_time  # (a date once it spans days)
        console.print(
            f"{head}: {fmt_datetime(wait.since)} -> {fmt_datetime(until) if until is not None else 'now'} ({lasted}); "
            f"{plain(wait.ended_by)}"
        )
        if wait.placed_by:
            console.print(f"  placed by {plain(wait.placed_by)}")
        if not wait.spans:
            continue
        sampled = wait.passes_replayed < wait.passes_in_wait
        table = Table(
            title=f"the scheduler's reasons, from {wait.passes_replayed:,} passes replayed"
            + (f" (of {wait.passes_in_wait:,}, evenly spread)" if sampled else ""),
            title_justify="left",
        )
        for col, style in (("from", {}), ("for", {"justify": "right"}), ("reason", {}), ("what it said", TEXT_COLUMN)):
            table.add_column(col, **style)
        for span in wait.spans:
            said = plain(span.detail)
            if span.last_detail != span.detail:
                said += f" ... last: {plain(span.last_detail)}"
            table.add_row(when(span.start), f"{span.end - span.start:,.0f}s", plain(span.kind), said)
        console.print(table)


# An id is whole on one line, whatever the width (`why`, `logs`, `cancel` take it: "j93…" could not be
# copied); names, node lists and reasons fold rather than end in an ellipsis.
ID_COLUMN: dict[str, Any] = {"no_wrap": True, "overflow": "fold"}
TEXT_COLUMN: dict[str, Any] = {"overflow": "fold"}
COLUMN_STYLE: dict[str, dict[str, Any]] = {"job": ID_COLUMN} | dict.fromkeys(
    ("name", "user", "vc", "nodes", "why"), TEXT_COLUMN
)

STATUSES: tuple[str, ...] = typing.get_args(JobStatus)


def _statuses_asked(text: str | None) -> frozenset[str] | None:
    """The statuses of ``jobs --status`` (comma separated; None: every job's). One no job can have
    is refused, naming those there are: it matched nothing, an empty table that read as "no such jobs"."""
    if not text:
        return None
    asked = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(asked - set(STATUSES))
    if unknown or not asked:
        raise GpuherdError(
            f"--status: no job status {', '.join(map(repr, unknown)) or repr(text)}; "
            f"the statuses are {', '.join(STATUSES)} (comma separated)"
        )
    return asked


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.limit < 0:  # jobs[-args.limit:] would drop the first jobs instead
        raise GpuherdError(f"--limit takes the number of latest jobs to show (0: all), got {args.limit}")
    statuses = _statuses_asked(args.status)  # (before the log is read: a typo is no empty table)
    # (One read, folded two ways: every job the log held, and the queue as the scheduler's pass sees it.)
    core, queue = Folding(), Folding(make_decider("scheduler"))
    read_log(args, core.take, queue.take)
    state = core.state
    _, pending, starts = why_waiting(queue.decider, queue.state, forecast=statuses is None or "pending" in statuses)
    if args.workflow or args.array:
        jobs = members(state, args.workflow or args.array)
        if not jobs:
            what = "workflow" if args.workflow else "array"
            raise GpuherdError(f"no {what} {args.workflow or args.array!r}: see `gpuherd jobs` for the ids")
    else:
        jobs = sorted(state.jobs.values(), key=lambda j: j.order)
    if statuses is not None:
        jobs = [j for j in jobs if j.status in statuses]
    if args.json:
        out = [msgspec.to_builtins(j) for j in jobs]
        for row, j in zip(out, jobs, strict=True):
            if j.status == "pending":
                row["estimated_start"] = starts.get(j.job)
        print_json(out)
        return 0
    title = f"jobs ({len(jobs)})"
    if args.workflow and jobs and jobs[0].spec.workflow_of is not None:
        title = f"workflow {jobs[0].spec.workflow_of.name} ({jobs[0].spec.workflow_of.workflow}): {len(jobs)} jobs"
    table = Table(title=plain(title))
    columns = ("job", "name", "user", "vc", "gpus", "status", "attempt", "submitted", "waited s", "starts")
    for col in (*columns, "nodes", "why"):
        table.add_column(col, **COLUMN_STYLE.get(col, {}))
    for j in jobs[-args.limit :]:
        waited = (j.first_placed_at or state.now) - j.submitted_at
        nodes = ",".join(a.node for a in j.allocations)
        why = where_it_is(j)
        if j.job in pending:
            p = pending[j.job]
            why = f"#{p.position} {p.kind}: {p.detail}"
        if j.spec.depends_on is not None and j.status == "pending" and j.job not in pending:
            why = "depends on " + ", ".join(f"{k}:{':'.join(ids)}" for k, ids in j.spec.depends_on.kinds() if ids)
        gpus = str(j.gpus)
        if j.spec.elastic is not None:  # elastic: GPUs now, and its range
            gpus = f"{len(j.workers) if j.allocations else j.gpus} ({j.spec.elastic.min}..{j.spec.elastic.max})"
        cells = (
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
        table.add_row(*map(plain, cells))
    console.print(table)
    return 0


def _no_job_output(state: ClusterState, name: str) -> str:
    """Why ``gpuherd logs NAME`` has nothing to show for a name that is no job: an array's or a
    workflow's output is its jobs', one by one; anything else is no id at all."""
    group = members(state, name)
    if not group:
        return f"no job {name!r}: see `gpuherd jobs` for the ids"
    first = group[0]
    if first.spec.array_of is not None and first.spec.array_of.array == name:
        what, listing = f"an array of {len(group)} jobs", f"gpuherd jobs --array {name}"
    else:
        what, listing = f"a workflow of {len(group)} steps", f"gpuherd jobs --workflow {name}"
    ids = ", ".join(j.job for j in group[:5]) + (", ..." if len(group) > 5 else "")
    return (
        f"{name} is {what} ({ids}), not a job: see each job's output with `gpuherd logs JOB`, "
        f"e.g. `gpuherd logs {first.job}`; `{listing}` lists them"
    )


def cmd_logs(args: argparse.Namespace) -> int:
    """A job's output, fetched from the agents of the nodes its attempts ran on."""

    async def run() -> list[dict[str, Any]]:
        log_ = await open_cli_log(args)
        try:
            # (Read a record at a time: only the job's placements are kept, and a second read folds
            # the log only for a job that has none.)
            last = await log_.last_seq()
            placed = [
                record.event
                async for record in log_.read(1, stop=last)
                if isinstance(record.event, ev.JobPlaced) and record.event.job == args.job
            ]
            if not placed:
                core = Folding()
                async for record in log_.read(1, stop=last):
                    core.take(record)
                state = core.state
                job = state.jobs.get(args.job)
                if job is None:
                    raise GpuherdError(_no_job_output(state, args.job))
                now = _ended(job) if job.status in TERMINAL else job.status
                raise GpuherdError(f"job {args.job} has never been placed (it is {now}), so it has no output")
            if args.attempt is not None:
                attempts = sorted({p.attempt for p in placed})
                placed = [p for p in placed if p.attempt == args.attempt]
                if not placed:
                    raise GpuherdError(
                        f"job {args.job} has no attempt {args.attempt}; its attempts: "
                        + ", ".join(str(a) for a in attempts)
                    )
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
            console.print(f"[yellow]== {plain(header)}: {plain(answer.get('error'))}[/yellow]")
            continue
        files = answer["attempts"].get(str(answer["attempt"]), {})
        if not files:
            console.print(f"[dim]== {plain(header)}: no output[/dim]")
        for name, text in files.items():
            console.print(f"[bold]== {plain(header)}: {plain(name)}[/bold]")
            sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
            sys.stdout.flush()
    return 0


def add_commands(sub: Any) -> None:
    s = sub.add_parser("submit", help="submit a job spec, an array or a workflow (JSON or YAML) through intake")
    s.add_argument("file", help="a job spec, array or workflow: JSON or YAML (see examples/)")
    s.add_argument("--depends", help="KIND:ID[:ID...][,KIND:ID...], KIND afterok, afterany, afternotok or after")
    s.add_argument(
        "--keep-on-invalid-dep",
        action="store_true",
        help="keep waiting when a dependency can no longer be met (default: cancelled)",
    )
    s.add_argument("--time-limit", help="its run time per attempt, e.g. 3600, 90m, 2h, 1-00:00:00")
    s.add_argument("--array", type=int, help="an array of N jobs, <name>[i] (GPUHERD_ARRAY_INDEX=i)")
    s.add_argument("--array-values", help="an array of one job per value, comma separated (GPUHERD_ARRAY_VALUE)")
    s.add_argument("--max-running", type=int, help="an array's elements placed or running at once")
    s.add_argument("--source", default="cli", help="intake source (herd.intake.<source>)")
    s.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for intake's verdict")
    s.add_argument("--json", action="store_true", help="print the verdict as JSON")
    s.set_defaults(func=cmd_submit)

    j = sub.add_parser("jobs", help="list jobs and why they wait")
    j.add_argument(
        "--status", default=None, help=f"only jobs of these statuses, comma separated: {', '.join(STATUSES)}"
    )
    j.add_argument("--workflow", default=None, help="only this workflow's jobs (its id, or its name)")
    j.add_argument("--array", default=None, help="only this array's jobs (its id)")
    j.add_argument("--limit", type=int, default=50, help="the latest N (0: all)")
    j.add_argument("--json", action="store_true", help="print JSON instead of a table")
    j.set_defaults(func=cmd_jobs)

    c = sub.add_parser("cancel", help="cancel a job, or the unfinished jobs of an array or a workflow")
    c.add_argument("job", help="a job id, an array id, or a workflow id (or name)")
    c.add_argument("--reason", default="cancelled by user", help="recorded with the cancellation")
    c.set_defaults(func=cmd_cancel)

    w = sub.add_parser("why", help="why a job waits, or why it waited: the scheduler's own pass, replayed")
    w.add_argument("job", help="a job id (see `gpuherd jobs`)")
    w.add_argument(
        "--history", action="store_true", help="a waiting job: also its waits so far (a job that waits no more: always)"
    )
    w.add_argument("--log", help="a log file (a simulation's events.jsonl) instead of the live log")
    w.add_argument("--json", action="store_true", help="print JSON instead of text")
    w.set_defaults(func=cmd_why)

    lg = sub.add_parser("logs", help="a job's output, from the agents it ran on")
    lg.add_argument("job", help="a job id (see `gpuherd jobs`)")
    lg.add_argument("--attempt", type=int, default=None, help="only this attempt (default: all)")
    lg.add_argument("--bytes", type=int, default=65536, help="the last N bytes of each rank's log")
    lg.add_argument("--json", action="store_true", help="print JSON instead of text")
    lg.set_defaults(func=cmd_logs)
