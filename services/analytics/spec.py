"""The analytics service, as a service: duration predictions, energy saving, reports."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuherd import events as ev
from gpuherd.runtime.runner import ExtraTask
from gpuherd.runtime.spec import BACKGROUND_NICE, ServiceSpec, Simulated, TimerSpec
from services.analytics.ces import CesParams
from services.analytics.decide import AnalyticsDecider
from services.analytics.service import reporter

TICK_S = 60.0  # live, with energy saving on: demand sampled and power decided this often


def _ces(text: str | None) -> CesParams | None:
    if text is None:
        return None
    try:
        return CesParams(**json.loads(text))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"--ces: not CesParams as JSON ({exc}); e.g. '{{\"buffer_nodes\": 20}}'") from None


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ces", help='turn on energy saving with these CesParams (JSON; "{}" for defaults)')
    parser.add_argument("--report-dir", help="keep the characterization report current in this folder")
    parser.add_argument("--report-every", type=float, default=300.0)


def _tasks(args: argparse.Namespace) -> list[ExtraTask]:
    if args.report_dir is None:
        return []
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [reporter(out, args.report_every)]


def _simulated(switches: Mapping[str, Any]) -> Simulated | None:
    """Predictions (or the ``estimates`` given) where a policy ranks by them or they are asked for,
    by the duration model ``predictor`` (its settings; default the model's own), and energy saving
    with ``ces`` (its parameters; ``{}`` for the defaults). ``estimates_cover_all``: every job has an
    estimate, so the model is not trained (nothing would read it)."""
    predict, estimates, ces = switches.get("predict", True), switches.get("estimates"), switches.get("ces")
    if not predict and estimates is None and ces is None:
        return None  # (it would only fold)
    energy = CesParams(**ces) if ces is not None else None
    made = AnalyticsDecider(
        predict=predict or estimates is not None,
        ces=energy,
        estimates=estimates,
        model=switches.get("predictor"),
        learn=estimates is None or not switches.get("estimates_cover_all", False),
    )
    return Simulated(made, tick_every_s=switches.get("tick_s", 300.0))


SPEC = ServiceSpec(
    name="analytics",
    about="duration predictions, energy saving, reports",
    role="decider",
    follows=AnalyticsDecider.FOLLOWS,
    emits=AnalyticsDecider.EMITS,
    decider=AnalyticsDecider,
    live_decider=lambda args: AnalyticsDecider(ces=_ces(args.ces)),
    timer=TimerSpec(ev.AnalyticsTicked, TICK_S, active=lambda decider: decider.ces is not None),
    add_arguments=_arguments,
    tasks=_tasks,
    setup=lambda runner, args: runner.metrics.watch_cluster(lambda: runner.state),
    simulated=_simulated,
    local_argv=lambda ctx: ["--report-dir", str(ctx.data_dir / "report")],
    nice=BACKGROUND_NICE,
)
