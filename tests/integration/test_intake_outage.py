"""The scheduler's intake through an outage of the log, on a real nats-server: a verdict that takes
long to store does not use up its submission's deliveries, even across a restart of the scheduler,
and a dead letter that cannot be stored leaves its message unacknowledged until it is."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.errors import LogUnavailable
from gpuherd.log import HERD_DEAD, HERD_INTAKE, MAX_DELIVERIES, DeadLetter, EventLog, open_log
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.log.records import AppendResult
from gpuherd.natsd import NatsServer
from services.scheduler import service
from tests.helpers import node, running_scheduler

ACK_WAIT_S = 0.5
GOOD = {"name": "slow", "user": "u", "gpus": 1, "duration_s": 1}


class HerdOutage:
    """While ``on``, appending a verdict fails as it does while HERD has no leader (the runner
    retries it); everything else is stored as usual."""

    def __init__(self, log_: EventLog) -> None:
        self.on = True
        self._append = log_.append
        log_.append = self.append  # type: ignore[method-assign]

    async def append(self, events: Sequence[ev.Event], **kwargs: Any) -> AppendResult:
        if self.on and any(isinstance(e, ev.JobSubmitted | ev.JobRejected) for e in events):
            raise LogUnavailable("stream HERD has no leader (the test's outage)")
        return await self._append(events, **kwargs)


async def outcome(log_: EventLog, within_s: float = 30.0) -> tuple[list[ev.JobSubmitted], list[DeadLetter]]:
    """Wait until the submission is either stored as a job or kept as a dead letter."""
    async with asyncio.timeout(within_s):
        while True:
            submitted = [r.event for r in await log_.read_all() if isinstance(r.event, ev.JobSubmitted)]
            dead = [d for d in await log_.dead_letters() if d.stream == HERD_INTAKE]
            if submitted or dead:
                return submitted, dead
            await asyncio.sleep(0.1)


async def test_a_verdict_stored_late_does_not_use_up_its_submissions_deliveries(local_nats: NatsServer) -> None:
    """The log is away for longer than ``MAX_DELIVERIES`` acknowledgement waits while a valid
    submission's verdict is on its way, and the scheduler restarts: the submission is a job, not
    a dead letter (its redeliveries were kept back, none of them was a failure to handle it)."""
    log_ = await open_log(local_nats.url, name="intake-outage")
    try:
        await log_.append([node("n1", 4)])
        outage = HerdOutage(log_)
        async with running_scheduler(log_, "a", ack_wait_s=ACK_WAIT_S):
            await log_.publish_intake("teamA", msgspec.json.encode(GOOD))
            await asyncio.sleep(ACK_WAIT_S * (MAX_DELIVERIES + 3))  # its verdict retried all along
        outage.on = False  # the log is back, and the scheduler starts again
        async with running_scheduler(log_, "b", ack_wait_s=ACK_WAIT_S):
            submitted, dead = await outcome(log_)
        assert dead == [], f"a valid submission became a dead letter: {dead[0].reason}"
        assert [s.spec.name for s in submitted] == ["slow"]
    finally:
        await log_.close()


async def acknowledged_up_to(log_: JetStreamLog) -> int:
    """The intake sequence up to which the scheduler's consumer has acknowledged everything."""
    info = await log_.js.consumer_info(HERD_INTAKE, service.INTAKE_CONSUMER)
    return int(info.ack_floor.stream_seq)


async def test_a_dead_letter_not_stored_leaves_its_message_for_redelivery_until_it_is(local_nats: NatsServer) -> None:
    """A submission delivered ``MAX_DELIVERIES`` times without an answer, while the dead letters'
    stream is away for longer than the scheduler's patience: it is not acknowledged (that would
    lose it), and it is kept as a dead letter once the stream is back."""
    log_ = await open_log(local_nats.url, name="dead-letter-outage")
    assert isinstance(log_, JetStreamLog)
    try:
        # Its handling "crashed the scheduler" MAX_DELIVERIES times: delivered, never acknowledged.
        crashing = log_.intake_consumer(service.INTAKE_CONSUMER, ack_wait=ACK_WAIT_S)
        await log_.publish_intake("teamA", b"poison")
        deliveries = 0
        async with asyncio.timeout(30):
            while deliveries < MAX_DELIVERIES:
                deliveries = max([d.deliveries for d in await crashing.fetch(1, timeout=ACK_WAIT_S)] or [deliveries])
        await crashing.close()
        dead_config = next(c for c in log_.stream_configs() if c.name == HERD_DEAD)
        await log_.js.delete_stream(HERD_DEAD)  # the dead letters' stream is away
        async with running_scheduler(log_, "a", ack_wait_s=ACK_WAIT_S, dead_letter_patience_s=ACK_WAIT_S):
            await asyncio.sleep(ACK_WAIT_S * 6)  # it gave up on storing the dead letter, more than once
            assert await acknowledged_up_to(log_) == 0, "acknowledged, though kept nowhere"
            await log_.js.add_stream(dead_config)  # back
            async with asyncio.timeout(30):
                while not (dead := await log_.dead_letters()) or await acknowledged_up_to(log_) < 1:
                    await asyncio.sleep(0.1)
        [letter] = dead
        assert (letter.stream, letter.seq, letter.data) == (HERD_INTAKE, 1, b"poison")
        assert letter.deliveries > MAX_DELIVERIES and "stopped while handling it each time" in letter.reason
    finally:
        await log_.close()


async def test_the_scheduler_hands_its_runner_at_most_max_handed_submissions_not_yet_answered(
    local_nats: NatsServer,
) -> None:
    """While no verdict can be stored, intake takes no more than ``MAX_HANDED`` submissions from the
    stream (the log's events would wait behind every one of them); the rest stay stored there, and
    every one is judged once the log is back."""
    log_ = await open_log(local_nats.url, name="intake-handed")
    assert isinstance(log_, JetStreamLog)
    total = service.MAX_HANDED + 40
    try:
        await log_.append([node("n1", 8)])
        outage = HerdOutage(log_)
        async with running_scheduler(log_, "a"):
            for i in range(total):
                await log_.publish_intake("teamH", msgspec.json.encode(GOOD | {"intake_id": f"h{i}"}))
            async with asyncio.timeout(20):
                while (await log_.js.consumer_info(HERD_INTAKE, service.INTAKE_CONSUMER)).num_ack_pending < 1:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # (time to take more, were it to)
            info = await log_.js.consumer_info(HERD_INTAKE, service.INTAKE_CONSUMER)
            assert 0 < info.num_ack_pending <= service.MAX_HANDED, info
            assert info.num_pending >= total - service.MAX_HANDED, "the rest wait in the stream"
            outage.on = False
            async with asyncio.timeout(30):
                while len([r for r in await log_.read_all() if isinstance(r.event, ev.JobSubmitted)]) < total:
                    await asyncio.sleep(0.2)
    finally:
        await log_.close()
