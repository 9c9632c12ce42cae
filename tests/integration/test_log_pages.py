"""Pages on a real nats-server: one message per multi-event append, what readers make of a page
that is not what it should be, and a log from before pages keeping its positions."""

from __future__ import annotations

import uuid

import nats
from nats.js.api import StorageType, StreamConfig

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import HERD, HERD_SUBJECTS, open_log
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.log.pages import PAGE_HEADER, PAGE_SLOTS, POSITIONS_METADATA, encode_page


def uid() -> str:
    return uuid.uuid4().hex[:10]


def cancel(job: str, reason: str = "") -> ev.JobCancelRequested:
    return ev.JobCancelRequested(id=uid(), at=1.0, source="test", job=job, reason=reason)


def drained(node: str) -> ev.NodeDrained:
    return ev.NodeDrained(id=uid(), at=1.0, source="test", node=node, reason="")


async def test_a_multi_event_append_is_one_stored_message(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="pages")
    try:
        before = (await log_.js.stream_info(HERD)).state.last_seq
        result = await log_.append([cancel(uid()) for _ in range(50)])
        info = await log_.js.stream_info(HERD)
        assert info.state.last_seq == before + 1, "fifty events, one message"
        assert info.config.metadata[POSITIONS_METADATA] == str(PAGE_SLOTS)
        assert result.seqs == tuple(range(result.seqs[0], result.seqs[0] + 50))
        assert result.seqs[0] == info.state.last_seq * PAGE_SLOTS
        assert await log_.last_seq() == result.seqs[-1]
    finally:
        await log_.close()


async def test_appends_a_page_cannot_carry_are_stored_event_by_event(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="pages")
    try:
        before = (await log_.js.stream_info(HERD)).state.last_seq
        mixed = await log_.append([cancel(uid()), drained(f"n{uid()}")])  # a job's and a node's subject
        assert (await log_.js.stream_info(HERD)).state.last_seq == before + 2
        big = [cancel(uid(), reason="x" * 200_000) for _ in range(50)]  # more than one message may carry
        stored = await log_.append(big)
        assert (await log_.js.stream_info(HERD)).state.last_seq == before + 2 + 50
        got = await log_.read_all(mixed.seqs[0], stop=stored.seqs[-1])
        assert [r.seq for r in got] == [*mixed.seqs, *stored.seqs]
        assert [r.event.id for r in got[2:]] == [e.id for e in big]
    finally:
        await log_.close()


async def test_a_page_holding_what_its_subject_does_not_permit_reads_as_unreadable(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="pages")
    try:
        mine, other = drained("n1"), drained("n2")  # n1's agent may not write n2's events
        data = encode_page([ev.encode(mine), ev.encode(other), b'{"type":"NoSuchEvent"}'], [None, None, None])
        ack = await log_.js.publish("herd.node.n1", data, headers={PAGE_HEADER: "3"})
        records = await log_.read_all(ack.seq * PAGE_SLOTS, stop=ack.seq * PAGE_SLOTS + 2)
        assert records[0].event == mine
        assert isinstance(records[1].event, ev.Unreadable) and "may not travel in a page" in records[1].event.reason
        assert isinstance(records[2].event, ev.Unreadable)
        garbage = await log_.js.publish("herd.node.n1", b"not a page", headers={PAGE_HEADER: "2"})
        [record] = await log_.read_all(garbage.seq * PAGE_SLOTS, stop=garbage.seq * PAGE_SLOTS)
        assert isinstance(record.event, ev.Unreadable) and "not a page" in record.event.reason
    finally:
        await log_.close()


async def test_a_log_from_before_pages_keeps_its_positions(local_nats) -> None:
    nc = await nats.connect(local_nats.url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=HERD, subjects=list(HERD_SUBJECTS), storage=StorageType.FILE))
        old = cancel(uid())
        await js.publish(old.subject(), ev.encode(old), headers={"Nats-Msg-Id": old.id})
    finally:
        await nc.close()
    log_ = await JetStreamLog.open(local_nats.url, persistent=False)
    try:
        info = await log_.js.stream_info(HERD)
        assert info.config.metadata[POSITIONS_METADATA] == "1"
        result = await log_.append([cancel(uid()) for _ in range(3)])
        assert result.seqs == (2, 3, 4), "an atomic batch, positions = sequences"
        assert [r.seq for r in await log_.read_all()] == [1, 2, 3, 4]
        assert (await log_.read_all(1, stop=1))[0].event == old
    finally:
        await log_.close()


async def test_an_empty_stream_without_the_metadata_starts_with_pages(local_nats) -> None:
    nc = await nats.connect(local_nats.url)
    try:
        await nc.jetstream().add_stream(StreamConfig(name=HERD, subjects=list(HERD_SUBJECTS), storage=StorageType.FILE))
    finally:
        await nc.close()
    log_ = await JetStreamLog.open(local_nats.url, persistent=False)
    try:
        result = await log_.append([cancel(uid()) for _ in range(3)])
        assert result.seqs == (PAGE_SLOTS, PAGE_SLOTS + 1, PAGE_SLOTS + 2)
    finally:
        await log_.close()


async def test_a_job_whose_submission_is_in_another_jobs_page_is_found(nats_url: str) -> None:
    """JetStream's subject index sees only a page's own subject: the client still finds every job of
    a page (here with no scheduler to ask, so by reading the log) and can cancel it."""
    log_ = await open_log(nats_url, name="pages")
    client = await Client.connect(nats_url, source="pages")
    try:
        spec = ev.JobSpec(name="p", user="u", gpus=1)
        jobs = [f"p{uid()}" for _ in range(3)]
        await log_.append([ev.JobSubmitted(id=f"sub-{job}", job=job, spec=spec, intake_source="t") for job in jobs])
        assert await log_.subject_last_seq(f"herd.job.{jobs[1]}") == 0, "not on the server's index"
        assert all([await client.job_exists(job) for job in jobs])
        assert not await client.job_exists(f"p{uid()}")
        await client.cancel(jobs[2], "found in a page")
        assert any(
            isinstance(r.event, ev.JobCancelRequested) and r.event.job == jobs[2]
            for r in await log_.read_all(await log_.tail_start(1))
        )
    finally:
        await client.close()
        await log_.close()


async def test_any_window_of_positions_reads_exactly_the_events_in_it(nats_url: str) -> None:
    """Singles, pages and atomic batches mixed: reading from any position to any other yields the
    events whose positions lie between, in order, wherever the bounds fall in a page."""
    import random

    rng = random.Random(7)
    log_ = await open_log(nats_url, name="pages")
    try:
        positions: list[int] = []
        ids: dict[int, str] = {}
        for _ in range(12):
            size = rng.choice([1, 1, 2, 5, 17])
            events = [cancel(uid()) for _ in range(size)]
            if size > 1 and rng.random() < 0.25:  # a job's and a node's subject: not a page
                events[-1] = drained(f"n{uid()}")
            result = await log_.append(events)
            positions += result.seqs
            ids.update(zip(result.seqs, (e.id for e in events), strict=True))
        assert positions == sorted(set(positions))
        everything = await log_.read_all(positions[0], stop=positions[-1])
        assert [r.seq for r in everything] == positions
        for _ in range(40):
            start = rng.randint(positions[0] - 3, positions[-1] + 3)
            stop = rng.randint(start, positions[-1] + 3)
            want = [p for p in positions if start <= p <= stop]
            # (Positions before the first are other tests' events on the shared server.)
            got = [r async for r in log_.read(start, stop=stop) if r.seq >= positions[0]]
            assert [r.seq for r in got] == want, (start, stop)
            assert [r.event.id for r in got] == [ids[p] for p in want]
    finally:
        await log_.close()


async def test_a_paged_log_whose_metadata_was_dropped_is_refused_not_misnumbered(local_nats) -> None:
    import pytest

    from gpuherd.errors import LogError

    log_ = await JetStreamLog.open(local_nats.url, persistent=False)
    try:
        await log_.append([cancel(uid()) for _ in range(3)])
        # What an older gpuherd's stream update does: its config has no metadata, which clears ours.
        config = (await log_.js.stream_info(HERD)).config
        config.metadata = None
        await log_.js.update_stream(config)
        assert POSITIONS_METADATA not in ((await log_.js.stream_info(HERD)).config.metadata or {})
    finally:
        await log_.close()
    again = await JetStreamLog.open(local_nats.url, persistent=False)
    try:
        with pytest.raises(LogError, match=POSITIONS_METADATA):
            await again.read_all()
    finally:
        await again.close()
