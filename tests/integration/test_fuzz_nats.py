"""Hypothesis-drawn bytes on every subject the running services consume, through a real NATS:
no service crashes, no consumer sticks, every bad message is answered (intake, requests) or kept as
a dead letter with the reason (stored events), and the system still runs a job afterwards."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.errors import EventDecodeError
from gpuherd.log import HERD, open_log
from gpuherd.log.pages import PAGE_SLOTS
from gpuherd.natsd import NatsServer
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import Services, wait_scheduler_ready, wait_state

pytestmark = pytest.mark.slow

HERD_SUBJECTS = ("herd.job.fz", "herd.node.fz", "herd.lease.fz", "herd.clock.fz", "herd.vc.fz", "herd.cluster.fz")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
payloads = (
    st.binary(max_size=200)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.sampled_from(sorted(ev.EVENT_TYPES)).map(lambda t: json.dumps({"type": t, "node": 7}).encode())
)


class Bridge:
    """An event loop in a thread, so hypothesis' synchronous examples can talk to NATS."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root: Path = tmp_path_factory.mktemp("fuzz")
    server = NatsServer(root / "nats").start()
    services = Services(server.url, root, agents=1, gpus=2)
    for name in ("elastic", "memory", "analytics"):
        services.specs[name] = ["-m", f"services.{name}", "--nats-url", server.url]
    services.start_all()
    bridge = Bridge()

    async def open_() -> tuple[Any, Client]:
        log_ = await open_log(server.url, name="fuzz")
        await wait_scheduler_ready(log_, timeout=60)
        await wait_state(log_, lambda s: len(s.nodes) == 1, 30)
        return log_, await Client.connect(server.url, source="fuzz")

    log_, client = bridge.run(open_())
    stored: list[int] = []
    try:
        yield {"bridge": bridge, "log": log_, "client": client, "stored": stored, "services": services}
    finally:
        bridge.run(client.close())
        bridge.run(log_.close())
        bridge.close()
        services.stop_all()
        server.stop()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(payload=payloads)
def test_bad_bytes_on_every_consumed_subject(running: dict[str, Any], payload: bytes) -> None:
    bridge, log_, client = running["bridge"], running["log"], running["client"]

    async def one() -> None:
        for subject in HERD_SUBJECTS:
            ack = await log_.js.publish(subject, payload)
            try:
                ev.decode(payload)  # a few draws are valid events (every field has a default): not dead letters
            except EventDecodeError:
                running["stored"].append(ack.seq * PAGE_SLOTS)  # its position (a fresh log: pages)
        verdict = await client.submit_raw(payload, timeout=30)
        assert verdict.ok is False and verdict.error, verdict
        await log_.nc.publish("herd.telemetry.n1.heartbeat", payload)
        await log_.nc.publish("herd.telemetry.n1.gpus", payload)
        logs = msgspec.json.decode(await log_.request("n1.logs", payload, timeout=10))
        assert logs["ok"] is False and logs["error"]
        ready = msgspec.json.decode(await log_.request("scheduler.ready", payload, timeout=10))
        assert ready["ok"] is True

    bridge.run(one())


def test_after_the_fuzz_everything_still_works(running: dict[str, Any]) -> None:
    """Runs after the fuzz (file order): every stored bad message is a dead letter, nothing crashed,
    no consumer is stuck: a real job still runs, and the audit finds no mismatch."""
    bridge, log_, client, stored = running["bridge"], running["log"], running["client"], running["stored"]
    assert stored, "the fuzz test must run first"

    async def check() -> None:
        job = await client.submit({"name": "after", "user": "u", "gpus": 1, "duration_s": 0.5}, timeout=30)
        await wait_state(log_, lambda s: job in s.jobs and s.jobs[job].status == "completed", 60)
        for _ in range(100):  # the services' dead letters trail their reading by a moment
            letters = await log_.dead_letters()
            if {d.seq for d in letters if d.stream == HERD} >= set(stored):
                break
            await asyncio.sleep(0.2)
        dead = {d.seq: d for d in letters if d.stream == HERD}
        assert set(stored) <= set(dead), f"{len(set(stored) - set(dead))} bad events without a dead letter"
        assert all(d.reason and d.consumer for d in dead.values())
        records = await log_.read_all()
        assert {r.seq for r in records if isinstance(r.event, ev.Unreadable)} == set(stored)
        report = audit(records, SchedulerDecider())
        assert report.ok, report.mismatches[:3]

    bridge.run(check(), timeout=120)
    assert running["services"].crashed() == [], running["services"].logs()
