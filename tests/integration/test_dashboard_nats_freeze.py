"""The dashboard notices a frozen NATS within seconds. A SIGSTOPped (or partitioned) server keeps
every connection open: nats-py notices only after minutes of unanswered pings, the log's follow just
sees no events (as on a quiet cluster), and open pages said "live" through the outage. The dashboard
now asks NATS for an answer every second, and its pages' stream says how long it has been silent
(tests/unit/test_dashboard_view.py; the badge in a browser: tests/e2e/test_dashboard_walkthrough.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

from gpuherd.log import open_log
from gpuherd.natsd import NatsServer
from services.dashboard.service import Dashboard, Tools

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_the_dashboard_says_how_long_a_frozen_nats_has_been_silent(
    local_nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("services.dashboard.service.NATS_PROBE_EVERY_S", 0.2)
    monkeypatch.setattr("services.dashboard.service.NATS_PROBE_TIMEOUT_S", 0.5)
    assert local_nats.proc is not None
    pid = local_nats.proc.pid
    log_ = await open_log(local_nats.url, name="dashboard-freeze")
    dashboard = Dashboard(log_, tools=Tools())
    task = asyncio.create_task(dashboard.watch_nats())
    try:
        await _until(lambda: dashboard.nats_silent_s() < 0.3, 10, "a first answer")
        await asyncio.sleep(1.0)
        assert dashboard.nats_silent_s() < 0.5  # answered all along (not once, then silent)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(2.0)
        assert log_.is_connected()  # (the client sees nothing wrong)
        assert dashboard.nats_silent_s() >= 1.5
        os.kill(pid, signal.SIGCONT)
        await _until(lambda: dashboard.nats_silent_s() < 0.5, 5, "NATS answering again")
    finally:
        os.kill(pid, signal.SIGCONT)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await log_.close()
