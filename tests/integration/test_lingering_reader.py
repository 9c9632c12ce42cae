"""A follower that lingers (``read(..., linger_s=...)``) on a real nats-server: every event once and
in order, through bursts, pages, trickles and pauses; and while events flow, it takes them in
batches rather than one wake-up per event."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator

from gpuherd import events as ev
from gpuherd.log import EventLog, Record, open_log
from gpuherd.log.ordered import PULL


def cancel() -> ev.JobCancelRequested:
    return ev.JobCancelRequested(id=uuid.uuid4().hex, at=1.0, source="test", job=uuid.uuid4().hex[:10], reason="")


@contextlib.asynccontextmanager
async def following(nats_url: str, linger_s: float) -> AsyncIterator[tuple[EventLog, list[tuple[Record, float]]]]:
    """A log, and what a lingering follower of it from its current end has read (with when)."""
    log_ = await open_log(nats_url, name="linger")
    seen: list[tuple[Record, float]] = []
    start = await log_.last_seq() + 1

    async def follow() -> None:
        async for record in log_.read(start, follow=True, linger_s=linger_s):
            seen.append((record, time.monotonic()))

    follower = asyncio.create_task(follow())
    try:
        yield log_, seen
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await log_.close()


async def test_a_lingering_follower_reads_every_event_once_in_order(nats_url: str) -> None:
    async with following(nats_url, linger_s=0.05) as (log_, seen):
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
        assert [record.seq for record, _ in seen] == sorted(expected)


async def test_events_that_flow_reach_a_lingering_follower_in_batches(nats_url: str) -> None:
    async with following(nats_url, linger_s=0.25) as (log_, seen):
        await asyncio.sleep(0.1)
        for _ in range(30):  # one event every ~5 ms for ~150 ms
            await log_.append([cancel()])
            await asyncio.sleep(0.005)
        async with asyncio.timeout(30):
            while len(seen) < 30:
                await asyncio.sleep(0.02)
        arrivals = [at for _, at in seen]
        # An arrival more than 2 ms after the one before starts a wake-up of its own.
        wakeups = 1 + sum(1 for a, b in itertools.pairwise(arrivals) if b - a > 0.002)
        assert wakeups <= 8, f"30 events over ~150 ms in {wakeups} wake-ups with a 250 ms linger"
