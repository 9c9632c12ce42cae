"""The scheduler, as a service: sole owner of GPU allocations, judge of every submission."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from gpuherd import events as ev
from gpuherd.log import CONTROL_PREFIX, INTAKE_PREFIX
from gpuherd.runtime.spec import LocalContext, ServiceSpec, Simulated, TimerSpec
from gpuherd.security import Permissions, appends_of, decider_permissions, intake_consumer_permissions
from services.scheduler import service
from services.scheduler.decide import SchedulerDecider
from services.scheduler.explain import SchedulerQueue
from services.scheduler.policy import make_policy

TICK_S = 30.0  # live: a pass for time-based decisions this often (and at each time limit), node liveness every second
SIM_TICK_S = 300.0  # simulated: while jobs wait (a simulation hears no heartbeats)


def decider(policy: str | None = None) -> SchedulerDecider:
    """The scheduler under ``policy`` until the log records one (fifo if None)."""
    return SchedulerDecider(make_policy(policy or "fifo"))


def _live(args: argparse.Namespace) -> SchedulerDecider:
    if args.policy is not None:
        make_policy(args.policy)  # fail at start on a name that does not exist
    return SchedulerDecider()


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        default=os.environ.get("GPUHERD_POLICY"),
        help="record this policy in the log at start (default: keep the log's, else fifo)",
    )
    parser.add_argument(
        "--lost-after", type=float, default=10.0, help="seconds without heartbeat before a node is lost"
    )


def _simulated(switches: Mapping[str, Any]) -> Simulated:
    return Simulated(decider(switches.get("policy")), tick_every_s=switches.get("tick_s", SIM_TICK_S))


def _local(ctx: LocalContext) -> list[str]:
    argv = ["--lost-after", str(ctx.option("lost_after_s", 10.0))]
    return argv + (["--policy", ctx.option("policy")] if ctx.option("policy") else [])


def _permissions(_: str) -> Permissions:
    return decider_permissions(
        "scheduler",
        appends_of(SchedulerDecider.EMITS | {ev.PolicyConfigured}, source="scheduler"),
        publish=intake_consumer_permissions(service.INTAKE_CONSUMER),
        subscribe=(f"{INTAKE_PREFIX}.>", f"{CONTROL_PREFIX}.scheduler.>"),
        allow_responses=True,
    )


SPEC = ServiceSpec(
    name="scheduler",
    about="intake, gang placement, quotas, preemption",
    role="decider",
    follows=SchedulerDecider.FOLLOWS,
    emits=SchedulerDecider.EMITS,
    records=frozenset({ev.PolicyConfigured}),
    permissions=_permissions,
    decider=decider,
    live_decider=_live,
    timer=TimerSpec(
        ev.ClockTicked,
        TICK_S,
        needed=service.jobs_wait,
        on_grid=True,
        due=service.next_deadline,
        live=lambda args: service.timer(args.lost_after, args.tick),
    ),
    add_arguments=_arguments,
    tasks=lambda args: [service.policy_recorder(args.policy)],
    setup=lambda runner, args: service.setup(runner),
    auditable=True,
    explainer=SchedulerQueue,
    takes_intake=True,
    simulated=_simulated,
    local_argv=_local,
)
