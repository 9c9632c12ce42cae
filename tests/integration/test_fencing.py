"""A leader's fence on JetStream: once a newer leader appended its ``LeadershipTaken``, the log
itself (``Nats-Expected-Last-Subject-Sequence-Subject``) refuses the former leader's appends,
single events and atomic batches alike."""

from __future__ import annotations

import asyncio

import pytest

from gpuherd import events as ev
from gpuherd.errors import LeadershipLost
from gpuherd.log import LEADERSHIP_BUCKET, open_log
from gpuherd.runtime.runner import DeciderRunner
from services.scheduler.decide import SchedulerDecider


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
