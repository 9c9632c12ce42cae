"""The ``gpuherd`` command: start a cluster, submit, look, cancel, replay and audit.

Tables for people; ``--json`` for machines. The NATS address comes from
``--nats-url``, else ``NATS_URL``, else the cluster file that ``gpuherd up``
writes in its data folder, else nats://127.0.0.1:4222.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from rich.console import Console
from rich.table import Table

from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.state import ClusterState, fold

console = Console()
DEFAULT_DATA_DIR = ".gpuherd"
CLUSTER_FILE = "cluster.json"

# Deciders the audit can re-run, named by import path so this library never imports a service.
AUDITABLE = {
    "scheduler": "services.scheduler.decide:SchedulerDecider",
    "elastic": "services.elastic.decide:ElasticDecider",
    "memory": "services.memory.decide:MemoryDecider",
}


def nats_url_of(args: argparse.Namespace) -> str:
    if getattr(args, "nats_url", None):
        return args.nats_url
    if os.environ.get("NATS_URL"):
        return os.environ["NATS_URL"]
    cluster = Path(getattr(args, "data_dir", DEFAULT_DATA_DIR)) / CLUSTER_FILE
    if cluster.exists():
        return msgspec.json.decode(cluster.read_bytes())["nats_url"]
    return "nats://127.0.0.1:4222"


def load_decider(name: str, policy: str | None = None) -> Any:
    """The decider ``name``; ``policy`` is its default until the log records one (fifo if None)."""
    try:
        target = AUDITABLE[name]
    except KeyError:
        raise GpuherdError(f"no decider named {name!r}; auditable: {', '.join(AUDITABLE)}") from None
    module, cls = target.split(":")
    decider_cls = getattr(importlib.import_module(module), cls)
    if name != "scheduler":
        return decider_cls()  # its default parameters
    policy_mod = importlib.import_module("services.scheduler.policy")
    return decider_cls(policy_mod.make_policy(policy or "fifo"))


async def open_cli_log(args: argparse.Namespace):
    from gpuherd.log import open_log

    try:
        return await asyncio.wait_for(open_log(nats_url_of(args), name="gpuherd-cli", persistent=False), 10)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise GpuherdError(
            f"cannot reach NATS at {nats_url_of(args)}: is `gpuherd up` running, or NATS_URL set? ({exc})"
        ) from None


def read_records(args: argparse.Namespace) -> list[Any]:
    """The whole log: from ``--log FILE`` when given (a simulation's), else from NATS."""
    return asyncio.run(_state(args))[1]


async def _state(args: argparse.Namespace) -> tuple[ClusterState, list[Any]]:
    if getattr(args, "log", None):
        from gpuherd.log.files import read_log_file

        records = read_log_file(args.log)
        return fold((r.seq, r.event) for r in records), records
    log_ = await open_cli_log(args)
    try:
        records = await log_.read_all()
    finally:
        await log_.close()
    return fold((r.seq, r.event) for r in records), records


def _print_json(data: Any) -> None:
    sys.stdout.write(msgspec.json.encode(data).decode() + "\n")


def _fmt_time(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


# -- commands ------------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    from gpuherd.client import Client, load_spec_file

    async def run() -> int:
        spec = load_spec_file(args.file)
        client = await Client.connect(nats_url_of(args), source=args.source)
        try:
            job_id = await client.submit(spec, timeout=args.timeout)
        finally:
            await client.close()
        if args.json:
            _print_json({"ok": True, "job_id": job_id})
        else:
            console.print(f"submitted [bold]{job_id}[/bold]")
        return 0

    return asyncio.run(run())


def cmd_cancel(args: argparse.Namespace) -> int:
    from gpuherd.client import Client

    async def run() -> int:
        client = await Client.connect(nats_url_of(args), source="cli")
        try:
            await client.cancel(args.job, args.reason)
        finally:
            await client.close()
        console.print(f"cancel requested for {args.job}")
        return 0

    return asyncio.run(run())


def _pending_reasons(state: ClusterState, policy: str = "fifo") -> dict[str, Any]:
    """Why each waiting job waits: the scheduler's own scheduling pass on this state."""
    if not state.queue:
        return {}
    return load_decider("scheduler", policy).plan(state).pending


def _client_call(args: argparse.Namespace, call) -> None:
    from gpuherd.client import Client

    async def run() -> None:
        client = await Client.connect(nats_url_of(args), source="cli")
        try:
            await call(client)
        finally:
            await client.close()

    asyncio.run(run())


def cmd_vc(args: argparse.Namespace) -> int:
    if args.vc_command == "set":
        quota = None if args.quota in (None, "none") else int(args.quota)
        _client_call(
            args,
            lambda c: c.configure_vc(args.name, gpu_quota=quota, can_borrow=not args.no_borrow, weight=args.weight),
        )
        console.print(
            f"VC {args.name}: quota {quota if quota is not None else 'none'}, "
            f"{'may not' if args.no_borrow else 'may'} borrow, weight {args.weight}"
        )
        return 0
    state, _ = asyncio.run(_state(args))
    used = state.vc_usage()
    if args.json:
        _print_json([msgspec.to_builtins(v) | {"used": used.get(v.vc, 0)} for v in state.vcs.values()])
        return 0
    table = Table(title=f"virtual clusters ({len(state.vcs)})")
    for col in ("vc", "quota", "in use", "borrowing", "may borrow", "weight", "waiting", "past use (GPU-h)"):
        table.add_column(col)
    for vc in sorted(state.vcs.values(), key=lambda v: v.vc):
        in_use = used.get(vc.vc, 0)
        borrowing = sum(
            j.borrowed for j in state.jobs.values() if j.spec.vc == vc.vc and j.status in ("placed", "running")
        )
        waiting = sum(1 for j in state.queue if state.jobs[j].spec.vc == vc.vc)
        table.add_row(
            vc.vc,
            "-" if vc.gpu_quota is None else str(vc.gpu_quota),
            str(in_use),
            str(borrowing),
            "yes" if vc.can_borrow else "no",
            f"{vc.weight:g}",
            str(waiting),
            f"{state.past_usage(f'vc:{vc.vc}') / 3600:.1f}",
        )
    console.print(table)
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    policy_mod = importlib.import_module("services.scheduler.policy")
    if args.policy_command == "set":
        params = _name_values(args.param)
        from gpuherd.state import CLUSTER_PARAMS

        try:
            policy_mod.make_policy(args.name, {k: v for k, v in params.items() if k not in CLUSTER_PARAMS})
        except ValueError as exc:
            raise GpuherdError(f"{exc}; every policy also takes {', '.join(sorted(CLUSTER_PARAMS))}") from None
        _client_call(args, lambda c: c.configure_policy(args.name, backfill=not args.no_backfill, params=params))
        console.print(f"policy {args.name}{' without' if args.no_backfill else ' with'} backfill {params or ''}")
        return 0
    state, _ = asyncio.run(_state(args))
    config = state.scheduling
    _print_json(msgspec.to_builtins(config)) if args.json else console.print(
        f"policy {config.policy or 'fifo (default)'}, backfill {'on' if config.backfill else 'off'}, "
        f"params {config.params or '{}'}; available: {', '.join(sorted(policy_mod.POLICIES))}"
    )
    return 0


def cmd_elastic(args: argparse.Namespace) -> int:
    policy = importlib.import_module("services.elastic.policy")
    if args.elastic_command == "set":
        params = _name_values(args.param)
        try:
            policy.params_from(params)
        except ValueError as exc:
            raise GpuherdError(str(exc)) from None
        _client_call(args, lambda c: c.configure_elastic(params))
        console.print(f"elastic service parameters: {params}")
        return 0
    _, records = asyncio.run(_state(args))
    recorded = next((r.event.params for r in reversed(records) if isinstance(r.event, ev.ElasticConfigured)), {})
    params = msgspec.to_builtins(policy.params_from(recorded))
    _print_json(params) if args.json else console.print(f"elastic service parameters: {params}")
    return 0


def _name_values(items: list[str] | None) -> dict[str, float]:
    params = {}
    for item in items or []:
        key, _, value = item.partition("=")
        try:
            params[key] = float(value)
        except ValueError:
            raise GpuherdError(f"--param wants NAME=NUMBER, got {item!r}") from None
    return params


def cmd_drain(args: argparse.Namespace) -> int:
    undrain = args.command == "undrain"
    _client_call(args, lambda c: c.drain(args.node, getattr(args, "reason", ""), undrain=undrain))
    console.print(f"{'undrained' if undrain else 'drained'} {args.node}")
    return 0


def cmd_why(args: argparse.Namespace) -> int:
    state, _ = asyncio.run(_state(args))
    job = state.jobs.get(args.job)
    if job is None:
        raise GpuherdError(f"no job {args.job!r}: see `gpuherd jobs` for the ids")
    pending = _pending_reasons(state).get(job.job) if job.status == "pending" else None
    answer: dict[str, Any] = {"job": job.job, "status": job.status, "attempt": job.attempt}
    if pending is not None:
        answer |= {
            "kind": pending.kind,
            "why": pending.detail,
            "position": pending.position,
            "waiting": len(state.queue),
        }
        answer["policy"] = state.scheduling.policy or "fifo"
    elif job.status == "pending":
        answer["why"] = "nothing holds it back: it is placed on the scheduler's next pass"
    else:
        answer["why"] = job.reason or job.placement_reason or job.status
    if args.json:
        _print_json(answer)
        return 0
    if pending is not None:
        console.print(
            f"{job.job} ({job.spec.name}) waits: [bold]{pending.kind}[/bold] - {pending.detail}\n"
            f"position {pending.position} of {len(state.queue)} waiting jobs in {answer['policy']} order; "
            f"waiting {state.now - job.waiting_since:.0f}s"
        )
    else:
        console.print(f"{job.job} ({job.spec.name}) is {job.status}: {answer['why']}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    state, _ = asyncio.run(_state(args))
    pending = _pending_reasons(state)
    jobs = sorted(state.jobs.values(), key=lambda j: j.order)
    if args.status:
        jobs = [j for j in jobs if j.status == args.status]
    if args.json:
        _print_json([msgspec.to_builtins(j) for j in jobs])
        return 0
    table = Table(title=f"jobs ({len(jobs)})")
    for col in ("job", "name", "user", "vc", "gpus", "status", "attempt", "submitted", "waited s", "nodes", "why"):
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
            _fmt_time(j.submitted_at),
            f"{waited:.1f}",
            nodes,
            why,
        )
    console.print(table)
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    state, _ = asyncio.run(_state(args))
    nodes = sorted(state.nodes.values(), key=lambda n: n.node)
    if args.json:
        _print_json([msgspec.to_builtins(n) for n in nodes])
        return 0
    table = Table(title=f"nodes ({len(nodes)})")
    for col in ("node", "status", "executor", "rack", "gpus", "free", "jobs", "why"):
        table.add_column(col)
    for n in nodes:
        jobs = sorted({g.job for g in n.gpus if g.job})
        table.add_row(
            n.node,
            n.status,
            n.executor,
            n.rack,
            str(len(n.gpus)),
            str(len(n.free_gpus())),
            ",".join(jobs)[:60],
            "; ".join(
                [n.reason] * bool(n.reason)
                + [f"GPU {g.info.index}: {g.health_reason}" for g in n.gpus if not g.healthy]
            ),
        )
    console.print(table)
    return 0


def _matches(event: ev.Event, args: argparse.Namespace) -> bool:
    if args.job and getattr(event, "job", None) != args.job:
        return False
    if args.node:
        nodes = {getattr(event, "node", None)} | {a.node for a in getattr(event, "allocations", ())}
        if args.node not in nodes:
            return False
    return not (args.type and type(event).__name__ not in args.type.split(","))


def cmd_events(args: argparse.Namespace) -> int:
    if args.dead_letter:
        from gpuherd.cli_ops import cmd_dead_letters

        return cmd_dead_letters(args)

    async def run() -> int:
        log_ = await open_cli_log(args)
        try:
            start = 1
            if args.last and not args.follow:
                start = max(1, await log_.last_seq() - args.last + 1)
            async for record in log_.read(start, follow=args.follow):
                if not _matches(record.event, args):
                    continue
                if args.json:
                    _print_json({"seq": record.seq, **msgspec.to_builtins(record.event)})
                else:
                    data = msgspec.to_builtins(record.event)
                    kind = data.pop("type")
                    for key in ("id", "v", "at"):
                        data.pop(key, None)
                    console.print(
                        f"[dim]{record.seq:>6} {_fmt_time(record.event.at)}[/dim] [bold]{kind}[/bold] "
                        f"{msgspec.json.encode(data).decode()}",
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


def cmd_rescales(args: argparse.Namespace) -> int:
    from gpuherd.rescales import rescale_rows, rescale_table

    _, records = asyncio.run(_state(args))
    rows = rescale_rows(records, args.job)
    if args.json:
        _print_json(rows)
    else:
        console.print(rescale_table(rows, f"rescales of elastic jobs ({len(rows)})"))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """A job's output, fetched from the agents of the nodes its attempts ran on."""
    from gpuherd.errors import LogUnavailable

    async def run() -> int:
        log_ = await open_cli_log(args)
        try:
            placed = [
                r.event for r in await log_.read_all() if isinstance(r.event, ev.JobPlaced) and r.event.job == args.job
            ]
            if not placed:
                raise GpuherdError(f"job {args.job} has never been placed, so it has no output yet")
            if args.attempt is not None:
                placed = [p for p in placed if p.attempt == args.attempt]
            answers = []
            for event in placed:
                for alloc in event.allocations:
                    request = {"job": args.job, "attempt": event.attempt, "max_bytes": args.bytes}
                    try:
                        raw = await log_.request(f"{alloc.node}.logs", msgspec.json.encode(request), timeout=5)
                        answer = msgspec.json.decode(raw)
                    except LogUnavailable as exc:
                        answer = {"ok": False, "error": f"{exc}; its files are under the agent's data folder"}
                    answers.append({"node": alloc.node, "attempt": event.attempt, **answer})
        finally:
            await log_.close()
        if args.json:
            _print_json(answers)
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

    return asyncio.run(run())


def cmd_replay(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from gpuherd.audit import audit

    _, records = asyncio.run(_state(args))
    if not args.audit:
        state = fold((r.seq, r.event) for r in records)
        summary = {
            "events": len(records),
            "jobs": len(state.jobs),
            "nodes": len(state.nodes),
            "by_status": dict(Counter(j.status for j in state.jobs.values())),
        }
        _print_json(summary) if args.json else console.print(summary)
        return 0
    decider = load_decider(args.decider, args.policy)
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("re-running decisions", total=len(records))
        report = audit(records, decider, progress=lambda i: progress.update(task, completed=i))
    if args.json:
        _print_json(msgspec.to_builtins(report) | {"ok": report.ok})
    else:
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
                table.add_row(str(m.seq), m.event_id, m.kind, m.detail)
            console.print(table)
    return 0 if report.ok else 1


# The processes `gpuherd serve` runs (the image's commands in infra/docker-compose.yml).
SERVICE_MODULES = {
    "scheduler": "services.scheduler.service",
    "elastic": "services.elastic.service",
    "memory": "services.memory.service",
    "analytics": "services.analytics.service",
    "agent": "services.nodeagent.agent",
}


def service_module(name: str) -> Any:
    import importlib

    return importlib.import_module(SERVICE_MODULES[name])


def cmd_serve(args: argparse.Namespace) -> int:
    service_module(args.service).main(args.args)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from gpuherd.cluster import run_cluster

    return run_cluster(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuherd", description="Event-sourced resource manager for DL training")
    parser.add_argument("--nats-url", default=None, help="NATS server (default: NATS_URL or the local cluster)")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where `up` keeps NATS data, logs, cluster file")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start NATS (unless NATS_URL), the services and node agents")
    up.add_argument("--agents", type=int, default=2)
    up.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of each sim agent")
    up.add_argument("--cpu-agents", type=int, default=2, help="agents that run real processes on CPU")
    up.add_argument("--cpu-gpus", type=int, default=4, help="virtual GPUs of each cpu agent (2 NVLink islands)")
    up.add_argument("--nvml", action="store_true", help="also run an nvml agent for this machine's GPUs")
    up.add_argument("--policy", default=None, help="record this policy at start (default: keep the log's; fifo)")
    up.add_argument("--vcs", default=None, help="a YAML/JSON file of virtual clusters to configure at start")
    up.add_argument("--lost-after", type=float, default=10.0, help="seconds without heartbeat before a node is lost")
    up.add_argument("--demo", choices=["philly"], default=None, help="submit a demo workload, report, and stop")
    up.add_argument("--demo-jobs", type=int, default=300)
    up.add_argument("--demo-seconds", type=float, default=45.0, help="wall time the demo's arrivals span")
    up.add_argument("--trace", default=None, help="path of philly.csv (default: ../shared/traces/philly/philly.csv)")
    up.add_argument("--fresh", action="store_true", help="start from an empty data folder")
    up.set_defaults(func=cmd_up)

    sv = sub.add_parser(
        "serve",
        help="run one service or a node agent in the foreground (what each container of the deployment runs)",
        description="Run one gpuherd process; the arguments after the name are its own (see `gpuherd serve NAME -h`).",
    )
    sv.add_argument("service", choices=sorted(SERVICE_MODULES))
    sv.add_argument("args", nargs=argparse.REMAINDER)
    sv.set_defaults(func=cmd_serve)

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

    n = sub.add_parser("nodes", help="list nodes and their GPUs")
    n.add_argument("--json", action="store_true")
    n.set_defaults(func=cmd_nodes)

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job")
    c.add_argument("--reason", default="cancelled by user")
    c.set_defaults(func=cmd_cancel)

    w = sub.add_parser("why", help="why a job waits (or where it is), from the scheduler's own pass")
    w.add_argument("job")
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=cmd_why)

    vc = sub.add_parser("vc", help="virtual clusters: quotas, borrowing, weights")
    vc_sub = vc.add_subparsers(dest="vc_command", required=True)
    vc_set = vc_sub.add_parser("set", help="create or change a VC")
    vc_set.add_argument("name")
    vc_set.add_argument("--quota", default=None, help="GPUs of its own (a number, or 'none')")
    vc_set.add_argument("--no-borrow", action="store_true", help="never run beyond the quota")
    vc_set.add_argument("--weight", type=float, default=1.0, help="its share under fair share")
    vc_list = vc_sub.add_parser("list", help="VCs, their quota and use")
    vc_list.add_argument("--json", action="store_true")
    vc.set_defaults(func=cmd_vc)

    pol = sub.add_parser("policy", help="the scheduling policy: show, or set it live")
    pol_sub = pol.add_subparsers(dest="policy_command", required=True)
    pol_set = pol_sub.add_parser("set", help="switch the policy (recorded as PolicyConfigured)")
    pol_set.add_argument("name")
    pol_set.add_argument("--param", action="append", help="NAME=NUMBER, e.g. half_life_s=3600 (repeatable)")
    pol_set.add_argument("--no-backfill", action="store_true")
    pol_show = pol_sub.add_parser("show")
    pol_show.add_argument("--json", action="store_true")
    pol.set_defaults(func=cmd_policy)

    for name, helptext in (("drain", "place no new work on a node"), ("undrain", "let a drained node take work")):
        d = sub.add_parser(name, help=helptext)
        d.add_argument("node")
        if name == "drain":
            d.add_argument("--reason", default="drained by an operator")
        d.set_defaults(func=cmd_drain)

    lg = sub.add_parser("logs", help="a job's output, from the agents it ran on")
    lg.add_argument("job")
    lg.add_argument("--attempt", type=int, default=None, help="only this attempt (default: all)")
    lg.add_argument("--bytes", type=int, default=65536, help="the last N bytes of each rank's log")
    lg.add_argument("--json", action="store_true")
    lg.set_defaults(func=cmd_logs)

    el = sub.add_parser("elastic", help="the elastic service's parameters: show, or set them live")
    el_sub = el.add_subparsers(dest="elastic_command", required=True)
    el_set = el_sub.add_parser("set", help="record new parameters (ElasticConfigured)")
    el_set.add_argument("--param", action="append", metavar="NAME=VALUE", help="e.g. min_interval_s=30")
    el_show = el_sub.add_parser("show")
    el_show.add_argument("--json", action="store_true")
    el.set_defaults(func=cmd_elastic)

    rs = sub.add_parser("rescales", help="elastic jobs' rescales: kind, sizes, and each phase's duration")
    rs.add_argument("--job", default=None)
    rs.add_argument("--log", help="a log file instead of the live log")
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(func=cmd_rescales)

    e = sub.add_parser("events", help="print the event log (filter by job, node, type)")
    e.add_argument("--job", default=None)
    e.add_argument("--node", default=None)
    e.add_argument("--type", default=None, help="event type(s), comma-separated, e.g. JobPlaced,JobFinished")
    e.add_argument("--last", type=int, default=0, help="only the last N events")
    e.add_argument("--follow", "-f", action="store_true")
    e.add_argument("--json", action="store_true")
    e.add_argument(
        "--dead-letter",
        action="store_true",
        help="the dead letters instead: messages no consumer could handle, and why",
    )
    e.set_defaults(func=cmd_events)

    r = sub.add_parser("replay", help="re-fold the log; with --audit, re-run the decider at every decision")
    r.add_argument("--audit", action="store_true")
    r.add_argument("--decider", default="scheduler")
    r.add_argument("--policy", default="fifo")
    r.add_argument("--json", action="store_true")
    r.add_argument("--log", help="a log file (a simulation's events.jsonl) instead of the live log")
    r.set_defaults(func=cmd_replay)

    from gpuherd import cli_analytics, cli_ops, cli_profile

    cli_analytics.add_commands(sub)
    cli_profile.add_commands(sub)
    cli_ops.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from gpuherd.obs import configure

    configure("cli", level=os.environ.get("GPUHERD_LOG_LEVEL", "WARNING"), json=False)  # logs go to stderr
    try:
        sys.exit(args.func(args))
    except GpuherdError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
