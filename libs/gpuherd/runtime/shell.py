"""The one shell every decider runs in: its spec says what it needs, this does the rest.

``gpuherd serve NAME ARGS`` runs ``main(spec, ARGS)``: the command line (``--nats-url``,
``--instance``, ``--metrics-port``, and, from the spec, ``--params``, ``--tick`` and its own
flags), logging, the decider, its timer, its ``--params`` recorded as its ``...Configured``
command (by the runner, when this instance leads), its own loops and runner set-up, then the
runner (leadership, snapshots, catch-up, decide, append) until SIGTERM.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import Any

from gpuherd.obs import configure
from gpuherd.runtime.decider import Decider
from gpuherd.runtime.runner import MAX_IN_FLIGHT, DeciderRunner, ExtraTask
from gpuherd.runtime.serve import configured_event, run_process, serve_decider
from gpuherd.runtime.spec import ServiceSpec
from gpuherd.runtime.timers import clock_ticker
from gpuherd.service_args import (
    add_params_argument,
    add_yield_arguments,
    params_argument,
    read_linger_s,
    service_parser,
    yield_cpu,
)


def build_parser(spec: ServiceSpec) -> argparse.ArgumentParser:
    """The command line of a decider's process."""
    if spec.role != "decider":
        assert spec.parser is not None
        return spec.parser()
    parser = service_parser(spec.name, f"gpuherd {spec.name}: {spec.about}")
    if spec.params is not None:
        add_params_argument(parser, spec.params.example)
    if spec.timer is not None:
        parser.add_argument("--tick", type=float, default=spec.timer.every_s, help="seconds between its timer's ticks")
    add_yield_arguments(parser, read_linger_s=spec.read_linger_s, nice=spec.nice)
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=MAX_IN_FLIGHT,
        help="batches of decisions being appended at once, the next decided while the last ones wait for "
        f"the log's fsync (1: each folded back before the next is decided; default {MAX_IN_FLIGHT})",
    )
    if spec.add_arguments is not None:
        spec.add_arguments(parser)
    return parser


def live_tasks(spec: ServiceSpec, decider: Decider[Any], args: argparse.Namespace) -> list[ExtraTask]:
    """The loops a decider runs beside its runner: its timer (when it has time-based decisions)
    and the spec's own."""
    tasks: list[ExtraTask] = []
    timer = spec.timer
    if timer is not None and timer.active(decider):
        ticker = timer.live(args) if timer.live is not None else None
        tasks.append(ticker or clock_ticker(timer.tick, args.tick, needed=timer.needed, due=timer.due))
    tasks += spec.tasks(args)
    return tasks


def main(spec: ServiceSpec, argv: list[str] | None = None, *, peers: Sequence[ServiceSpec] = ()) -> None:
    """Run ``spec``'s process with ``argv`` until SIGTERM; a reader is handed ``peers``, the other
    services' specs (what they offer it: an explainer of a queue, deciders to audit)."""
    if spec.role == "reader":
        assert spec.main is not None
        spec.main(argv, peers=[p for p in peers if p.name != spec.name])
        return
    if spec.role != "decider":
        assert spec.main is not None
        spec.main(argv)
        return
    parser = build_parser(spec)
    args = parser.parse_args(argv)
    configure(spec.name)
    yield_cpu(spec.name, args.nice)
    try:
        decider = spec.live_decider(args) if spec.live_decider is not None else spec.decider()  # type: ignore[misc]
    except ValueError as exc:
        parser.error(str(exc))
    configured = None
    if spec.params is not None:
        try:
            params = params_argument(args.params, spec.params.convert)
        except ValueError as exc:
            parser.error(f"--params: {exc}")
        if params is not None:
            configured = functools.partial(configured_event, spec.params.event, decider.name, params)

    def setup(runner: DeciderRunner[Any]) -> None:
        if spec.setup is not None:
            spec.setup(runner, args)

    run_process(
        lambda: serve_decider(
            args.nats_url,
            decider,
            extra_tasks=live_tasks(spec, decider, args),
            configured=configured,
            instance=args.instance,
            metrics_port=args.metrics_port,
            setup=setup,
            read_linger_s=read_linger_s(args),
            max_in_flight=max(1, args.max_in_flight),
        )
    )
