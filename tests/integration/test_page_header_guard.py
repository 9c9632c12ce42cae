"""A page whose header is no count of events (``Gpuherd-Page: two``, 0, more than a page holds) as the
log's last message: readers take the page for what is in it (a bad page is an Unreadable, a dead
letter) rather than crash on the header, and the log's head is the position of its last record."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from apps.cli import build_parser
from gpuherd import events as ev
from gpuherd.log import EventLog, open_log
from gpuherd.log.pages import PAGE_HEADER, PAGE_SLOTS, encode_page
from gpuherd.natsd import NatsServer


def drained(node: str) -> ev.NodeDrained:
    return ev.NodeDrained(id=uuid.uuid4().hex[:10], at=1.0, source="test", node=node, reason="")


async def store(log_: EventLog, data: bytes, page_header: str) -> int:
    """``data`` stored on herd.node.n1 under a page header as given; its message's first position."""
    ack = await log_.js.publish("herd.node.n1", data, headers={PAGE_HEADER: page_header})  # type: ignore[attr-defined]
    return int(ack.seq) * PAGE_SLOTS


@pytest.mark.parametrize("page_header", ["two", "", " ", "1.5", "0x2"])
async def test_a_last_page_whose_header_is_no_number_reads_as_one_unreadable(
    local_nats: NatsServer, page_header: str
) -> None:
    log_ = await open_log(local_nats.url, name="bad-header", persistent=False)
    try:
        await log_.append([drained("n1")])
        position = await store(log_, b"not a page", page_header)
        assert await log_.last_seq() == position
        last = (await log_.read_all())[-1]
        assert last.seq == position
        assert isinstance(last.event, ev.Unreadable) and "not a page" in last.event.reason
    finally:
        await log_.close()


@pytest.mark.parametrize("page_header", ["0", "-2", str(PAGE_SLOTS + 1)])
async def test_a_last_page_whose_header_is_no_count_a_page_holds_takes_its_events(
    local_nats: NatsServer, page_header: str
) -> None:
    log_ = await open_log(local_nats.url, name="bad-count", persistent=False)
    try:
        events = [drained("n1"), drained("n1")]
        position = await store(log_, encode_page([ev.encode(e) for e in events], [None, None]), page_header)
        assert await log_.last_seq() == position + 1  # (not beyond its message's positions, nor before them)
        records = await log_.read_all()
        assert [(r.seq, r.event) for r in records[-2:]] == [(position, events[0]), (position + 1, events[1])]
    finally:
        await log_.close()


def test_gpuherd_jobs_reads_a_log_whose_last_page_has_a_bad_header(local_nats: NatsServer) -> None:
    async def prepare() -> None:
        log_ = await open_log(local_nats.url, name="bad-header", persistent=False)
        try:
            await store(log_, b"not a page", "two")
        finally:
            await log_.close()

    asyncio.run(prepare())
    args = build_parser().parse_args(["--nats-url", local_nats.url, "jobs"])
    assert args.func(args) == 0  # it raised ValueError: invalid literal for int() with base 10: 'two'
