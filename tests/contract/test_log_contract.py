"""One contract for both EventLog implementations (in-memory, and JetStream on a real nats-server).

Tests are written relative to the log's current end, so they also pass on a
shared server (NATS_URL).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gpuherd import events as ev
from gpuherd.errors import ConcurrencyError, LeadershipLost
from gpuherd.log import LEADERSHIP_BUCKET, SNAPSHOT_BUCKET, EventLog, InProcessLog, open_log


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "jetstream"])
async def log(request, nats_url):
    if request.param == "memory":
        yield InProcessLog()
        return
    log_ = await open_log(nats_url, name="contract")
    yield log_
    await log_.close()


def uid() -> str:
    return uuid.uuid4().hex[:10]


def cancel(job: str, id_: str | None = None) -> ev.JobCancelRequested:
    return ev.JobCancelRequested(id=id_ or uid(), at=1.0, source="test", job=job)


async def test_positions_increase_and_are_readable(log: EventLog) -> None:
    start = await log.last_seq()
    job = uid()
    one = await log.append([cancel(job)])
    two = await log.append([cancel(job), cancel(job), cancel(job)])
    positions = [*one.seqs, *two.seqs]
    # Increasing and unique, not contiguous: JetStream's pages give each message a range of positions.
    assert start < positions[0] and positions == sorted(set(positions)) and len(positions) == 4
    got = await log.read_all(start + 1)
    assert [r.seq for r in got] == positions
    assert all(r.event.job == job for r in got)
    assert [r.seq for r in await log.read_all(positions[1], stop=positions[2])] == positions[1:3]
    assert [r.seq for r in await log.read_all(positions[0] + 1, stop=positions[3] - 1)] == positions[1:3]
    assert await log.last_seq() == positions[-1]
    assert log.behind(positions[0], positions[-1]) >= 1 and log.behind(positions[-1], positions[-1]) == 0
    # At least the last two events are read from the tail's start.
    assert [r.seq for r in await log.read_all(await log.tail_start(2))][-2:] == positions[-2:]


async def test_append_is_idempotent_by_event_id(log: EventLog) -> None:
    event = cancel(uid())
    first = await log.append([event])
    again = await log.append([event])
    assert again.duplicate and again.seqs == first.seqs
    batch = [cancel(uid()), cancel(uid())]
    stored = await log.append(batch)
    end = await log.last_seq()
    repeated = await log.append(batch)
    assert repeated.duplicate and repeated.seqs in (stored.seqs, ())
    if isinstance(log, InProcessLog):
        # (JetStream deduplicates a page whole: writers never append a batch that shares only some
        # ids with stored events; the interface says so.)
        assert (await log.append([batch[0], cancel(uid())])).duplicate, "a batch with a seen id is refused whole"
    assert await log.last_seq() == end


async def test_every_event_of_a_multi_event_append_is_found_by_its_subject(log: EventLog) -> None:
    jobs = [uid() for _ in range(3)]
    await log.append([cancel(job) for job in jobs])
    for job in jobs:
        assert await log.subject_seen(f"herd.job.{job}")
    assert not await log.subject_seen(f"herd.job.{uid()}")


async def test_expected_subject_sequence(log: EventLog) -> None:
    job = uid()
    subject = f"herd.job.{job}"
    assert await log.subject_last_seq(subject) == 0
    first = await log.append([cancel(job)], expect={subject: 0})
    assert await log.subject_last_seq(subject) == first.seqs[0]
    with pytest.raises(ConcurrencyError, match=subject):
        await log.append([cancel(job)], expect={subject: 0})
    await log.append([cancel(job)], expect={subject: first.seqs[0]})


async def test_multi_event_append_is_all_or_nothing(log: EventLog) -> None:
    taken = uid()
    await log.append([cancel(taken)])
    end = await log.last_seq()
    fresh = uid()
    with pytest.raises(ConcurrencyError):
        await log.append([cancel(fresh), cancel(taken)], expect={f"herd.job.{fresh}": 0, f"herd.job.{taken}": 0})
    assert await log.last_seq() == end
    assert await log.subject_last_seq(f"herd.job.{fresh}") == 0, "the first event must not have been stored"


async def test_follow_sees_new_events(log: EventLog) -> None:
    start = await log.last_seq()
    job = uid()
    seen: list[int] = []

    async def reader() -> None:
        async for record in log.read(start + 1, follow=True):
            seen.append(record.seq)
            if len(seen) == 3:
                return

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.1)
    one = await log.append([cancel(job)])
    two = await log.append([cancel(job), cancel(job)])
    await asyncio.wait_for(task, 10)
    assert seen == [*one.seqs, *two.seqs]


async def test_trace_context_travels_with_events(log: EventLog) -> None:
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    result = await log.append([cancel(uid())], trace=trace)
    [record] = await log.read_all(result.seqs[0], stop=result.seqs[0])
    assert record.trace == trace


async def test_durable_consumer_resumes_after_last_ack(log: EventLog) -> None:
    name = f"c-{uid()}"
    source = f"s{uid()}"
    consumer = log.intake_consumer(name, ack_wait=1.0)
    await consumer.fetch(100, timeout=0.3)  # creates the consumer; skip what other tests left
    for d in await consumer.fetch(1000, timeout=0.5):
        await consumer.ack(d)
    for i in range(3):
        await log.publish_intake(source, f"m{i}".encode(), {"k": str(i)})
    got: list = []
    for _ in range(20):  # a fetch may return fewer than are ready; keep fetching
        got += [d for d in await consumer.fetch(10, timeout=0.5) if d.subject == f"herd.intake.{source}"]
        if len(got) >= 3:
            break
    assert [d.data for d in got] == [b"m0", b"m1", b"m2"]
    assert got[0].headers.get("k") == "0"
    await consumer.ack(got[0])
    await consumer.ack(got[1])
    # m2 was not acknowledged: closed (as a stopping service closes it), the next consumer object with
    # the same name gets it again after ack_wait.
    await consumer.close()
    again = log.intake_consumer(name, ack_wait=1.0)
    redelivered: list = []
    for _ in range(20):
        redelivered += [d for d in await again.fetch(10, timeout=0.5) if d.subject == f"herd.intake.{source}"]
        if redelivered:
            break
        if isinstance(log, InProcessLog):
            await asyncio.sleep(1.1)  # InProcessLog uses the wall clock by default, like JetStream's ack_wait
    assert [d.data for d in redelivered] == [b"m2"]
    assert redelivered[0].deliveries == 2
    await again.ack(redelivered[0])


async def test_a_message_reported_in_progress_is_not_delivered_again(log: EventLog) -> None:
    """Each delivery counts in ``deliveries`` (the dead letters' measure): one still being handled
    is kept back for as long as its handler says so within ``ack_wait``, and comes back after."""
    name, source = f"c-{uid()}", f"s{uid()}"
    subject = f"herd.intake.{source}"
    consumer = log.intake_consumer(name, ack_wait=1.0)
    await consumer.fetch(100, timeout=0.3)  # creates the consumer; skip what other tests left
    for d in await consumer.fetch(1000, timeout=0.5):
        await consumer.ack(d)
    await log.publish_intake(source, b"slow")
    got: list = []
    for _ in range(20):
        got += [d for d in await consumer.fetch(10, timeout=0.5) if d.subject == subject]
        if got:
            break
    [first] = got
    loop = asyncio.get_running_loop()
    until = loop.time() + 2.5  # more than twice its ack_wait
    while loop.time() < until:
        await consumer.in_progress(first)
        assert not [d for d in await consumer.fetch(10, timeout=0.3) if d.subject == subject], "delivered again"
    again: list = []
    for _ in range(20):  # no longer said to be in progress: delivered again after its ack_wait
        again += [d for d in await consumer.fetch(10, timeout=0.5) if d.subject == subject]
        if again:
            break
    assert [(d.data, d.deliveries) for d in again] == [(b"slow", 2)]
    await consumer.ack(again[0])
    await consumer.close()


async def test_kv_snapshots(log: EventLog) -> None:
    key = f"k{uid()}"
    assert await log.kv_get(SNAPSHOT_BUCKET, key) is None
    await log.kv_put(SNAPSHOT_BUCKET, key, b"state-1")
    await log.kv_put(SNAPSHOT_BUCKET, key, b"state-2")
    assert await log.kv_get(SNAPSHOT_BUCKET, key) == b"state-2"


async def test_leadership_is_exclusive_and_expires(log: EventLog) -> None:
    name = f"l{uid()}"
    a, b = log.leadership(name, "a"), log.leadership(name, "b")
    assert await a.try_acquire()
    assert not await b.try_acquire()
    await a.renew()
    await a.release()
    assert await b.try_acquire(), "a released leadership is free at once"
    with pytest.raises(LeadershipLost):
        await a.renew()
    # Expiry: b stops renewing; after the TTL, a gets it.
    if isinstance(log, InProcessLog):
        log.leadership_ttl = 0.3
        b2 = log.leadership(name, "b")
        assert await b2.try_acquire()
        a = log.leadership(name, "a")
    deadline = asyncio.get_running_loop().time() + log.leadership_ttl * 3
    while not await a.try_acquire():
        assert asyncio.get_running_loop().time() < deadline, "the leadership never expired"
        await asyncio.sleep(0.2)
    with pytest.raises(LeadershipLost):
        await b.renew()
    assert LEADERSHIP_BUCKET


async def test_telemetry_follow(log: EventLog) -> None:
    node = f"n{uid()}"
    got: list[bytes] = []

    async def reader() -> None:
        async for d in log.telemetry(f"{node}.heartbeat"):
            got.append(d.data)
            return

    task = asyncio.create_task(reader())
    for _ in range(50):
        await log.publish_telemetry(f"{node}.heartbeat", b"beat")
        await asyncio.sleep(0.1)
        if task.done():
            break
    await asyncio.wait_for(task, 5)
    assert got == [b"beat"]
