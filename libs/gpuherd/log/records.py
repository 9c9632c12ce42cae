"""What the log hands out: stored events, append results, deliveries, dead letters."""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from gpuherd.events import Event


class Record(NamedTuple):
    """One stored event and its stream sequence."""

    seq: int
    event: Event
    trace: str | None = None  # W3C traceparent that travelled with the event
    stored_at: float | None = None  # when the log stored it (Unix seconds), where the log says


class AppendResult(msgspec.Struct, frozen=True):
    seqs: tuple[int, ...]
    duplicate: bool = False  # the log already held these events (same ids): nothing was written


class Delivery(msgspec.Struct, frozen=True):
    """A message from a durable consumer; ``ack`` it once handled, or it comes back."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]
    at: float
    deliveries: int
    token: object = None  # the implementation's handle for ack


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A message a consumer could not handle, kept with the reason instead of being dropped or
    retried forever: an event in HERD that does not decode, or an intake message whose handling
    failed ``deliveries`` times. ``data`` is the message as it was stored."""

    stream: str
    seq: int
    subject: str
    consumer: str  # who gave up on it (a service, ``agent-<node>``)
    reason: str
    deliveries: int = 1
    at: float = 0.0
    data: bytes = b""

    @property
    def id(self) -> str:
        # One letter per stored message, however many consumers find it bad.
        return f"dead:{self.stream}:{self.seq}"
