"""Command-line options every gpuherd process shares (``gpuherd serve NAME --help``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

from gpuherd.metrics import metrics_port_from_env
from gpuherd.obs import get_logger

log = get_logger("gpuherd.service")


def service_parser(name: str, description: str) -> argparse.ArgumentParser:
    """``--nats-url``, ``--instance`` and ``--metrics-port``; the service adds its own."""
    parser = argparse.ArgumentParser(prog=f"gpuherd serve {name}", description=description)
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--instance", default=None, help="instance id for the leader lease (default: host-pid)")
    add_metrics_argument(parser)
    return parser


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=metrics_port_from_env(),
        help="serve /metrics, /healthz and /readyz on this port (0: any free one; default $GPUHERD_METRICS_PORT, "
        "else none)",
    )


def add_yield_arguments(parser: argparse.ArgumentParser, *, read_linger_s: float, nice: int) -> None:
    """``--read-linger-ms`` and ``--nice``, for a process nothing waits on within milliseconds (a
    background decider, the dashboard): how it spares a host it shares with the processes decisions
    wait on. Their defaults come from its spec."""
    parser.add_argument(
        "--read-linger-ms",
        type=float,
        default=read_linger_s * 1000,
        help="while events flow, let them gather this long between reads of the log (fewer wake-ups, "
        f"later decisions; 0: read each as it is stored; default {read_linger_s * 1000:g})",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=nice,
        help="yield the CPU by this nice increment to the processes decisions wait on, where they share a "
        f"host (default {nice})",
    )


def read_linger_s(args: argparse.Namespace) -> float:
    """The reader's linger in seconds, from ``--read-linger-ms`` (``add_yield_arguments``)."""
    return max(0.0, args.read_linger_ms / 1000)


def yield_cpu(service: str, increment: int) -> None:
    """Lower this process's CPU priority by ``increment`` (a background process on a shared host)."""
    if increment <= 0:
        return
    try:
        os.nice(increment)
    except OSError as exc:  # a sandbox that forbids it: run at the priority given
        log.warning("cannot lower the CPU priority", service=service, nice=increment, error=str(exc))


def add_params_argument(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--params", default=None, help=f"record these parameters (JSON, e.g. {example}) before starting"
    )


def params_argument(text: str | None, convert: Callable[[dict[str, float]], object]) -> dict[str, float] | None:
    """A service's ``--params`` JSON as the dict its ``...Configured`` event records; ValueError
    (with the known names) for what its parameters class refuses."""
    if text is None:
        return None
    try:
        raw = json.loads(text)
        params = {str(k): float(v) for k, v in raw.items()}
    except (json.JSONDecodeError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f'not a JSON object of numbers ({exc}); e.g. {{"lease_term_s": 300}}') from None
    convert(params)
    return params
