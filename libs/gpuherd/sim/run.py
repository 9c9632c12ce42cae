"""One simulation run: a trace's submissions on a cluster spec under a policy.

The deciders are the production classes, named by import path (this library
never imports a service): the scheduler's, and the analytics service's for
duration predictions and energy saving.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuherd import events as ev
from gpuherd.log.base import Record
from gpuherd.sim.cluster import ClusterSpec
from gpuherd.sim.engine import Simulation

SCHEDULER = "services.scheduler.decide:SchedulerDecider"
ANALYTICS = "services.analytics.decide:AnalyticsDecider"
POLICIES = "services.scheduler.policy:make_policy"
CES_PARAMS = "services.analytics.ces:CesParams"


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def make_deciders(policy: str, *, predict: bool = True, ces: dict[str, Any] | None = None) -> list[Any]:
    """The scheduler under ``policy`` and the analytics decider (predictions, and CES when
    ``ces`` is given: its parameters, ``{}`` for the defaults)."""
    scheduler = _load(SCHEDULER)(_load(POLICIES)(policy))
    ces_params = _load(CES_PARAMS)(**ces) if ces is not None else None
    analytics = _load(ANALYTICS)(predict=predict, ces=ces_params)
    return [scheduler, analytics]


@dataclass
class SimResult:
    policy: str
    records: list[Record]
    wall_s: float
    submitted: int
    rejected: int
    simulation: Simulation

    @property
    def events(self) -> int:
        return len(self.records)


def simulate(
    submissions: Iterable[ev.JobSubmitted],
    cluster: ClusterSpec,
    policy: str,
    *,
    predict: bool = True,
    ces: dict[str, Any] | None = None,
    tick_s: float = 300.0,
    boot_s: float = 300.0,
    policy_params: dict[str, float] | None = None,
    on_submit: Callable[[int], None] | None = None,
    start: float = 0.0,
) -> SimResult:
    deciders = make_deciders(policy, predict=predict, ces=ces)
    sim = Simulation(deciders, tick_s=tick_s, boot_s=boot_s, admit=cluster.admit)
    setup = [*cluster.setup_events(), ev.PolicyConfigured(policy=policy, params=dict(policy_params or {}))]
    t0 = time.perf_counter()
    sim.setup(setup, at=start)
    sim.run(submissions, on_submit=on_submit)
    return SimResult(
        policy=policy,
        records=list(sim.records),
        wall_s=time.perf_counter() - t0,
        submitted=sim.submitted,
        rejected=sim.rejected,
        simulation=sim,
    )
