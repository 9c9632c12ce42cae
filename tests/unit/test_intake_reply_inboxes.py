"""Which waiting plain requests a stored intake message answers (the consumer's matching, without a
server): under a Nats-Msg-Id every request of it still waiting, without one the oldest; an inbox
kept past its patience answers nothing."""

from __future__ import annotations

import collections
import time

import pytest

from gpuherd.log import reply_inboxes
from gpuherd.log.jetstream import REQUEST_PATIENCE_S, _JetStreamConsumer, _request_key
from gpuherd.log.streams import ALSO_REPLY_HEADER, HERD_INTAKE, REPLY_HEADER

SUBJECT, BODY = "herd.intake.team", b'{"name": "x"}'


def consumer_waiting(*requests: tuple[str, str, float]) -> _JetStreamConsumer:
    """A consumer that has seen these (inbox, Nats-Msg-Id, seconds ago) requests of BODY."""
    consumer = _JetStreamConsumer(None, HERD_INTAKE, "scheduler", 10.0)  # type: ignore[arg-type]
    now = time.monotonic()
    for inbox, msg_id, ago in requests:
        key = _request_key(SUBJECT, BODY, msg_id)
        consumer._reply_inboxes.setdefault(key, collections.deque(maxlen=64)).append((inbox, now - ago))
    return consumer


def test_requests_under_one_msg_id_all_hear_the_stored_copy_s_verdict() -> None:
    consumer = consumer_waiting(("_INBOX.a", "m1", 1.0), ("_INBOX.b", "m1", 0.5), ("_INBOX.c", "", 0.2))
    assert consumer._waiting_inboxes(SUBJECT, BODY, "m1") == ["_INBOX.a", "_INBOX.b"]
    assert consumer._waiting_inboxes(SUBJECT, BODY, "m1") == []  # (a redelivery answers no one again)
    assert consumer._waiting_inboxes(SUBJECT, BODY, "") == ["_INBOX.c"]  # another request, its own verdict


def test_without_a_msg_id_each_stored_copy_answers_the_oldest_request() -> None:
    consumer = consumer_waiting(("_INBOX.a", "", 2.0), ("_INBOX.b", "", 1.0))
    assert consumer._waiting_inboxes(SUBJECT, BODY, "") == ["_INBOX.a"]
    assert consumer._waiting_inboxes(SUBJECT, BODY, "") == ["_INBOX.b"]
    assert not consumer._reply_inboxes  # (nothing left behind)


def test_an_inbox_kept_past_its_patience_answers_nothing() -> None:
    consumer = consumer_waiting(("_INBOX.gone", "", REQUEST_PATIENCE_S + 5), ("_INBOX.new", "", 0.1))
    assert consumer._waiting_inboxes(SUBJECT, BODY, "") == ["_INBOX.new"]


@pytest.mark.parametrize(
    ("headers", "inboxes"),
    [
        ({}, []),
        ({REPLY_HEADER: "_INBOX.a"}, ["_INBOX.a"]),
        ({REPLY_HEADER: "_INBOX.a", ALSO_REPLY_HEADER: "_INBOX.b,_INBOX.c"}, ["_INBOX.a", "_INBOX.b", "_INBOX.c"]),
    ],
)
def test_reply_inboxes_reads_both_headers(headers: dict[str, str], inboxes: list[str]) -> None:
    assert reply_inboxes(headers) == inboxes
