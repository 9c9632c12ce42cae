"""A leader's fence on JetStream: once a newer leader appended its ``LeadershipTaken``, the log
itself (``Nats-Expected-Last-Subject-Sequence-Subject``) refuses the former leader's appends,
single events and atomic batches alike; and only the leader records its ``--params``."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.errors import LeadershipLost
from gpuherd.log import LEADERSHIP_BUCKET, STATUS_BUCKET, EventLog, open_log
from gpuherd.metrics import ServiceStatus
from gpuherd.runtime.runner import DeciderRunner
from gpuherd.runtime.serve import configured_event
from services.elastic.decide import ElasticDecider
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import FAST_ENV


def tick(n: int) -> ev.ClockTicked:
    return ev.ClockTicked(id=f"scheduler:tick:fence-{n}", at=float(n), source="scheduler")


async def test_jetstream_refuses_a_fenced_out_leader(local_nats) -> None:
    log = await open_log(local_nats.url, name="fencing")
    try:
        zombie = DeciderRunner(log, SchedulerDecider(), instance="a")
        assert await zombie.acquire_leadership(asyncio.Event())
        await zombie.append_input([tick(1)])  # while it leads, its appends go through
        await zombie.append_input([tick(2), tick(3)])
        await log._kv[LEADERSHIP_BUCKET].delete("decider.scheduler")  # it froze past its lease
        newer = DeciderRunner(log, SchedulerDecider(), instance="b")
        assert await newer.acquire_leadership(asyncio.Event())
        head = await log.last_seq()
        with pytest.raises(LeadershipLost):
            await zombie.append_input([tick(4)])
        with pytest.raises(LeadershipLost):
            await zombie.append_input([tick(5), tick(6)])
        with pytest.raises(LeadershipLost):
            await zombie._append([tick(7), tick(8)], [None, None])
        assert await log.last_seq() == head, "nothing of the former leader reached the log"
        await newer.append_input([tick(9), tick(10)])
        records = await log.read_all()
        assert [r.event.instance for r in records if isinstance(r.event, ev.LeadershipTaken)] == ["a", "b"]
        assert [r.event.id for r in records if isinstance(r.event, ev.ClockTicked)] == [
            f"scheduler:tick:fence-{n}" for n in (1, 2, 3, 9, 10)
        ]
    finally:
        await log.close()


def elastic(url: str, instance: str, min_interval_s: float, log_file: Path) -> subprocess.Popen[bytes]:
    """``gpuherd serve elastic --params ...`` as its own process (its output in ``log_file``)."""
    params = json.dumps({"min_interval_s": min_interval_s})
    argv = [sys.executable, "-m", "services.elastic", "--nats-url", url, "--instance", instance, "--params", params]
    with log_file.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **FAST_ENV})


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


async def leaderships_and_parameters(log_: EventLog) -> list[tuple[str, object]]:
    """In log order: ("leader", instance) for each elastic leadership taken, ("params", interval)
    for each ``--params`` recorded."""
    out: list[tuple[str, object]] = []
    for record in await log_.read_all():
        event = record.event
        if isinstance(event, ev.LeadershipTaken) and event.service == "elastic":
            out.append(("leader", event.instance))
        elif isinstance(event, ev.ElasticConfigured) and event.id.startswith("elastic:config:"):
            out.append(("params", event.params["min_interval_s"]))
    return out


async def _has(log_: EventLog, entry: tuple[str, object]) -> bool:
    return entry in await leaderships_and_parameters(log_)


async def test_an_instance_leading_again_records_its_parameters_only_after_another_led(local_nats) -> None:
    """a's parameters are in force when it leads again after b led (b's were not a's); leading
    again with no other leader in between records nothing (an operator's newer command stands)."""
    log_ = await open_log(local_nats.url, name="params-relead")

    def runner(instance: str, min_interval_s: float) -> DeciderRunner:
        made = functools.partial(configured_event, ev.ElasticConfigured, "elastic", {"min_interval_s": min_interval_s})
        return DeciderRunner(log_, ElasticDecider(), instance=instance, parameters=made)

    async def lead(runner_: DeciderRunner) -> None:
        await log_._kv[LEADERSHIP_BUCKET].delete("decider.elastic")  # the last leader's lease expired
        runner_._reset()  # (as run() does when an instance steps down)
        assert await runner_.acquire_leadership(asyncio.Event())
        await runner_._record_parameters()

    try:
        a, b = runner("a", 11.0), runner("b", 22.0)
        await lead(a)
        await lead(a)  # its lease lapsed and it took it again: no one else led
        assert await leaderships_and_parameters(log_) == [("leader", "a"), ("params", 11.0), ("leader", "a")]
        await lead(b)
        await lead(a)
        assert (await leaderships_and_parameters(log_))[3:] == [
            ("leader", "b"),
            ("params", 22.0),
            ("leader", "a"),
            ("params", 11.0),
        ], "a leads again with its own parameters"
    finally:
        await log_.close()


async def test_only_the_leader_records_its_parameters_fenced(local_nats, tmp_path: Path) -> None:
    """A standby started with other ``--params`` records nothing while the leader leads (every
    instance used to append its own at start, unfenced), and records its own once it leads, after
    its fence."""
    log_ = await open_log(local_nats.url, name="params-fencing")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(elastic(local_nats.url, "a", 11.0, tmp_path / "a.log"))
        await until("a leads with its parameters", lambda: _has(log_, ("params", 11.0)))
        procs.append(elastic(local_nats.url, "b", 22.0, tmp_path / "b.log"))

        async def b_waits() -> bool:
            entry = (await log_.kv_entries(STATUS_BUCKET)).get("elastic.b")
            return entry is not None and msgspec.json.decode(entry, type=ServiceStatus).role == "standby"

        await until("b runs as a standby", b_waits)
        assert await leaderships_and_parameters(log_) == [("leader", "a"), ("params", 11.0)], "b is no leader"
        assert procs[0].poll() is None, "a serves on after recording them: " + (tmp_path / "a.log").read_text()
        procs[0].terminate()  # a stops and releases the leadership: b takes over
        await until("b leads with its parameters", lambda: _has(log_, ("params", 22.0)))
        assert await leaderships_and_parameters(log_) == [
            ("leader", "a"),
            ("params", 11.0),
            ("leader", "b"),
            ("params", 22.0),
        ]
        assert procs[1].poll() is None, "b serves on after recording them: " + (tmp_path / "b.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await log_.close()
