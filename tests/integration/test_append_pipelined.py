"""``append_pipelined`` on a real nats-server: each event its own message, acknowledged on one
subscription of the log; positions in order, a repeat is deduplicated to the first's, refusals raise."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest

from gpuherd import events as ev
from gpuherd.log import open_log
from gpuherd.log.jetstream import _PublishAcks


def cancel() -> ev.JobCancelRequested:
    return ev.JobCancelRequested(id=uuid.uuid4().hex, at=1.0, source="test", job=uuid.uuid4().hex[:10], reason="")


async def test_pipelined_events_are_stored_in_order_once(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="pipelined")
    try:
        start = await log_.last_seq() + 1
        events = [cancel() for _ in range(700)]
        seqs = await log_.append_pipelined(events, window=64)  # more events than the window holds
        assert seqs == sorted(seqs) and len(set(seqs)) == len(events)
        assert [r.event for r in await log_.read_all(start)] == events
        assert await log_.append_pipelined(events[:10]) == seqs[:10]  # already stored: the same positions
        assert len(await log_.read_all(start)) == len(events)
        assert await log_.append_pipelined([]) == []
    finally:
        await log_.close()


async def test_pipelined_appends_at_once_share_one_subscription(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="pipelined-together")
    try:
        batches = [[cancel() for _ in range(50)] for _ in range(4)]
        results = await asyncio.gather(*(log_.append_pipelined(batch, window=8) for batch in batches))
        assert all(len(set(seqs)) == 50 for seqs in results)
        assert len({seq for seqs in results for seq in seqs}) == 200
        assert len(log_.nc._subs) == len({id(sub) for sub in log_.nc._subs.values()})
        assert sum(sub.subject.startswith(log_._acks._prefix) for sub in log_.nc._subs.values()) == 1
    finally:
        await log_.close()


async def test_an_acknowledgement_answers_as_jetstreams_publish_does() -> None:
    acks = _PublishAcks(SimpleNamespace(new_inbox=lambda: "_INBOX.t", subscribe=_subscribe))  # type: ignore[arg-type]
    answers = {
        "stored": msgspec.json.encode({"stream": "HERD", "seq": 7}),
        "refused": msgspec.json.encode({"error": {"code": 400, "err_code": 10071, "description": "wrong last"}}),
        "garbled": b"not json",
    }
    futures = {}
    for name, data in answers.items():
        reply, futures[name] = await acks.expect()
        await acks._answer(SimpleNamespace(subject=reply, data=data, headers=None))  # type: ignore[arg-type]
    reply, futures["no stream"] = await acks.expect()
    await acks._answer(SimpleNamespace(subject=reply, data=b"", headers={"Status": "503"}))  # type: ignore[arg-type]
    assert futures["stored"].result() == 7
    with pytest.raises(nats.js.errors.BadRequestError):
        futures["refused"].result()
    with pytest.raises(msgspec.DecodeError):
        futures["garbled"].result()
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        futures["no stream"].result()
    acks.forget(list(futures.values()))
    assert not acks._waiting


async def _subscribe(subject: str, cb: object) -> object:
    return SimpleNamespace(subject=subject)


async def test_an_append_nobody_acknowledges_times_out_as_jetstreams_publish_did(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's own TimeoutError, as ``js.publish`` raised: a caller catching ``nats.errors.Error``
    (or the built-in TimeoutError) still catches it; and nothing is left waiting."""
    log_ = await open_log(nats_url, name="pipelined-unanswered", request_timeout_s=0.3)
    try:

        async def lost(*args: object, **kwargs: object) -> None:  # (a publish whose acknowledgement never comes)
            return None

        monkeypatch.setattr(log_.nc, "publish", lost)
        for window in (1, 8):  # (waiting for room in the window; waiting for the last acknowledgements)
            with pytest.raises(nats.errors.TimeoutError):
                await log_.append_pipelined([cancel() for _ in range(3)], window=window)
            assert not log_._acks._waiting
    finally:
        await log_.close()


async def test_closing_a_log_on_a_shared_connection_ends_its_acknowledgement_subscription(nats_url: str) -> None:
    """A log made on a connection it does not own (a client's) leaves that connection as it found it."""
    from gpuherd.log.jetstream import JetStreamLog

    nc = await nats.connect(nats_url)
    try:
        log_ = JetStreamLog(nc)
        await log_.ensure_streams()
        before = len(nc._subs)  # (nats-py's own reply subscription for requests is the connection's)
        assert len(await log_.append_pipelined([cancel() for _ in range(3)])) == 3
        assert len(nc._subs) == before + 1
        await log_.close()
        assert len(nc._subs) == before and not nc.is_closed
    finally:
        await nc.close()
