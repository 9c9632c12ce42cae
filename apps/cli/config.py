"""Operator commands: ``vc``, ``policy``, ``elastic``, ``drain`` / ``undrain``.

Each is recorded as an event that the service applying it validates again (an invalid one is
recorded as refused, with the reason); checking here first gives the operator the answer at once.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import msgspec
from rich.table import Table

from apps.cli.common import (
    client_call,
    console,
    log_state,
    name_values,
    parse_duration,
    policy_names,
    print_json,
    records_of,
)
from apps.registry import make_decider
from gpuherd.errors import GpuherdError
from gpuherd.security import check_token
from services.elastic.policy import params_from as elastic_params
from services.scheduler.policy import POLICIES, check_policy


def _option(value: str | None, convert: Any, current: Any) -> Any:
    """A ``vc set`` option: not given keeps the VC's current value, ``none`` clears it."""
    if value is None:
        return current
    if value.strip().lower() == "none":
        return None
    try:
        return _finite(convert(value))
    except ValueError:
        raise GpuherdError(f"not a finite number: {value!r} (or 'none')") from None


def _finite(value: Any) -> Any:
    """``value``, unless a number the log cannot hold: JSON has no infinity or NaN (they would be
    written as null, an event no service could read back)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"not a finite number: {value}")
    return value


def cmd_vc(args: argparse.Namespace) -> int:
    if args.vc_command == "set":
        if args.weight is not None and not math.isfinite(args.weight):
            raise GpuherdError(f"--weight must be a finite number, got {args.weight}")
        # Options not given keep what the VC has (a VcConfigured is its whole configuration).
        current = log_state(args, make_decider("scheduler")).vcs.get(args.name)
        config = {
            "gpu_quota": _option(args.quota, int, current.gpu_quota if current else None),
            "can_borrow": args.borrow if args.borrow is not None else (current.can_borrow if current else True),
            "weight": args.weight if args.weight is not None else (current.weight if current else 1.0),
            "default_time_limit_s": _option(
                args.default_time_limit, parse_duration, current.default_time_limit_s if current else None
            ),
            "max_time_limit_s": _option(
                args.max_time_limit, parse_duration, current.max_time_limit_s if current else None
            ),
            "max_gpus_per_user": _option(args.max_gpus_per_user, int, current.max_gpus_per_user if current else None),
            "max_running_per_user": _option(
                args.max_running_per_user, int, current.max_running_per_user if current else None
            ),
        }
        client_call(args, lambda c: c.configure_vc(args.name, **config))
        console.print(f"VC {args.name}: " + ", ".join(f"{k} {'none' if v is None else v}" for k, v in config.items()))
        return 0
    state = log_state(args, make_decider("scheduler"))
    used = state.vc_used
    if args.json:
        print_json(
            [
                msgspec.to_builtins(v) | {"used": used.get(v.vc, 0), "borrowing": v.borrowing(used.get(v.vc, 0))}
                for v in state.vcs.values()
            ]
        )
        return 0
    table = Table(title=f"virtual clusters ({len(state.vcs)})")
    columns = ("vc", "quota", "in use", "borrowing", "may borrow", "weight", "waiting", "past use (GPU-h)")
    for col in (*columns, "time limit (default/max s)", "per user (GPUs/running)"):
        table.add_column(col)
    for vc in sorted(state.vcs.values(), key=lambda v: v.vc):
        borrowing = vc.borrowing(used.get(vc.vc, 0))
        table.add_row(
            vc.vc,
            "-" if vc.gpu_quota is None else str(vc.gpu_quota),
            str(used.get(vc.vc, 0)),
            str(borrowing),
            "yes" if vc.can_borrow else "no",
            f"{vc.weight:g}",
            str(len(state.queued_by_vc.get(vc.vc, ()))),
            f"{state.past_usage(f'vc:{vc.vc}') / 3600:.1f}",
            f"{_or_dash(vc.default_time_limit_s)}/{_or_dash(vc.max_time_limit_s)}",
            f"{_or_dash(vc.max_gpus_per_user)}/{_or_dash(vc.max_running_per_user)}",
        )
    console.print(table)
    return 0


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def cmd_policy(args: argparse.Namespace) -> int:
    if args.policy_command == "advise":
        return cmd_policy_advise(args)
    if args.policy_command == "set":
        params = name_values(args.param)
        problem = check_policy(args.name, params)
        if problem is not None:
            raise GpuherdError(problem)
        client_call(args, lambda c: c.configure_policy(args.name, backfill=not args.no_backfill, params=params))
        console.print(f"policy {args.name}{' without' if args.no_backfill else ' with'} backfill {params or ''}")
        return 0
    state = log_state(args, make_decider("scheduler"))
    config = state.scheduling
    if args.json:
        print_json(msgspec.to_builtins(config))
        return 0
    console.print(
        f"policy {config.policy or 'fifo (default)'}, backfill {'on' if config.backfill else 'off'}, "
        f"params {config.params or '{}'}; available: {', '.join(sorted(POLICIES))}"
    )
    return 0


def cmd_policy_advise(args: argparse.Namespace) -> int:
    """Replay the recent history under each policy and recommend one, with the table behind it."""
    from apps.sim.cluster import ClusterSpec
    from apps.sim.policies import compare, recent, recommend
    from services.analytics.jobs import job_table
    from services.analytics.traces import finished_runs, load_trace, vc_peak_demand

    if args.source and not args.source.endswith(".jsonl"):
        history = load_trace(args.source, args.kind)
    else:
        if args.source:
            from gpuherd.log.files import iter_log_file

            records = iter_log_file(args.source)
        else:
            records = records_of(args)
        history = finished_runs(job_table(records, name="gpuherd"))
    history = recent(history, args.days or None)
    if history.jobs.empty:
        raise GpuherdError("no finished job with a run time in that history: nothing to replay")
    if args.cluster:
        cluster = ClusterSpec.from_file(args.cluster)
    else:
        cluster = ClusterSpec.from_peaks(vc_peak_demand(history), scale=args.scale)
    policies = policy_names(args.policies)
    if not args.json:
        console.print(
            f"replaying {len(history.jobs):,} jobs ({history.name}"
            f"{f', the last {args.days:g} days' if args.days else ''}) on {cluster.total_gpus:,} GPUs "
            f"under {', '.join(policies)} (sjf with the true durations is the oracle) ..."
        )
    runs = compare(history, cluster, policies, workers=args.workers)
    advice = recommend(runs)
    if args.json:
        print_json({"recommended": advice.policy, "reason": advice.reason, "runs": [r.as_dict() for r in runs]})
        return 0
    table = Table(
        title=f"{history.name}: {len(history.jobs):,} jobs on {cluster.total_gpus:,} GPUs", title_justify="left"
    )
    for col in ("policy", "avg JCT s", "p95 JCT s", "avg queue s", "preemptions", "vs FIFO", "oracle share"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        table.add_row(
            r.policy
            + (" (oracle)" if r.policy == "sjf" else "")
            + (" <- recommended" if r.policy == advice.policy else ""),
            f"{r.avg_jct_s:,.0f}",
            f"{r.p95_jct_s:,.0f}",
            f"{r.avg_queue_s:,.0f}",
            f"{r.preemptions:,}",
            "" if r.vs_fifo is None else f"{r.vs_fifo:.2f}x",
            "" if r.oracle_share is None else f"{r.oracle_share:.0%}",
        )
    console.print(table)
    console.print(
        f"recommended: [bold]{advice.policy}[/bold] ({advice.reason}); set it with `gpuherd policy set {advice.policy}`"
    )
    return 0


def cmd_elastic(args: argparse.Namespace) -> int:
    if args.elastic_command == "set":
        params = name_values(args.param)
        try:
            elastic_params(params)
        except ValueError as exc:
            raise GpuherdError(str(exc)) from None
        client_call(args, lambda c: c.configure_elastic(params))
        console.print(f"elastic service parameters: {params}")
        return 0
    state = log_state(args, make_decider("elastic"))
    params = msgspec.to_builtins(elastic_params(state.params or {}))
    if args.json:
        print_json(params)
    else:
        console.print(f"elastic service parameters: {params}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    undrain = args.command == "undrain"
    try:
        check_token("node", args.node)  # a wildcard ('*', '>') matched every node's subject: "drained *"
    except ValueError as exc:
        raise GpuherdError(str(exc)) from None
    client_call(args, lambda c: c.drain(args.node, getattr(args, "reason", ""), undrain=undrain))
    console.print(f"{'undrained' if undrain else 'drained'} {args.node}")
    return 0


def add_commands(sub: Any) -> None:
    vc = sub.add_parser("vc", help="virtual clusters: quotas, borrowing, weights")
    vc_sub = vc.add_subparsers(dest="vc_command", required=True)
    vc_set = vc_sub.add_parser("set", help="create or change a VC (options not given keep their value)")
    vc_set.add_argument("name", help="the VC's name")
    vc_set.add_argument("--quota", default=None, help="GPUs of its own (a number, or 'none')")
    vc_set.add_argument(
        "--borrow", action=argparse.BooleanOptionalAction, default=None, help="run beyond the quota on idle GPUs"
    )
    vc_set.add_argument("--weight", type=float, default=None, help="its share under fair share (default 1)")
    vc_set.add_argument("--default-time-limit", help="a job's time limit when it gives none (e.g. 2h; 'none')")
    vc_set.add_argument("--max-time-limit", help="the longest time limit a job may ask for (e.g. 1d; 'none')")
    vc_set.add_argument("--max-gpus-per-user", help="GPUs one user's jobs may hold at once ('none')")
    vc_set.add_argument("--max-running-per-user", help="jobs of one user placed or running at once ('none')")
    vc_list = vc_sub.add_parser("list", help="VCs, their quota and use")
    vc_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    vc.set_defaults(func=cmd_vc)

    pol = sub.add_parser("policy", help="the scheduling policy: show, or set it live")
    pol_sub = pol.add_subparsers(dest="policy_command", required=True)
    pol_set = pol_sub.add_parser("set", help="switch the policy (recorded as PolicyConfigured)")
    pol_set.add_argument("name", help="fifo, sjf, qssf, srtf, las, ... (see `gpuherd policy show`)")
    pol_set.add_argument("--param", action="append", help="NAME=NUMBER, e.g. half_life_s=3600 (repeatable)")
    pol_set.add_argument("--no-backfill", action="store_true", help="start jobs strictly in policy order")
    pol_show = pol_sub.add_parser("show", help="the policy in force, its parameters and the policies there are")
    pol_show.add_argument("--json", action="store_true", help="print JSON instead of text")
    pol_advise = pol_sub.add_parser(
        "advise", help="replay the recent history under each policy and recommend one, with the table behind it"
    )
    pol_advise.add_argument("source", nargs="?", help="a trace, or a log file (.jsonl); default: the live log")
    pol_advise.add_argument("--kind", help="trace format, when the file name and columns do not tell")
    pol_advise.add_argument("--days", type=float, default=14.0, help="replay the last D days (0: all of it)")
    pol_advise.add_argument(
        "--policies", default="fifo,sjf,qssf,las,srtf", help="the policies to compare, comma separated"
    )
    pol_advise.add_argument("--scale", type=float, default=1.0, help="each VC at this x its peak demand in the history")
    pol_advise.add_argument("--cluster", help="cluster spec file (JSON/YAML) instead")
    pol_advise.add_argument("--workers", type=int, default=1, help="simulations at a time")
    pol_advise.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pol.set_defaults(func=cmd_policy)

    el = sub.add_parser("elastic", help="the elastic service's parameters: show, or set them live")
    el_sub = el.add_subparsers(dest="elastic_command", required=True)
    el_set = el_sub.add_parser("set", help="record new parameters (ElasticConfigured)")
    el_set.add_argument("--param", action="append", metavar="NAME=VALUE", help="e.g. min_interval_s=30")
    el_show = el_sub.add_parser("show", help="the parameters in force")
    el_show.add_argument("--json", action="store_true", help="print JSON instead of text")
    el.set_defaults(func=cmd_elastic)

    for name, helptext in (("drain", "place no new work on a node"), ("undrain", "let a drained node take work")):
        d = sub.add_parser(name, help=helptext)
        d.add_argument("node", help="the node's name (see `gpuherd nodes`)")
        if name == "drain":
            d.add_argument("--reason", default="drained by an operator", help="recorded with the drain")
        d.set_defaults(func=cmd_drain)
