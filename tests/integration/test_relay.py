"""The report relay against a real nats-server: agents' reports stored many per commit, each once
(starts and ends of tasks as one page, others each its own message); what is not the asking agent's
to write refused; and an agent that gets no answer appends its report itself, with nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from gpuherd import events as ev
from gpuherd.log import STATUS_BUCKET, open_log
from gpuherd.log.jetstream import ATOMIC_FROM, JetStreamLog
from gpuherd.log.pages import PAGE_SLOTS
from gpuherd.log.relay import RELAYED_SUBJECT, REPORT_PREFIX, RelayClient, report_subject
from services.nodeagent.reconcile import AgentEvents
from services.nodeagent.writer import AgentWriter
from services.relay.relay import ReportRelay

pytestmark = pytest.mark.slow


def started(job: str, node: str, tag: str) -> ev.JobStarted:
    return ev.JobStarted(
        id=f"relay-test:{tag}:{job}:{node}", at=1.0, source=f"agent.{node}", job=job, attempt=0, node=node
    )


@pytest.fixture
async def log_(nats_url: str) -> AsyncIterator[JetStreamLog]:
    opened = await open_log(nats_url, name="relay-test")
    assert isinstance(opened, JetStreamLog)
    yield opened
    await opened.close()


@contextlib.asynccontextmanager
async def running(relay: ReportRelay) -> AsyncIterator[ReportRelay]:
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        for _ in range(100):  # (subscribed once it says it is healthy)
            if relay.health()[0]:
                break
            await asyncio.sleep(0.01)
        yield relay
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def stored_after(log_: JetStreamLog, head: int, prefix: str) -> list[Any]:
    return [r for r in await log_.read_all(head + 1) if r.event.id.startswith(prefix)]


def counted(relay: ReportRelay, outcome: str) -> float:
    return relay.reports.labels(outcome)._value.get()


async def test_many_agents_reports_are_stored_together_each_once(log_: JetStreamLog) -> None:
    head = await log_.last_seq()
    reports = [started(f"j{n}", f"n{n}", "many") for n in range(300)]
    async with running(ReportRelay(log_)) as relay:
        clients = [RelayClient(log_.nc, f"n{n}") for n in range(300)]
        answers = await asyncio.gather(*(c.store(r) for c, r in zip(clients, reports, strict=True)))
        statuses = await log_.kv_entries(STATUS_BUCKET)
    assert any(b'"role":"relay"' in value for value in statuses.values()), "gpuherd status lists it"
    assert all(answers), "every report stored through the relay"
    records = await stored_after(log_, head, "relay-test:many:")
    assert sorted(r.event.id for r in records) == sorted(r.id for r in reports), "each once"
    assert all(r.event.subject() == f"herd.job.j{n}.by.n{n}" for n, r in enumerate(sorted(records, key=_job_number)))
    # Starts of tasks: pages of the relay's (a message holds many), each report on its own subject.
    messages = {r.seq // PAGE_SLOTS for r in records}
    assert len(messages) < 300
    assert {(await log_.js.get_msg("HERD", seq)).subject for seq in messages} == {RELAYED_SUBJECT}
    appends = relay.batches._sum.get(), sum(b.get() for b in relay.batches._buckets)
    assert appends[0] == 300 and appends[1] == len(messages), f"{appends[1]} appends for 300 reports"


async def test_reports_other_than_starts_and_ends_are_stored_each_as_its_own_message(log_: JetStreamLog) -> None:
    """Those readers do not all take the first word of: a second copy (a relay's late one) is
    dropped by its id, as its agent would have stored it. A run of them between starts keeps its
    place in the order the reports came."""
    head = await log_.last_seq()
    drains = [ev.NodeDrained(id=f"relay-test:own:{n}", at=1.0, source=f"agent.o{n}", node=f"o{n}") for n in range(20)]
    reports: list[ev.Event] = [started("j0", "o0", "own"), *drains, started("j1", "o1", "own")]
    relay = ReportRelay(log_)
    replies = []
    for n, report in enumerate(reports):
        reply = log_.nc.new_inbox()
        replies.append(await log_.nc.subscribe(reply, max_msgs=1))
        node = report.node  # type: ignore[attr-defined]
        msg = nats.aio.msg.Msg(log_.nc, subject=report_subject(node), reply=reply, data=ev.encode(report))
        await relay._on_report(msg)
        assert len(relay._pending) == n + 1
    await relay.store(relay._pending)
    records = await stored_after(log_, head, "relay-test:own:")
    assert [r.event.id for r in records] == [r.id for r in reports], "in the order they came"
    drained = [r for r in records if isinstance(r.event, ev.NodeDrained)]
    assert all(r.seq % PAGE_SLOTS == 0 for r in drained), "each its own message"
    assert {(await log_.js.get_msg("HERD", r.seq // PAGE_SLOTS)).subject for r in drained} == {
        d.subject() for d in drains
    }
    for sub in replies:
        assert b'"ok":true' in (await sub.next_msg(timeout=2)).data


def _job_number(record: Any) -> int:
    return int(record.event.job[1:])


async def test_a_relay_stores_the_bytes_the_agent_wrote(log_: JetStreamLog) -> None:
    """An agent of a newer version may write a field this relay does not know: it is stored, not
    dropped by a decode and encode on the way (in a page, or as a message of its own)."""
    head = await log_.last_seq()
    report = started("j1", "newer", "bytes")
    alone = ev.NodeDrained(id="relay-test:bytes:drain", at=1.0, source="agent.newer", node="newer")
    async with running(ReportRelay(log_)):
        for event in (report, alone):
            data = ev.encode(event)[:-1] + b',"field_of_a_newer_agent":1}'
            answer = await log_.nc.request(report_subject("newer"), data, timeout=2)
            assert b'"ok":true' in answer.data
            [record] = [r for r in await stored_after(log_, head, "relay-test:bytes:") if r.event.id == event.id]
            stored = await log_.js.get_msg("HERD", record.seq // PAGE_SLOTS)
            assert stored.data == data if event is alone else data in stored.data


async def test_a_report_for_another_node_is_refused_and_nothing_is_stored(log_: JetStreamLog) -> None:
    head = await log_.last_seq()
    async with running(ReportRelay(log_)) as relay:
        client = RelayClient(log_.nc, "a")
        assert not await client.store(started("j1", "b", "other")), "agent a may not write node b's reports"
        bare = ev.NodeDrained(id="relay-test:other:drain", at=1.0, source="agent.a", node="a")
        assert await client.store(bare), "its own node's subject: stored (as NATS lets agent a append there)"
        msg = await log_.nc.request(report_subject("a"), b"{not json", timeout=2)
        assert b"ok" in msg.data and b"false" in msg.data
        assert counted(relay, "refused") == 2
    assert [r.event.id for r in await stored_after(log_, head, "relay-test:other:")] == ["relay-test:other:drain"]


async def test_without_a_relay_an_agent_appends_itself_and_asks_again_only_later(log_: JetStreamLog) -> None:
    head = await log_.last_seq()
    now = [100.0]
    client = RelayClient(log_.nc, "solo", clock=lambda: now[0], rest_s=10.0)
    writer = AgentWriter(log_, AgentEvents("solo"), lambda: 1.0, client)
    await writer.append(started("j1", "solo", "solo"))
    assert client.fell_back == 1 and client.stored == 0
    async with running(ReportRelay(log_)):
        await writer.append(started("j2", "solo", "solo"))  # (resting: not asked)
        assert client.stored == 0
        now[0] += 11.0
        await writer.append(started("j3", "solo", "solo"))
        assert client.stored == 1, "asked again once the rest is over"
    ids = [r.event.id for r in await stored_after(log_, head, "relay-test:solo:")]
    assert ids == [f"relay-test:solo:j{n}:solo" for n in (1, 2, 3)]


async def test_a_relay_that_never_answers_costs_its_timeout_and_loses_nothing(log_: JetStreamLog) -> None:
    """A relay that took the report and died before answering: the agent appends it itself. Were it
    stored by the relay after all: a task's start in a page is there twice, which no reader's state
    tells from once (``tests/unit/test_report_twice.py``); any other report's second copy the log
    drops by its id."""
    head = await log_.last_seq()
    taken: list[Any] = []

    async def swallow(msg: Any) -> None:
        taken.append(msg)

    silent = await log_.nc.subscribe(f"{REPORT_PREFIX}.*", queue="relay", cb=swallow)
    try:
        client = RelayClient(log_.nc, "mute", timeout_s=0.3)
        writer = AgentWriter(log_, AgentEvents("mute"), lambda: 1.0, client)
        report = started("j1", "mute", "mute")
        await writer.append(report)
        assert taken and client.fell_back == 1
    finally:
        await silent.unsubscribe()
    stored = await log_.append_relayed([report])  # the dead relay's copy, stored late
    assert (await log_.read_all(stored[0], stored[0]))[0].event.id == report.id
    ids = [r.event.id for r in await stored_after(log_, head, "relay-test:mute:")]
    assert ids == [report.id, report.id], "a second copy, after the agent's own"
    alone = ev.NodeDrained(id="relay-test:mute:drain", at=1.0, source="agent.mute", node="mute")
    await writer.append(alone)
    await log_.append_each([alone])
    ids = [r.event.id for r in await stored_after(log_, head, "relay-test:mute:drain")]
    assert ids == [alone.id], "stored once"


async def test_a_report_asked_for_twice_in_one_batch_is_stored_once_and_both_are_answered(log_: JetStreamLog) -> None:
    head = await log_.last_seq()
    async with running(ReportRelay(log_)) as relay:
        reports = [started(f"j{n}", "twice", "twice") for n in range(ATOMIC_FROM)]
        client = RelayClient(log_.nc, "twice")
        answers = await asyncio.gather(*(client.store(r) for r in [*reports, reports[0]]))
        assert all(answers) and counted(relay, "failed") == 0
    ids = [r.event.id for r in await stored_after(log_, head, "relay-test:twice:")]
    assert sorted(ids) == sorted(r.id for r in reports)


async def test_a_batch_holding_a_report_stored_before_stores_every_other_report_once(log_: JetStreamLog) -> None:
    head = await log_.last_seq()
    first = started("j0", "d0", "dup")
    await log_.append([first])  # (its agent appended it itself after a relay's timeout)
    batch = [first] + [started(f"j{n}", f"d{n}", "dup") for n in range(1, ATOMIC_FROM + 4)]
    positions = await log_.append_each(batch)
    assert len(positions) == len(batch)
    ids = [r.event.id for r in await stored_after(log_, head, "relay-test:dup:")]
    assert sorted(ids) == sorted(e.id for e in batch), "the atomic batch was refused whole; each stored alone, once"


async def test_a_stopping_relay_answers_what_it_holds_so_its_agents_append_it(log_: JetStreamLog) -> None:
    relay = ReportRelay(log_)
    reply = log_.nc.new_inbox()
    answers: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_answer(msg: Any) -> None:
        await answers.put(msg.data)

    sub = await log_.nc.subscribe(reply, cb=on_answer)
    stop = asyncio.Event()
    stop.set()  # (stopped before it stores anything it holds)
    msg = nats.aio.msg.Msg(log_.nc, subject=report_subject("s1"), reply=reply, data=b"")
    msg.data = ev.encode(started("j1", "s1", "stopping"))
    await relay._on_report(msg)
    await relay.run(stop)
    answer = await asyncio.wait_for(answers.get(), 5)
    assert b'"ok":false' in answer and b"stopping" in answer
    await sub.unsubscribe()


async def test_reports_too_large_for_one_message_are_stored_as_pages_in_order(log_: JetStreamLog) -> None:
    head = await log_.last_seq()
    tail = "x" * (log_.nc.max_payload // log_.max_batch + 1000)  # (together more than a message holds)
    ends = [
        ev.TaskEnded(
            id=f"relay-test:large:{n}", at=1.0, source=f"agent.l{n}", job=f"j{n}", attempt=0, node=f"l{n}",
            outcome="failed", exit_code=1, output_tail=tail,
        )
        for n in range(log_.max_batch)
    ]  # fmt: skip
    positions = await log_.append_relayed(ends)
    assert positions == sorted(positions) and len(set(positions)) == len(ends)
    records = await stored_after(log_, head, "relay-test:large:")
    assert [r.event for r in records] == ends and [r.seq for r in records] == positions
    messages = sorted({p // PAGE_SLOTS for p in positions})
    assert len(messages) > 1, "more than one page"
    assert {(await log_.js.get_msg("HERD", seq)).subject for seq in messages} == {RELAYED_SUBJECT}
