"""Every gpuherd process by name: its decider, its entry point, the events it follows and emits.

This is the one place that knows all the services (imported statically, never by string). The CLI
starts them from here (``gpuherd serve NAME``), the audit and ``gpuherd why`` take their deciders
from here, and the tests check the routing it describes: one writer per event type.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.decider import Decider, replay
from services.analytics import service as analytics_service
from services.analytics.decide import AnalyticsDecider
from services.dashboard import service as dashboard_service
from services.elastic import service as elastic_service
from services.elastic.decide import ElasticDecider
from services.memory import service as memory_service
from services.memory.decide import MemoryDecider
from services.nodeagent import agent as agent_service
from services.scheduler import service as scheduler_service
from services.scheduler.decide import SchedulerDecider
from services.scheduler.policy import make_policy

Main = Callable[[list[str] | None], None]


@dataclass(frozen=True)
class Service:
    name: str
    main: Main  # ``gpuherd serve NAME ARGS`` runs ``main(ARGS)``
    parser: Callable[[], argparse.ArgumentParser]  # its command line (what ``main`` parses)
    decider: type[Decider[Any]] | None  # None: not a decider (a node agent)
    follows: frozenset[type[ev.Event]]  # the events it acts on (the rest it only folds, if at all)
    emits: frozenset[type[ev.Event]]  # the events it writes
    about: str


# What a node agent acts on, and what it writes (under its node's subjects).
AGENT_FOLLOWS: frozenset[type[ev.Event]] = frozenset(
    {
        ev.JobPlaced,
        ev.JobStarted,
        ev.TaskEnded,
        ev.JobFinished,
        ev.JobRequeued,
        ev.JobPreempted,
        ev.JobCancelRequested,
        ev.JobResized,
        ev.RescaleCompleted,
        ev.WorkerLost,
        ev.ProfileRequested,
        ev.NodeLost,
        ev.NodePowerDownRequested,
        ev.NodePowerUpRequested,
        ev.NodeWakeRequested,
        ev.MemoryLeaseGranted,
        ev.MemoryLeaseRevoked,
        ev.MemoryLeaseReclaimed,
    }
)
AGENT_EMITS: frozenset[type[ev.Event]] = frozenset(
    {
        ev.NodeRegistered,
        ev.JobStarted,
        ev.TaskEnded,
        ev.GpuHealthChanged,
        ev.GpuMemoryReported,
        ev.NodePoweredDown,
        ev.NodePoweredUp,
        ev.RescaleCompleted,
        ev.RescaleFailed,
        ev.WorkerLost,
        ev.MemoryLeaseRequested,
        ev.MemoryLeaseRenewed,
        ev.MemoryLeaseReleased,
        ev.ProfileReported,
    }
)
# Operators' commands (the CLI as admin; a service's --policy or --params at start records one too).
OPERATOR_EMITS: frozenset[type[ev.Event]] = frozenset(
    {
        ev.VcConfigured,
        ev.PolicyConfigured,
        ev.NodeDrained,
        ev.NodeUndrained,
        ev.JobCancelRequested,
        ev.ElasticConfigured,
        ev.MemoryBrokerConfigured,
        ev.ProfileRequested,
    }
)


def _serve_dashboard(argv: list[str] | None = None) -> None:
    """The dashboard with the scheduler's queue explanation and the audit (``apps.dashboard``, which
    uses this registry, so it is imported when the dashboard starts)."""
    from apps.dashboard import TOOLS

    dashboard_service.main(argv, tools=TOOLS)


def _decider_service(name: str, module: Any, decider: type[Decider[Any]], about: str) -> Service:
    return Service(name, module.main, module.build_parser, decider, decider.FOLLOWS, decider.EMITS, about)


SERVICES: dict[str, Service] = {
    s.name: s
    for s in (
        _decider_service(
            "scheduler", scheduler_service, SchedulerDecider, "intake, gang placement, quotas, preemption"
        ),
        _decider_service("elastic", elastic_service, ElasticDecider, "grows and shrinks running elastic jobs"),
        _decider_service("memory", memory_service, MemoryDecider, "leases spare neighbor-GPU and host memory"),
        _decider_service(
            "analytics", analytics_service, AnalyticsDecider, "duration predictions, energy saving, reports"
        ),
        Service(
            "agent",
            agent_service.main,
            agent_service.build_parser,
            None,
            AGENT_FOLLOWS,
            AGENT_EMITS,
            "runs a node's part of every job",
        ),
        Service(
            "dashboard",
            _serve_dashboard,
            dashboard_service.build_parser,
            None,
            frozenset(),
            frozenset(),  # (its operator actions are operator commands, as the CLI's)
            "the live web dashboard and its JSON API (a reader of the log)",
        ),
    )
}

AUDITABLE = ("scheduler", "elastic", "memory")  # deciders whose every decision the audit re-derives


def make_decider(name: str, *, policy: str | None = None) -> Decider[Any]:
    """The decider of service ``name`` with its defaults; the scheduler's ``policy`` is its default
    until the log records one (fifo if None)."""
    service = SERVICES.get(name)
    if service is None or service.decider is None:
        deciders = ", ".join(n for n, s in SERVICES.items() if s.decider is not None)
        raise ValueError(f"no decider named {name!r}; deciders: {deciders}")
    if service.decider is SchedulerDecider:
        return SchedulerDecider(make_policy(policy or "fifo"))
    return service.decider()


def replay_state(decider: Decider[Any], records: Sequence[Record]) -> Any:
    """The decider's own state after folding ``records``."""
    return replay(decider, records)


def writers() -> dict[type[ev.Event], list[str]]:
    """Who writes each event type: services by name, and ``operator``."""
    out: dict[type[ev.Event], list[str]] = {}
    for service in SERVICES.values():
        for kind in service.emits:
            out.setdefault(kind, []).append(service.name)
    for kind in OPERATOR_EMITS:
        out.setdefault(kind, []).append("operator")
    out[ev.LeadershipTaken] = ["runtime"]  # each decider's shell fences its own leadership
    return out
