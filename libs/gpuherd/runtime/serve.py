"""Serving a decider as a process: open the log, run the runner with its tasks (and the service's
start-up parameters, which it records when it leads) until SIGTERM (metrics and health on HTTP), close."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuherd import events as ev
from gpuherd.log import open_log
from gpuherd.metrics import serve_until_signal_with_http
from gpuherd.runtime.decider import Decider
from gpuherd.runtime.runner import DeciderRunner, ExtraTask


def default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def configured_event(kind: type[ev.Event], service: str, params: dict[str, float]) -> ev.Event:
    """A service's ``--params`` at start, recorded as its ``...Configured`` event (an operator's input:
    the decider validates it like any other and refuses what it cannot apply)."""
    now = time.time()
    return kind(id=f"{service}:config:{os.getpid()}:{now:.6f}", at=now, source=service, params=params)  # type: ignore[call-arg]


async def serve_decider(
    url: str,
    decider: Decider[Any],
    *,
    extra_tasks: Sequence[ExtraTask] = (),
    configured: Callable[[], ev.Event] | None = None,
    instance: str | None = None,
    metrics_port: int | None = None,
    setup: Callable[[DeciderRunner[Any]], None] | None = None,
    read_linger_s: float = 0.0,
) -> None:
    """Run ``decider`` on the log at ``url`` until SIGTERM. ``configured`` makes its parameters
    command, recorded when this instance first leads (see ``DeciderRunner``). ``setup`` adjusts the
    runner before it starts (a scheduler's intake, its cluster metrics)."""
    instance = instance or default_instance()
    log_ = await open_log(url, name=f"{decider.name}-{instance}")
    try:
        runner = DeciderRunner(
            log_,
            decider,
            instance=instance,
            extra_tasks=extra_tasks,
            read_linger_s=read_linger_s,
            parameters=configured,
        )
        if setup is not None:
            setup(runner)
        await serve_until_signal_with_http(runner, metrics_port)
    finally:
        await log_.close()
