"""What the shutdown tests share: how long a stop may take, and how a test stops a service's task
and closes its connection with NATS gone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from gpuherd.log import EventLog
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.natsd import NatsServer

STOPS_WITHIN_S = 1.0


async def stopped_within(task: asyncio.Task[None], stop: asyncio.Event) -> float:
    """Set ``stop``; the seconds ``task`` took to end (it fails the test after 5 s)."""
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(asyncio.shield(task), 5.0)
    return time.monotonic() - started


async def end(task: asyncio.Task[None], stop: asyncio.Event, log_: EventLog) -> None:
    stop.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert isinstance(log_, JetStreamLog)
    with contextlib.suppress(ConnectionError):  # (its unsent bytes, NATS being gone)
        await log_.nc.close()  # not drained, which NATS gone refuses: it would go on reconnecting


def outage_once_lead_is_taken(log_: EventLog, server: NatsServer) -> asyncio.Event:
    """Kill ``server`` as soon as ``log_`` takes any leadership (the service is then about to fence,
    or to load its snapshot); the event is set once it has."""
    taken = asyncio.Event()
    leadership_of = log_.leadership

    def leadership(name: str, holder: str) -> Any:
        lead = leadership_of(name, holder)
        try_acquire = lead.try_acquire

        async def acquire_then_outage() -> bool:
            ok = await try_acquire()
            if ok:
                server.kill()
                taken.set()
            return ok

        lead.try_acquire = acquire_then_outage  # type: ignore[method-assign]
        return lead

    log_.leadership = leadership  # type: ignore[method-assign]
    return taken


async def sigterm_with_nats_away(
    process: subprocess.Popen[bytes], server: NatsServer, outage: str, output: Path, *, wait_s: float
) -> None:
    """Take NATS away (``outage``: "killed", or "frozen": connected and nothing answers), then
    SIGTERM ``process``: it must end cleanly within ``STOPS_WITHIN_S`` (``output``: its output, shown
    when it does not)."""
    assert server.proc is not None
    if outage == "killed":
        server.kill()
    else:
        os.kill(server.proc.pid, signal.SIGSTOP)
    await asyncio.sleep(0.5)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    returncode = await asyncio.to_thread(process.wait, wait_s)
    took = time.monotonic() - started
    assert returncode == 0, output.read_text()[-2000:]
    assert took < STOPS_WITHIN_S, f"ended {took:.2f} s after SIGTERM"
