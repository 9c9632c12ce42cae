"""The EventLog interface, shared by the JetStream and the in-memory implementation.

Four streams (names as in JetStream):
- ``HERD``: state changes, one subject per aggregate (``herd.job.<id>``, ...).
  Appends are idempotent by event id (``Nats-Msg-Id``), may require the
  aggregate to be unchanged since it was read (expected last subject
  sequence), and several events can be appended all-or-nothing.
- ``HERD_INTAKE`` (``herd.intake.<source>``): raw submissions from other systems.
- ``HERD_TELEMETRY`` (``herd.telemetry.>``): heartbeats and samples, limited retention.

- ``HERD_DEAD`` (``herd.dead.<consumer>``): dead letters, messages a consumer
  could not handle, with the reason.

Plus three small key-value uses: decider snapshots, leader leases, and what
each running service says about itself (``gpuherd status``); and
core request-reply on ``herd.ctl.>`` for questions to a live service (an
agent's job logs), which are answers, not history.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import NamedTuple

import msgspec

from gpuherd.events import Event

HERD = "HERD"
HERD_INTAKE = "HERD_INTAKE"
HERD_TELEMETRY = "HERD_TELEMETRY"
HERD_DEAD = "HERD_DEAD"

# Subjects of the HERD stream: one prefix per aggregate kind. The intake and
# telemetry prefixes are separate streams, so HERD cannot simply take herd.>.
HERD_SUBJECTS = (
    "herd.job.>",
    "herd.node.>",
    "herd.vc.>",
    "herd.rejected.>",
    "herd.cluster.>",
    "herd.clock.>",
    "herd.lease.>",
)
INTAKE_PREFIX = "herd.intake"
TELEMETRY_PREFIX = "herd.telemetry"
CONTROL_PREFIX = "herd.ctl"
DEAD_LETTER_PREFIX = "herd.dead"  # HERD_DEAD: messages no consumer could handle, with the reason

SNAPSHOT_BUCKET = "herd_snapshots"
LEASE_BUCKET = "herd_leases"
STATUS_BUCKET = "herd_services"

TRACEPARENT = "traceparent"
REPLY_HEADER = "Gpuherd-Reply-To"


RequestHandler = Callable[[bytes], Awaitable[bytes]]


class Record(NamedTuple):
    """One stored event and its stream sequence."""

    seq: int
    event: Event
    trace: str | None = None  # W3C traceparent that travelled with the event


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


MAX_DELIVERIES = 5  # an intake message whose handling failed this often goes to the dead letters


class DurableConsumer(abc.ABC):
    """At-least-once consumption that resumes after the last acknowledged message."""

    @abc.abstractmethod
    async def fetch(self, max_messages: int = 64, timeout: float = 1.0) -> list[Delivery]: ...

    @abc.abstractmethod
    async def ack(self, delivery: Delivery) -> None: ...

    async def open(self) -> None:  # noqa: B027 - optional: implementations that subscribe lazily override it
        """Subscribe now rather than on the first fetch."""


class Lease(abc.ABC):
    """A leader lease: at most one holder at a time; it expires unless renewed within ``ttl``."""

    name: str
    holder: str
    ttl: float

    @abc.abstractmethod
    async def try_acquire(self) -> bool: ...

    @abc.abstractmethod
    async def renew(self) -> None:
        """Extend the lease. One that expired unclaimed (NATS away for longer than the TTL, a server
        failing over) is taken again: nobody held it meanwhile, so nobody acted on it. Raises
        LeaseLost if another holder has it now, or it was never acquired or was released."""

    @abc.abstractmethod
    async def release(self) -> None: ...


class EventLog(abc.ABC):
    """One interface for the JetStream log and the in-memory log."""

    lease_ttl: float = 6.0
    max_batch: int = 1000  # events one atomic append may hold (JetStream's limit for atomic batches)

    # -- HERD ---------------------------------------------------------------------

    @abc.abstractmethod
    async def append(
        self,
        events: Sequence[Event],
        *,
        expect: Mapping[str, int] | None = None,
        trace: str | None = None,
    ) -> AppendResult:
        """Append events all-or-nothing, in order.

        ``expect`` maps a subject to the last sequence it must still have (0: no
        event yet) or ConcurrencyError is raised and nothing is written. Events
        whose ids the log already holds make the call a no-op (``duplicate``).
        """

    @abc.abstractmethod
    async def append_pipelined(self, events: Sequence[Event], window: int = 256) -> list[int]:
        """Append events one by one with up to ``window`` in flight (not atomic as a whole)."""

    @abc.abstractmethod
    def read(self, start: int = 1, *, stop: int | None = None, follow: bool = False) -> AsyncIterator[Record]:
        """Events in sequence order from ``start``; up to ``stop`` (default: the end
        when called), or forever with ``follow``."""

    @abc.abstractmethod
    async def last_seq(self) -> int: ...

    @abc.abstractmethod
    async def subject_last_seq(self, subject: str) -> int:
        """The sequence of the newest event on ``subject`` (0 when there is none)."""

    # -- HERD_INTAKE ----------------------------------------------------------------

    @abc.abstractmethod
    async def publish_intake(self, source: str, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Store a raw submission (what an outside system publishes to herd.intake.<source>)."""

    @abc.abstractmethod
    def intake_consumer(self, name: str, ack_wait: float = 10.0) -> DurableConsumer: ...

    # -- HERD_TELEMETRY ------------------------------------------------------------

    @abc.abstractmethod
    async def publish_telemetry(self, subject: str, data: bytes) -> None:
        """``subject`` is relative to herd.telemetry (e.g. ``node-1.heartbeat``)."""

    @abc.abstractmethod
    def telemetry(self, subject: str = ">", *, since_s: float | None = None) -> AsyncIterator[Delivery]:
        """Follow telemetry, from ``since_s`` seconds ago (default: new samples only)."""

    # -- replies to submitters (core messaging, not stored) -------------------------

    @abc.abstractmethod
    async def reply(self, inbox: str, data: bytes) -> None: ...

    # -- dead letters (HERD_DEAD) --------------------------------------------------------

    @abc.abstractmethod
    async def dead_letter(self, letter: DeadLetter) -> None:
        """Keep ``letter`` (idempotent per stored message)."""

    @abc.abstractmethod
    async def dead_letters(self) -> list[DeadLetter]: ...

    # -- requests to a service (core request-reply on herd.ctl.>, not stored) ----------

    @abc.abstractmethod
    async def request(self, subject: str, data: bytes, *, timeout: float = 5.0) -> bytes:
        """Ask whoever serves ``herd.ctl.<subject>``; raises LogUnavailable when no one answers."""

    @abc.abstractmethod
    async def serve_requests(self, subject: str, handler: RequestHandler) -> Callable[[], Awaitable[None]]:
        """Answer requests on ``herd.ctl.<subject>`` with ``handler`` until the returned function is awaited."""

    # -- key-value: snapshots and leases -----------------------------------------------

    @abc.abstractmethod
    async def kv_get(self, bucket: str, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def kv_put(self, bucket: str, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    async def kv_entries(self, bucket: str) -> dict[str, bytes]:
        """Every live key of ``bucket`` and its value."""

    @abc.abstractmethod
    def lease(self, name: str, holder: str) -> Lease:
        """The leader lease ``name`` as seen by ``holder``; it lasts ``lease_ttl`` seconds unless renewed."""

    def is_connected(self) -> bool:
        return True

    def connected_since(self) -> float:
        """When this process last (re)connected to the log; silence before it says nothing about others."""
        return 0.0

    async def close(self) -> None:
        return None

    async def read_all(self, start: int = 1, stop: int | None = None) -> list[Record]:
        return [r async for r in self.read(start, stop=stop)]
