"""Serving a decider as a process: open the log, run the runner with its tasks (and the service's
start-up parameters, which it records when it leads) until SIGTERM (metrics and health on HTTP), close."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gpuherd import events as ev
from gpuherd.aio import cancel_until_done
from gpuherd.log import EventLog, open_log
from gpuherd.metrics import serve_until_signal_with_http
from gpuherd.obs import get_logger
from gpuherd.runtime.decider import ConfiguredDecider, Decider, params_problem
from gpuherd.runtime.runner import MAX_IN_FLIGHT, DeciderRunner, ExtraTask

log = get_logger("gpuherd.runtime")

CLOSE_TIMEOUT_S = 0.2  # a stopping process waits no longer for its connection to close
END_TIMEOUT_S = 0.2  # nor for its remaining tasks to end (see ``end_remaining_tasks``)
END_RETRY_S = 0.01  # cancelling them again this often


def default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def configured_event(kind: type[ev.Event], service: str, params: dict[str, float]) -> ev.Event:
    """A service's ``--params`` at start, recorded as its ``...Configured`` event (an operator's input:
    the decider validates it like any other and refuses what it cannot apply)."""
    now = time.time()
    return kind(id=f"{service}:config:{os.getpid()}:{now:.6f}", at=now, source=service, params=params)  # type: ignore[call-arg]


def rules_recorder(
    kind: type[ev.Event], recorded: Callable[[Any], int | None], rules: int
) -> Callable[[DeciderRunner[Any]], Awaitable[None]]:
    """A versioned service's task (``ServiceSpec.tasks``): once caught up, record its ``rules`` as
    a ``kind`` command (a ``...Configured`` whose ``rules`` default to the newest) unless the log's
    are those (``recorded`` of its state), keeping the parameters in force; every later decision is
    then audited by the rules it was made by. Parameters of a command recorded unchecked that do not
    convert meant the defaults then: recorded again they would be refused, and the rules with them."""

    async def record_rules(runner: DeciderRunner[Any]) -> None:
        await runner.caught_up.wait()
        state = runner.state
        if recorded(state) == rules:
            return
        params = dict(state.params or {})
        decider = runner.decider
        if isinstance(decider, ConfiguredDecider) and params_problem(params, decider.convert_params) is not None:
            params = {}
        name = decider.name
        event = kind(id=f"{name}:rules:{uuid.uuid4().hex}", at=time.time(), source=name, params=params)  # type: ignore[call-arg]
        await runner.append_input([event])  # fenced, as its decisions

    return record_rules


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
    max_in_flight: int = MAX_IN_FLIGHT,
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
            max_in_flight=max_in_flight,
        )
        if setup is not None:
            setup(runner)
        await serve_until_signal_with_http(runner, metrics_port)
    finally:
        await close_promptly(log_)


async def close_promptly(log_: EventLog) -> None:
    """Close the log's connection, waiting ``CLOSE_TIMEOUT_S`` at most. Draining it waits for the
    server (with NATS unreachable, the drain and flush timeouts: 12 s); what is left unsent then is
    only unsubscriptions, which the server forgets with the connection. Everything the process had
    to store it awaited before. (A closing left running is ended by ``end_remaining_tasks``.)"""
    closing = asyncio.ensure_future(log_.close())
    done, _ = await asyncio.wait({closing}, timeout=CLOSE_TIMEOUT_S)
    if not done:
        log.warning("log connection not closed in time; leaving it", timeout_s=CLOSE_TIMEOUT_S)


def run_process(serve: Callable[[], Awaitable[None]]) -> None:
    """``asyncio.run(serve())``, then the process's other tasks ended (``end_remaining_tasks``):
    how every gpuherd process runs. nats-py's reconnect loop can swallow asyncio.run's one
    cancellation, and with NATS gone the process could wait for it for good."""

    async def serve_then_end() -> None:
        try:
            await serve()
        finally:
            await end_remaining_tasks()

    asyncio.run(serve_then_end())


async def end_remaining_tasks(timeout_s: float = END_TIMEOUT_S) -> None:
    """Cancel the process's other tasks (the NATS client's, a closing left running) until they end,
    for ``timeout_s`` at most (``cancel_until_done``; the ones they start meanwhile too). asyncio.run
    cancels each once at the end and waits for it, and some swallow a cancellation: nats-py's drain
    does (and flushes on for 10 s), and so does its reconnect loop, which kept a process stopped with
    NATS gone running for good."""
    current = asyncio.current_task()
    deadline = time.monotonic() + timeout_s
    while remaining := [task for task in asyncio.all_tasks() if task is not current]:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            log.warning("tasks still running at exit", tasks=[task.get_name() for task in remaining])
            return
        await cancel_until_done(remaining, timeout_s=left_s, retry_s=END_RETRY_S)
