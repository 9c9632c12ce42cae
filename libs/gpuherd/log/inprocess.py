"""In-memory EventLog with the JetStream log's semantics, for unit tests and simulation.

It keeps every behaviour a caller can observe: sequences start at 1 and have
no gaps, appends are all-or-nothing and idempotent by event id within the
duplicate window, expected subject sequences are checked, durable consumers
redeliver what was not acknowledged within ``ack_wait``, leaderships expire. Time
comes from an injectable clock so a simulation can run on a virtual one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from gpuherd.errors import ConcurrencyError, LeadershipLost, LogError, LogUnavailable
from gpuherd.events import Event
from gpuherd.log.interfaces import DurableConsumer, EventLog, Leadership, RequestHandler, Traces, trace_of
from gpuherd.log.records import AppendResult, DeadLetter, Delivery, Record

Clock = Callable[[], float]


class InProcessLog(EventLog):
    def __init__(self, *, clock: Clock = time.time, duplicate_window: float = 7200.0, leadership_ttl: float = 6.0):
        self.clock = clock
        self.duplicate_window = duplicate_window
        self.leadership_ttl = leadership_ttl
        self._records: list[Record] = []
        self._subject_last: dict[str, int] = {}
        self._ids: dict[str, tuple[int, float]] = {}  # event id -> (seq, stored at)
        self._changed = asyncio.Condition()
        self._intake: list[Delivery] = []
        self._handlers: dict[str, RequestHandler] = {}
        self._intake_changed = asyncio.Condition()
        self._consumers: dict[str, _ConsumerState] = {}
        self._telemetry: deque[Delivery] = deque(maxlen=100_000)
        self._telemetry_changed = asyncio.Condition()
        self._kv: dict[tuple[str, str], bytes] = {}
        self._leaderships: dict[str, tuple[str, float]] = {}  # name -> (holder, expires at)
        self.replies: list[tuple[str, bytes]] = []  # what reply() sent, for tests
        self._dead: dict[str, DeadLetter] = {}

    # -- HERD ---------------------------------------------------------------------

    def _is_duplicate(self, event_id: str) -> bool:
        seen = self._ids.get(event_id)
        return seen is not None and self.clock() - seen[1] <= self.duplicate_window

    async def append(
        self,
        events: Sequence[Event],
        *,
        expect: Mapping[str, int] | None = None,
        trace: Traces = None,
    ) -> AppendResult:
        if len(events) > self.max_batch:
            raise LogError(f"an atomic append holds at most {self.max_batch} events, got {len(events)}")
        result = self.append_now(events, expect=expect, trace=trace)
        if result.seqs and not result.duplicate:
            async with self._changed:
                self._changed.notify_all()
        return result

    def append_now(
        self,
        events: Sequence[Event],
        *,
        expect: Mapping[str, int] | None = None,
        trace: Traces = None,
    ) -> AppendResult:
        """``append`` without waking readers: for a single-threaded caller (the simulation) that
        reads ``records`` itself."""
        if not events:
            return AppendResult(seqs=())
        dup = [e.id for e in events if e.id and self._is_duplicate(e.id)]
        if dup:
            if len(events) == 1:
                return AppendResult(seqs=(self._ids[dup[0]][0],), duplicate=True)
            return AppendResult(seqs=(), duplicate=True)  # as JetStream: a batch with a seen id is refused whole
        for subject, expected in (expect or {}).items():
            actual = self._subject_last.get(subject, 0)
            if actual != expected:
                raise ConcurrencyError(subject, expected, actual)
        now = self.clock()
        seqs = []
        single = trace is None or isinstance(trace, str)
        for n, event in enumerate(events):
            seq = len(self._records) + 1
            self._records.append(Record(seq, event, trace if single else trace_of(trace, n), now))
            self._subject_last[event.subject()] = seq
            if event.id:
                self._ids[event.id] = (seq, now)
            seqs.append(seq)
        return AppendResult(seqs=tuple(seqs))

    @property
    def records(self) -> Sequence[Record]:
        """Every record so far, in sequence order (index = seq - 1)."""
        return self._records

    async def append_pipelined(self, events: Sequence[Event], window: int = 256, *, trace: Traces = None) -> list[int]:
        seqs = []
        for n, event in enumerate(events):
            result = await self.append([event], trace=trace_of(trace, n))
            seqs.extend(result.seqs)
        return seqs

    async def read(
        self, start: int = 1, *, stop: int | None = None, follow: bool = False, linger_s: float = 0.0
    ) -> AsyncIterator[Record]:
        end = None if follow else (stop if stop is not None else len(self._records))
        seq = max(start, 1)
        while end is None or seq <= end:
            if seq <= len(self._records):
                yield self._records[seq - 1]
                seq += 1
                continue
            if not follow:
                return
            async with self._changed:
                await self._changed.wait_for(lambda s=seq: len(self._records) >= s)

    async def last_seq(self) -> int:
        return len(self._records)

    async def subject_last_seq(self, subject: str) -> int:
        return self._subject_last.get(subject, 0)

    # -- HERD_INTAKE ----------------------------------------------------------------

    async def publish_intake(self, source: str, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        seq = len(self._intake) + 1
        self._intake.append(
            Delivery(
                seq=seq,
                subject=f"herd.intake.{source}",
                data=data,
                headers=dict(headers or {}),
                at=self.clock(),
                deliveries=0,
            )
        )
        async with self._intake_changed:
            self._intake_changed.notify_all()

    def intake_consumer(self, name: str, ack_wait: float = 10.0) -> DurableConsumer:
        state = self._consumers.setdefault(name, _ConsumerState())
        return _MemoryConsumer(self, state, ack_wait)

    # -- HERD_TELEMETRY -------------------------------------------------------------

    async def publish_telemetry(self, subject: str, data: bytes) -> None:
        self._telemetry.append(
            Delivery(
                seq=len(self._telemetry) + 1,
                subject=f"herd.telemetry.{subject}",
                data=data,
                headers={},
                at=self.clock(),
                deliveries=1,
            )
        )
        async with self._telemetry_changed:
            self._telemetry_changed.notify_all()

    async def telemetry(self, subject: str = ">", *, since_s: float | None = None) -> AsyncIterator[Delivery]:
        prefix = "herd.telemetry." + subject.rstrip(">").rstrip(".")
        cutoff = None if since_s is None else self.clock() - since_s
        items = list(self._telemetry)
        position = len(items) if cutoff is None else 0
        while True:
            items = list(self._telemetry)
            while position < len(items):
                item = items[position]
                position += 1
                if (cutoff is None or item.at >= cutoff) and item.subject.startswith(prefix):
                    yield item
            seen = len(items)
            async with self._telemetry_changed:
                await self._telemetry_changed.wait_for(lambda seen=seen: len(self._telemetry) > seen)

    async def reply(self, inbox: str, data: bytes) -> None:
        self.replies.append((inbox, data))

    async def request(self, subject: str, data: bytes, *, timeout: float = 5.0) -> bytes:
        handler = self._handlers.get(subject)
        if handler is None:
            raise LogUnavailable(f"nobody serves herd.ctl.{subject} (is its service running?)")
        try:
            return await asyncio.wait_for(handler(data), timeout)
        except TimeoutError as exc:
            raise LogUnavailable(f"no answer on herd.ctl.{subject} within {timeout}s") from exc

    async def serve_requests(self, subject: str, handler: RequestHandler) -> Callable[[], Awaitable[None]]:
        self._handlers[subject] = handler

        async def stop() -> None:
            if self._handlers.get(subject) is handler:
                del self._handlers[subject]

        return stop

    # -- dead letters ------------------------------------------------------------------

    async def dead_letter(self, letter: DeadLetter) -> None:
        self._dead.setdefault(letter.id, letter)

    async def dead_letters(self) -> list[DeadLetter]:
        return list(self._dead.values())

    # -- key-value -------------------------------------------------------------------

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        return self._kv.get((bucket, key))

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        self._kv[(bucket, key)] = value

    async def kv_entries(self, bucket: str) -> dict[str, bytes]:
        return {key: value for (b, key), value in self._kv.items() if b == bucket}

    async def kv_purge(self, bucket: str, key: str) -> None:
        self._kv.pop((bucket, key), None)

    def leadership(self, name: str, holder: str) -> Leadership:
        return _InProcessLeadership(self, name, holder)


class _ConsumerState:
    def __init__(self) -> None:
        self.next_index = 0  # next never-delivered intake message
        self.pending: dict[int, tuple[float, int]] = {}  # seq -> (redeliver at, deliveries)


class _MemoryConsumer(DurableConsumer):
    def __init__(self, log: InProcessLog, state: _ConsumerState, ack_wait: float) -> None:
        self._log = log
        self._state = state
        self._ack_wait = ack_wait

    def _ready(self, max_messages: int) -> list[Delivery]:
        now = self._log.clock()
        out: list[Delivery] = []
        for seq, (due, count) in sorted(self._state.pending.items()):
            if len(out) >= max_messages:
                break
            if due <= now:
                self._state.pending[seq] = (now + self._ack_wait, count + 1)
                out.append(self._delivery(seq, count + 1))
        while len(out) < max_messages and self._state.next_index < len(self._log._intake):
            seq = self._state.next_index + 1
            self._state.next_index += 1
            self._state.pending[seq] = (now + self._ack_wait, 1)
            out.append(self._delivery(seq, 1))
        return out

    def _delivery(self, seq: int, count: int) -> Delivery:
        stored = self._log._intake[seq - 1]
        return Delivery(
            seq=seq,
            subject=stored.subject,
            data=stored.data,
            headers=stored.headers,
            at=stored.at,
            deliveries=count,
            token=seq,
        )

    async def fetch(self, max_messages: int = 64, timeout: float = 1.0) -> list[Delivery]:
        ready = self._ready(max_messages)
        if ready:
            return ready
        # (asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that comes as
        # the condition is notified, and the intake loop cancelled then never ended.)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._log._intake_changed:
                await self._log._intake_changed.wait_for(lambda: self._state.next_index < len(self._log._intake))
        return self._ready(max_messages)

    async def ack(self, delivery: Delivery) -> None:
        self._state.pending.pop(delivery.seq, None)

    async def in_progress(self, delivery: Delivery) -> None:
        pending = self._state.pending.get(delivery.seq)
        if pending is not None:
            self._state.pending[delivery.seq] = (self._log.clock() + self._ack_wait, pending[1])


class _InProcessLeadership(Leadership):
    def __init__(self, log: InProcessLog, name: str, holder: str) -> None:
        self._log = log
        self.name = name
        self.holder = holder
        self.ttl = log.leadership_ttl
        self._held = False

    async def try_acquire(self) -> bool:
        now = self._log.clock()
        current = self._log._leaderships.get(self.name)
        if current is None or current[1] <= now or current[0] == self.holder:
            self._log._leaderships[self.name] = (self.holder, now + self.ttl)
            self._held = True
            return True
        return False

    async def renew(self) -> None:
        if not self._held or not await self.try_acquire():  # try_acquire: ours, or expired unclaimed
            raise LeadershipLost(f"leadership {self.name!r} is no longer held by {self.holder!r}")

    async def release(self) -> None:
        current = self._log._leaderships.get(self.name)
        self._held = False
        if current is not None and current[0] == self.holder:
            del self._log._leaderships[self.name]
