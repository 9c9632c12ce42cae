"""Pages: the events of one append stored as one JetStream message, and the positions they get.

With the log's fsync on every acknowledged write, each stored message costs a disk sync; an atomic
batch of N messages costs N of them, plus the server's staging of the batch (5-9 ms on one server,
however small the batch). So an append of several events is stored as one message, a *page*: the
events in order, each with its trace context. The page is the unit of all-or-nothing, of dedupe
(its id names its first and last event and their number) and of the fence check.

Readers unpack pages, and every event keeps a position of its own:

    position = message sequence x PAGE_SLOTS + index in the message

``PAGE_SLOTS`` (1000) is the most events one append holds. Positions keep the log's order, are
unique, and name their message (``position // PAGE_SLOTS``); they are not contiguous, so no reader
may take position p + 1 to exist. A log created before pages (its HERD stream lacks the
``gpuherd.positions`` metadata but holds messages) keeps positions = message sequences and stores
every append as before: a running deployment's snapshots, fences and decision ids stay valid.

A page is published on the subject of its first event, so NATS permissions check that subject.
What else a page may hold keeps those permissions whole (``pageable``): events whose subjects
differ from the page's only in the aggregate's id, for the aggregates whose id no permission fixes
(jobs, leases, VCs, rejected submissions: every writer of those may write them for any id). An
agent may append only to its own node's subjects, so ``herd.node.<id>`` pages hold one node's
events; the node's token of an agent's report (``herd.job.<job>.by.<node>``) must match too. A
report relay's page (on ``RELAYED_SUBJECT``, which only relays may write) holds reports of any node
(``gpuherd.log.relay``): what a relay may append one by one. Writers page only such appends (others
go as an atomic batch); readers turn anything else found in a page into ``Unreadable`` (a dead
letter), so a page cannot carry what its writer may not append.

JetStream's per-subject lookups (the last message on a subject, expected-last-subject-sequence)
see only a page's own subject: a subject that must be found or checked by the server has its
events appended alone (a leader's fence is), or is found by reading (``subject_seen``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import msgspec

from gpuherd.errors import UNDECODABLE
from gpuherd.events import Event, any_event
from gpuherd.events.codec import as_decoded
from gpuherd.log.relay import RELAYED_SUBJECT, relayed

PAGE_SLOTS = 1000
PAGE_HEADER = "Gpuherd-Page"  # the number of events in a page; absent: the message is one event
POSITIONS_METADATA = "gpuherd.positions"  # HERD stream metadata: positions per message (1 or PAGE_SLOTS)
# Aggregate kinds (the subject's second token) whose id (the third) no writer's permission fixes.
FREE_IDS = frozenset({"job", "lease", "vc", "rejected"})


def pageable(page_subject: str, subject: str) -> bool:
    """Whether an event on ``subject`` may travel in a page stored on ``page_subject``: the same
    subject, or one that differs only in the id of an aggregate whose id is free (``FREE_IDS``)."""
    return page_admits(page_subject)(subject)


def page_admits(page_subject: str) -> Callable[[str], bool]:
    """``pageable`` for one page's subject, asked of each of its events: the page's subject is split
    once per page, not once per event."""
    if page_subject == RELAYED_SUBJECT:
        return relayed
    page_tokens = page_subject.split(".")
    if len(page_tokens) < 3 or page_tokens[1] not in FREE_IDS:
        return page_subject.__eq__
    kind = f"{page_tokens[0]}.{page_tokens[1]}."  # (no token holds a dot: a prefix match is a match of both)
    rest = page_tokens[3:]

    def admits(subject: str) -> bool:
        if subject == page_subject:
            return True
        # The same kind, any id, then the same tokens (and as many) as the page's subject.
        return subject.startswith(kind) and subject[len(kind) :].split(".")[1:] == rest

    return admits


class _Page(msgspec.Struct):
    events: list[msgspec.Raw]
    traces: list[str | None] | None = None


_page_decoder = msgspec.json.Decoder(_Page)
_encoder = msgspec.json.Encoder()


def encode_page(encoded: Sequence[bytes], traces: Sequence[str | None]) -> bytes:
    """One message holding already encoded events (JSON) and their traceparents."""
    body = b'{"events":[' + b",".join(encoded) + b"]"
    if any(traces):
        body += b',"traces":' + _encoder.encode(list(traces))
    return body + b"}"


def decode_page(data: bytes) -> list[tuple[bytes, str | None]]:
    """The encoded events of a page and their traceparents; raises msgspec.DecodeError (or
    ValidationError) for a message that is no page."""
    page = _page_decoder.decode(data)
    traces = page.traces if page.traces is not None else [None] * len(page.events)
    if len(traces) != len(page.events):
        raise msgspec.ValidationError(f"a page of {len(page.events)} events carries {len(traces)} traces")
    return [(bytes(raw), trace) for raw, trace in zip(page.events, traces, strict=True)]


E = TypeVar("E")


class _EventPage(msgspec.Struct, Generic[E]):
    events: list[E]
    traces: list[str | None] | None = None


class _TypedPageDecoder:
    """A decoder of a whole page into events, made again when the catalogue's union changed (a plugin
    service's events, imported later)."""

    def __init__(self) -> None:
        self.union: Any = None
        self.decoder: msgspec.json.Decoder[Any] | None = None

    def current(self) -> msgspec.json.Decoder[Any]:
        union = any_event()
        if self.decoder is None or union is not self.union:
            self.decoder = msgspec.json.Decoder(_EventPage[union])  # type: ignore[valid-type]
            self.union = union
        return self.decoder


_typed_pages = _TypedPageDecoder()


def decode_page_events(data: bytes) -> list[tuple[Event, str | None]] | None:
    """The events of a page and their traceparents, decoded in one pass: what decoding each of
    ``decode_page``'s events with ``gpuherd.events.decode`` gives, where that is the same. None where
    it may not be (an event of an older version to upcast, one that does not decode, a page that is
    no page): the caller then takes the event-by-event path, which says what is wrong where."""
    try:
        page = _typed_pages.current().decode(data)
    except UNDECODABLE:  # (a ValidationError is a DecodeError)
        return None
    events: list[Event] = page.events
    if not all(map(as_decoded, events)):
        return None
    if page.traces is None:
        return [(event, None) for event in events]
    if len(page.traces) != len(events):
        return None
    return list(zip(events, page.traces, strict=True))


def page_id(event_ids: Sequence[str]) -> str:
    """The dedupe id of a page: the same events appended again are the same page."""
    return f"{event_ids[0]}..{event_ids[-1]}#{len(event_ids)}"
