"""Operator commands: ``vc``, ``policy``, ``elastic``, ``drain`` / ``undrain``.

Each is recorded as an event that the service applying it validates again (an invalid one is
recorded as refused, with the reason); checking here first gives the operator the answer at once.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
from rich.table import Table

from apps.cli.common import client_call, console, name_values, print_json, read_records
from apps.registry import make_decider, replay_state
from gpuherd.errors import GpuherdError
from services.elastic.policy import params_from as elastic_params
from services.scheduler.policy import POLICIES, check_policy


def cmd_vc(args: argparse.Namespace) -> int:
    if args.vc_command == "set":
        quota = None if args.quota in (None, "none") else int(args.quota)
        client_call(
            args,
            lambda c: c.configure_vc(args.name, gpu_quota=quota, can_borrow=not args.no_borrow, weight=args.weight),
        )
        console.print(
            f"VC {args.name}: quota {quota if quota is not None else 'none'}, "
            f"{'may not' if args.no_borrow else 'may'} borrow, weight {args.weight}"
        )
        return 0
    state = replay_state(make_decider("scheduler"), read_records(args))
    used = state.vc_used
    if args.json:
        print_json([msgspec.to_builtins(v) | {"used": used.get(v.vc, 0)} for v in state.vcs.values()])
        return 0
    table = Table(title=f"virtual clusters ({len(state.vcs)})")
    for col in ("vc", "quota", "in use", "borrowing", "may borrow", "weight", "waiting", "past use (GPU-h)"):
        table.add_column(col)
    for vc in sorted(state.vcs.values(), key=lambda v: v.vc):
        borrowing = sum(j.borrowed for j in state.active_jobs() if j.spec.vc == vc.vc)
        table.add_row(
            vc.vc,
            "-" if vc.gpu_quota is None else str(vc.gpu_quota),
            str(used.get(vc.vc, 0)),
            str(borrowing),
            "yes" if vc.can_borrow else "no",
            f"{vc.weight:g}",
            str(len(state.queued_by_vc.get(vc.vc, ()))),
            f"{state.past_usage(f'vc:{vc.vc}') / 3600:.1f}",
        )
    console.print(table)
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    if args.policy_command == "set":
        params = name_values(args.param)
        problem = check_policy(args.name, params)
        if problem is not None:
            raise GpuherdError(problem)
        client_call(args, lambda c: c.configure_policy(args.name, backfill=not args.no_backfill, params=params))
        console.print(f"policy {args.name}{' without' if args.no_backfill else ' with'} backfill {params or ''}")
        return 0
    state = replay_state(make_decider("scheduler"), read_records(args))
    config = state.scheduling
    if args.json:
        print_json(msgspec.to_builtins(config))
        return 0
    console.print(
        f"policy {config.policy or 'fifo (default)'}, backfill {'on' if config.backfill else 'off'}, "
        f"params {config.params or '{}'}; available: {', '.join(sorted(POLICIES))}"
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
    state = replay_state(make_decider("elastic"), read_records(args))
    params = msgspec.to_builtins(elastic_params(state.params or {}))
    if args.json:
        print_json(params)
    else:
        console.print(f"elastic service parameters: {params}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    undrain = args.command == "undrain"
    client_call(args, lambda c: c.drain(args.node, getattr(args, "reason", ""), undrain=undrain))
    console.print(f"{'undrained' if undrain else 'drained'} {args.node}")
    return 0


def add_commands(sub: Any) -> None:
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

    el = sub.add_parser("elastic", help="the elastic service's parameters: show, or set them live")
    el_sub = el.add_subparsers(dest="elastic_command", required=True)
    el_set = el_sub.add_parser("set", help="record new parameters (ElasticConfigured)")
    el_set.add_argument("--param", action="append", metavar="NAME=VALUE", help="e.g. min_interval_s=30")
    el_show = el_sub.add_parser("show")
    el_show.add_argument("--json", action="store_true")
    el.set_defaults(func=cmd_elastic)

    for name, helptext in (("drain", "place no new work on a node"), ("undrain", "let a drained node take work")):
        d = sub.add_parser(name, help=helptext)
        d.add_argument("node")
        if name == "drain":
            d.add_argument("--reason", default="drained by an operator")
        d.set_defaults(func=cmd_drain)
