"""Pages: several events of one append in one stored message (``gpuherd.log.pages``)."""

from __future__ import annotations

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.log.pages import PAGE_SLOTS, decode_page, decode_page_events, encode_page, page_id, pageable
from gpuherd.log.relay import RELAYED_SUBJECT


def cancel(job: str, n: int = 0) -> ev.JobCancelRequested:
    return ev.JobCancelRequested(id=f"c{n}", at=1.0, source="test", job=job)


def test_a_page_gives_back_its_events_and_their_traces_in_order() -> None:
    events = [cancel(f"j{n}", n) for n in range(5)]
    traces = [None, "00-aa-bb-01", None, None, "00-cc-dd-01"]
    page = decode_page(encode_page([ev.encode(e) for e in events], traces))
    assert [ev.decode(data) for data, _ in page] == events
    assert [trace for _, trace in page] == traces


def test_a_page_without_traces_carries_none() -> None:
    data = encode_page([ev.encode(cancel("j"))], [None])
    assert b"traces" not in data
    assert decode_page(data) == [(ev.encode(cancel("j")), None)]


@pytest.mark.parametrize(
    "data",
    [b"not json", b'{"events": 3}', b'{"events": [{"type": "X"}], "traces": [null, null]}', b"[]"],
)
def test_what_is_no_page_is_refused(data: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_page(data)


def test_a_page_decoded_at_once_gives_what_decoding_each_event_gives() -> None:
    events = [cancel(f"j{n}", n) for n in range(3)]
    for traces in ([None, "00-aa-bb-01", None], [None, None, None]):
        data = encode_page([ev.encode(e) for e in events], traces)
        expected = [(ev.decode(raw), trace) for raw, trace in decode_page(data)]
        assert decode_page_events(data) == expected


@pytest.mark.parametrize(
    "event",
    [
        b'{"type":"JobCancelRequested","id":"c","at":1.0,"source":"t","v":1,"job":"j"}',  # v1: upcast
        b'{"type":"JobCancelRequested","id":"c","at":1.0,"source":"t","v":2,"unchecked":true,"job":"j"}',  # forged
        b'{"type":"NoSuchEvent","id":"c"}',
    ],
)
def test_a_page_that_needs_more_than_the_union_is_left_to_the_event_by_event_path(event: bytes) -> None:
    """An older version to upcast, a later command claiming the v1 exemption, an unknown type: the
    one-pass decoder gives up (None), and the reader decodes each event (upcasting, refusing)."""
    assert decode_page_events(encode_page([ev.encode(cancel("a")), event], [None, None])) is None


@pytest.mark.parametrize(
    "data",
    [b"not json", b'{"events": 3}', b'{"events": [], "traces": [null]}', b"[]"],
)
def test_what_is_no_page_is_left_to_the_event_by_event_path(data: bytes) -> None:
    assert decode_page_events(data) is None


def test_a_page_id_names_its_events() -> None:
    assert page_id(["a", "b", "c"]) == page_id(["a", "b", "c"])
    assert page_id(["a", "b", "c"]) != page_id(["a", "c"])
    assert page_id(["a", "c"]) != page_id(["a", "b", "c"])


def test_pages_hold_as_many_events_as_an_append() -> None:
    from gpuherd.log.interfaces import EventStore

    assert EventStore.max_batch <= PAGE_SLOTS


@pytest.mark.parametrize(
    ("page_subject", "subject", "ok"),
    [
        ("herd.job.a", "herd.job.a", True),
        ("herd.job.a", "herd.job.b", True),  # the scheduler places many jobs in one page
        ("herd.lease.l1", "herd.lease.l2", True),
        ("herd.vc.x", "herd.vc.y", True),
        ("herd.rejected.s1", "herd.rejected.s2", True),
        ("herd.job.a.by.n1", "herd.job.b.by.n1", True),  # one agent's reports on several jobs
        ("herd.job.a.by.n1", "herd.job.b.by.n2", False),  # another node's report
        ("herd.job.a", "herd.job.b.by.n1", False),  # an agent's report in the scheduler's page
        ("herd.node.n1", "herd.node.n1", True),
        ("herd.node.n1", "herd.node.n2", False),  # an agent writes for its own node only
        ("herd.job.a", "herd.node.n1", False),
        ("herd.cluster.leader.scheduler", "herd.cluster.leader.memory", False),
        ("herd.clock.scheduler", "herd.clock.elastic", False),
        # A relay's page: the reports of every node, and nothing else
        (RELAYED_SUBJECT, "herd.job.a.by.n1", True),
        (RELAYED_SUBJECT, "herd.job.b.by.n2", True),
        (RELAYED_SUBJECT, "herd.lease.l1.by.n2", True),
        (RELAYED_SUBJECT, "herd.node.n3", True),
        (RELAYED_SUBJECT, "herd.job.a", False),  # a scheduler's decision
        (RELAYED_SUBJECT, "herd.lease.l1", False),  # a broker's
        (RELAYED_SUBJECT, "herd.job.relayed.reports", False),
        ("herd.job.a.by.n1", RELAYED_SUBJECT, False),
        ("herd.job.relayed", "herd.job.a.by.n1", False),  # (the decisions about a job named "relayed")
    ],
)
def test_a_page_holds_only_what_its_subject_permits(page_subject: str, subject: str, ok: bool) -> None:
    assert pageable(page_subject, subject) is ok


def test_no_permission_fixes_the_id_of_an_aggregate_whose_pages_mix_ids() -> None:
    """``pageable`` lets a page on ``herd.job.a`` hold ``herd.job.b``: sound only while every writer
    allowed one id of such an aggregate is allowed all (a ``*`` there), so a page can carry nothing
    its writer could not append one by one. A new permission that fixes such an id fails here."""
    from apps import registry
    from gpuherd.log.pages import FREE_IDS
    from gpuherd.security import users

    for user in users(registry.specs(), nodes=["n1", "n2"], sources=["ci"]):
        if user.permissions is None:
            continue
        for subject in user.permissions.publish:
            tokens = subject.split(".")
            if subject == RELAYED_SUBJECT:
                continue  # (a relay's pages: only reports, of any node; see the cases above)
            if tokens[0] == "herd" and len(tokens) >= 3 and tokens[1] in FREE_IDS:
                assert tokens[2] in ("*", ">"), f"{user.name} may publish {subject}: an id fixed under {tokens[1]}"
