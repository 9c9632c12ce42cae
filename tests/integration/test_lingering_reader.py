"""A follower that lingers (``read(..., linger_s=...)``) on a real nats-server: every event once and
in order, through bursts, pages, trickles and pauses; and while events flow, it takes them in
batches rather than one wake-up per event."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

from gpuherd import events as ev
from gpuherd.log import Record, open_log
from gpuherd.log.ordered import PULL


def cancel() -> ev.JobCancelRequested:
    return ev.JobCancelRequested(id=uuid.uuid4().hex, at=1.0, source="test", job=uuid.uuid4().hex[:10], reason="")


async def test_a_lingering_follower_reads_every_event_once_in_order(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="linger")
    seen: list[Record] = []
    try:
        start = await log_.last_seq() + 1

        async def follow() -> None:
            async for record in log_.read(start, follow=True, linger_s=0.05):
                seen.append(record)

        follower = asyncio.create_task(follow())
        expected: list[int] = []
        expected += await log_.append_pipelined([cancel() for _ in range(PULL + 500)])  # more than one pull
        for _ in range(20):  # a trickle, pages among single events
            expected += (await log_.append([cancel() for _ in range(1 + len(expected) % 3)])).seqs
            await asyncio.sleep(0.003)
        await asyncio.sleep(0.3)  # idle: the follower goes back to a waiting request
        expected += (await log_.append([cancel()])).seqs
        async with asyncio.timeout(30):
            while len(seen) < len(expected):
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # nothing more, nothing twice
        follower.cancel()
        assert [r.seq for r in seen] == sorted(expected)
    finally:
        await log_.close()


async def test_events_that_flow_reach_a_lingering_follower_in_batches(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="linger")
    arrivals: list[float] = []
    try:
        start = await log_.last_seq() + 1

        async def follow() -> None:
            async for _ in log_.read(start, follow=True, linger_s=0.25):
                arrivals.append(time.monotonic())

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        for _ in range(30):  # one event every ~5 ms for ~150 ms
            await log_.append([cancel()])
            await asyncio.sleep(0.005)
        async with asyncio.timeout(30):
            while len(arrivals) < 30:
                await asyncio.sleep(0.02)
        follower.cancel()
        # An arrival more than 2 ms after the one before starts a wake-up of its own.
        wakeups = 1 + sum(1 for a, b in itertools.pairwise(arrivals) if b - a > 0.002)
        assert wakeups <= 8, f"30 events over ~150 ms in {wakeups} wake-ups with a 250 ms linger"
    finally:
        await log_.close()
