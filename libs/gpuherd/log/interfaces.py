"""The log's narrow interfaces: each part of gpuherd depends on the few it uses.

Like the ``eventsourcing`` library's recorders, each interface is one small capability that the
JetStream log and the in-memory log both provide (``EventLog`` is all of them at once):

| interface        | what                                                          | used by                          |
|------------------|---------------------------------------------------------------|----------------------------------|
| ``EventStore``   | HERD: append (idempotent, all-or-nothing), read in order      | every decider, agent, reader     |
| ``IntakeQueue``  | HERD_INTAKE: raw submissions, a durable consumer, replies      | the scheduler, submitters        |
| ``TelemetryBus`` | HERD_TELEMETRY: heartbeats and samples                        | agents, the scheduler's liveness |
| ``DeadLetters``  | HERD_DEAD: what no consumer could handle, and why             | every consumer, ``gpuherd``      |
| ``Requests``     | core request-reply on ``herd.ctl.>`` (answers, not history)   | agents (job logs), the CLI       |
| ``KeyValue``     | snapshots and service status                                  | deciders, agents, ``status``     |
| ``Leaderships``  | one leader per decider, one agent per node (KV, expiring)     | deciders, agents                 |

Words: a *leadership* is the right to act for a decider or a node (one holder, expiring unless
renewed); a *lease* is always a memory lease (``MemoryLease*`` events: neighbor-GPU memory lent to
a job), never this.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from gpuherd.events import Event
from gpuherd.log.records import AppendResult, DeadLetter, Delivery, Record
from gpuherd.obs import get_logger

log = get_logger("gpuherd.log")

RequestHandler = Callable[[bytes], Awaitable[bytes]]
# The W3C traceparent that travels with appended events: one for all, or one per event (None: none).
Traces = str | Sequence[str | None] | None


def trace_of(traces: Traces, n: int) -> str | None:
    """The traceparent of the ``n``-th event of an append."""
    if traces is None or isinstance(traces, str):
        return traces
    return traces[n]


class EventStore(abc.ABC):
    """HERD: the append-only log of state changes."""

    max_batch: int = 1000  # events one atomic append may hold (JetStream's limit for atomic batches)

    @abc.abstractmethod
    async def append(
        self,
        events: Sequence[Event],
        *,
        expect: Mapping[str, int] | None = None,
        trace: Traces = None,
    ) -> AppendResult:
        """Append events all-or-nothing, in order; ``trace``: the traceparent of all, or of each.

        ``expect`` maps a subject to the last sequence it must still have (0: no
        event yet) or ConcurrencyError is raised and nothing is written. Appending
        again what an earlier call appended (the same events, by id) is a no-op
        (``duplicate``). Positions (``AppendResult.seqs``, ``Record.seq``) increase
        and are unique but need not be contiguous (JetStream's pages).

        An append that shares only some of its ids with stored events is refused
        as a duplicate by the in-memory log but may be stored by JetStream, which
        deduplicates a page of events whole: no writer forms such appends (a
        decider's ids encode their cause, and a cause decided once is not decided
        again; agents append one event at a time).
        """

    @abc.abstractmethod
    async def append_pipelined(self, events: Sequence[Event], window: int = 256, *, trace: Traces = None) -> list[int]:
        """Append events one by one with up to ``window`` in flight (not atomic as a whole); each
        is idempotent by its id, so a batch refused for one duplicate can be appended this way;
        ``trace``: the traceparent of all, or of each."""

    @abc.abstractmethod
    def read(
        self, start: int = 1, *, stop: int | None = None, follow: bool = False, linger_s: float = 0.0
    ) -> AsyncIterator[Record]:
        """Events in sequence order from ``start``; up to ``stop`` (default: the end
        when called), or forever with ``follow``. A follower no decision waits on may ``linger``:
        take what is stored in batches up to ``linger_s`` apart while events flow, not each as it
        is stored (a log whose reads cost nothing per wake-up ignores it)."""

    @abc.abstractmethod
    async def last_seq(self) -> int: ...

    @abc.abstractmethod
    async def subject_last_seq(self, subject: str) -> int:
        """The sequence of the newest event on ``subject`` (0 when there is none)."""

    async def subject_seen(self, subject: str) -> bool:
        """Whether any event on ``subject`` is in the log (where the server cannot tell, as for an
        event stored in a page on another subject, by reading the log)."""
        return await self.subject_last_seq(subject) > 0

    async def tail_start(self, events: int) -> int:
        """A position from which reading yields at least the last ``events`` events (more where
        positions are not contiguous: JetStream's pages)."""
        return max(1, await self.last_seq() - events + 1)

    def behind(self, folded: int, head: int) -> int:
        """How far a reader that folded up to position ``folded`` is behind position ``head``: in
        events here, in stored messages where positions are not contiguous (JetStream's pages)."""
        return max(0, head - folded)

    async def read_all(self, start: int = 1, stop: int | None = None) -> list[Record]:
        return [r async for r in self.read(start, stop=stop)]


class DurableConsumer(abc.ABC):
    """At-least-once consumption that resumes after the last acknowledged message."""

    @abc.abstractmethod
    async def fetch(self, max_messages: int = 64, timeout: float = 1.0) -> list[Delivery]: ...

    @abc.abstractmethod
    async def ack(self, delivery: Delivery) -> None: ...

    @abc.abstractmethod
    async def in_progress(self, delivery: Delivery) -> None:
        """The message is still being handled: restart its ``ack_wait``, so it is not delivered
        again meanwhile (a delivery counts towards the message's ``deliveries`` when it is sent)."""

    async def open(self) -> None:  # noqa: B027 - optional: implementations that subscribe lazily override it
        """Subscribe now rather than on the first fetch."""

    async def close(self) -> None:  # noqa: B027 - optional: implementations that subscribe override it
        """Stop consuming (what was fetched and not acknowledged comes back to the next consumer)."""


class IntakeQueue(abc.ABC):
    """HERD_INTAKE: submissions from other systems, and the verdicts sent back to their inboxes."""

    @abc.abstractmethod
    async def publish_intake(self, source: str, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        """Store a raw submission (what an outside system publishes to herd.intake.<source>)."""

    @abc.abstractmethod
    def intake_consumer(self, name: str, ack_wait: float = 10.0) -> DurableConsumer: ...

    @abc.abstractmethod
    async def reply(self, inbox: str, data: bytes) -> None:
        """Answer a submitter (core messaging, not stored)."""


class TelemetryBus(abc.ABC):
    """HERD_TELEMETRY: observations (heartbeats, GPU samples, job progress), limited retention."""

    @abc.abstractmethod
    async def publish_telemetry(self, subject: str, data: bytes) -> None:
        """``subject`` is relative to herd.telemetry (e.g. ``node-1.heartbeat``)."""

    @abc.abstractmethod
    def telemetry(self, subject: str = ">", *, since_s: float | None = None) -> AsyncIterator[Delivery]:
        """Follow telemetry, from ``since_s`` seconds ago (default: new samples only)."""


class DeadLetters(abc.ABC):
    """HERD_DEAD: messages no consumer could handle, kept with the reason."""

    @abc.abstractmethod
    async def dead_letter(self, letter: DeadLetter) -> None:
        """Keep ``letter`` (idempotent per stored message)."""

    @abc.abstractmethod
    async def dead_letters(self) -> list[DeadLetter]: ...


class Requests(abc.ABC):
    """Questions to a live service (core request-reply on ``herd.ctl.>``): answers, not history."""

    @abc.abstractmethod
    async def request(self, subject: str, data: bytes, *, timeout: float = 5.0) -> bytes:
        """Ask whoever serves ``herd.ctl.<subject>``; raises LogUnavailable when no one answers."""

    @abc.abstractmethod
    async def serve_requests(self, subject: str, handler: RequestHandler) -> Callable[[], Awaitable[None]]:
        """Answer requests on ``herd.ctl.<subject>`` with ``handler`` until the returned function is awaited."""


class KeyValue(abc.ABC):
    """Small values by key: decider snapshots (a cache of the log) and service status."""

    @abc.abstractmethod
    async def kv_get(self, bucket: str, key: str) -> bytes | None: ...

    @abc.abstractmethod
    async def kv_put(self, bucket: str, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    async def kv_entries(self, bucket: str) -> dict[str, bytes]:
        """Every live key of ``bucket`` and its value."""

    @abc.abstractmethod
    async def kv_purge(self, bucket: str, key: str) -> None:
        """Remove ``key`` and its history (none there: nothing happens)."""


class Leadership(abc.ABC):
    """The right to act as ``name`` (a decider, a node's agent): at most one holder at a time; it
    expires unless renewed within ``ttl``."""

    name: str
    holder: str
    ttl: float

    @abc.abstractmethod
    async def try_acquire(self) -> bool: ...

    @abc.abstractmethod
    async def renew(self) -> None:
        """Extend the term. One that expired unclaimed (NATS away for longer than the TTL, a server
        failing over) is taken again: nobody held it meanwhile, so nobody acted on it. Raises
        LeadershipLost if another holder has it now, or it was never acquired or was released."""

    @abc.abstractmethod
    async def release(self) -> None: ...

    async def acquire(self, stop: asyncio.Event, what: str) -> bool:
        """Wait as a standby until this leadership is ours (True) or ``stop`` is set (False)."""
        announced = False
        while not stop.is_set():
            try:
                acquired = await self.try_acquire()
            except Exception as exc:  # NATS away or a stream electing its leader: try again, as a standby would
                log.warning("leadership not acquirable yet; retrying", leadership=self.name, error=repr(exc))
                acquired = False
            if acquired:
                log.info("leadership acquired", leadership=self.name, holder=self.holder)
                return True
            if not announced:
                log.info(f"standby: another instance leads {what}", leadership=self.name)
                announced = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.ttl / 3)
        return False


class Leaderships(abc.ABC):
    """One active instance per decider, one agent per node."""

    leadership_ttl: float = 6.0

    @abc.abstractmethod
    def leadership(self, name: str, holder: str) -> Leadership:
        """The leadership ``name`` as seen by ``holder``; it lasts ``leadership_ttl`` seconds unless renewed."""


class Connection:
    """The link to the log's server (always up for the in-memory log)."""

    def is_connected(self) -> bool:
        return True

    def connected_since(self) -> float:
        """When this process last (re)connected to the log; silence before it says nothing about others."""
        return 0.0

    async def close(self) -> None:
        return None


class EventLog(EventStore, IntakeQueue, TelemetryBus, DeadLetters, Requests, KeyValue, Leaderships, Connection):
    """Every interface at once: what the JetStream and in-memory implementations provide."""
