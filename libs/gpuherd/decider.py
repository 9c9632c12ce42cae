"""The service shell: consume -> fold -> decide -> append, idempotently.

A decider is two pure functions over a state: ``evolve(state, seq, event)``
folds an event, ``decide(state, event)`` returns the events it decides on.
The runner does all I/O around them:

* **Output ids come from the input.** The n-th decision caused by the event
  at sequence ``s`` has id ``<service>:<s>:<n>`` and is stamped with
  ``based_on`` (the last sequence folded) and ``cause`` (the event's id). A
  re-run after a crash produces the same ids, and the log's dedupe makes the
  append a no-op.
* **A decision sees every earlier decision of its decider.** After appending,
  the runner decides nothing more until it has folded its own outputs; the
  events that arrive meanwhile wait in order. So the state a decision was
  made on is exactly ``fold(log[1..based_on])``, which is what the audit
  re-runs.
* **Restart.** The runner loads its snapshot (state, sequence), then folds
  the log to its head. Events of that tail whose decisions are already in
  the log (found by the ids above) are not decided again; the rest are
  decided once the head is reached, on a state that includes every decision
  of the past.
* **One active instance.** The runner acts only while it holds the KV lease
  ``decider.<service>``; standbys wait for it to expire.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import json
import os
import socket
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from gpuherd import events as ev
from gpuherd.aio import acquire_lease, patiently, run_until_stopped
from gpuherd.errors import LeaseLost, LogError, LogUnavailable
from gpuherd.log.base import HERD, SNAPSHOT_BUCKET, AppendResult, DeadLetter, EventLog, Record
from gpuherd.metrics import ServiceMetrics, metrics_port_from_env, serve_until_signal_with_http, status_reporter
from gpuherd.obs import current_traceparent, get_logger, span_from

log = get_logger("gpuherd.decider")


class HasClock(Protocol):
    seq: int
    now: float


S = TypeVar("S", bound=HasClock)


class Decider(abc.ABC, Generic[S]):
    """A pure decider. Subclasses must not read clocks, randomness or I/O."""

    name: str

    @abc.abstractmethod
    def initial_state(self) -> S: ...

    @abc.abstractmethod
    def evolve(self, state: S, seq: int, event: ev.Event) -> S: ...

    @abc.abstractmethod
    def decide(self, state: S, event: ev.Event) -> list[ev.Event]:
        """Drafts of the decisions to append; ids and provenance are stamped by ``stamp``."""

    def coalescible(self, event: ev.Event) -> bool:
        """True when all ``decide`` does for ``event`` is a pass over the whole state (nothing about
        the event itself). Of several such events waiting to be decided, the runner decides only the
        last: it sees the same state, so it makes the same pass, once."""
        return False

    def independent(self, event: ev.Event) -> str | None:
        """A key (e.g. the job) when what ``decide`` makes of ``event`` depends on nothing this decider
        decides about other keys: waiting events with different keys are then decided on one state
        and appended together, in one round trip. None: decided alone, after all before it are folded."""
        return None

    @abc.abstractmethod
    def encode_state(self, state: S) -> bytes: ...

    @abc.abstractmethod
    def decode_state(self, data: bytes) -> S: ...


P = TypeVar("P")


class RecordedParams(Generic[P]):
    """A service's parameters as the log last recorded them (a ``...Configured`` event's
    ``params``), converted once per change; ``default`` while the log recorded none, and also for
    values the service's own CLI would have refused (they never stop the decider)."""

    def __init__(self, default: P, convert: Callable[[dict[str, float]], P]) -> None:
        self.default = default
        self._convert = convert
        self._cached: tuple[tuple, P] | None = None

    def get(self, recorded: dict[str, float] | None) -> P:
        if recorded is None:
            return self.default
        key = tuple(sorted(recorded.items()))
        if self._cached is None or self._cached[0] != key:
            try:
                self._cached = (key, self._convert(recorded))
            except ValueError:
                self._cached = (key, self.default)
        return self._cached[1]


MAX_BATCH_DECISIONS = 500  # decisions appended at once (one atomic batch holds up to 1,000 events)


def decision_id(service: str, cause_seq: int, n: int) -> str:
    return f"{service}:{cause_seq}:{n}"


def cause_seq_of(event: ev.Event, service: str) -> int | None:
    """The cause sequence encoded in a decision id of ``service`` (None for other ids)."""
    prefix = service + ":"
    if not event.id.startswith(prefix):
        return None
    parts = event.id.split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def stamp(service: str, drafts: Sequence[ev.Event], cause: Record, state: HasClock) -> list[ev.Event]:
    """Give drafts their deterministic id, time and provenance."""
    out = []
    for n, draft in enumerate(drafts):
        fields: dict[str, Any] = {
            "id": decision_id(service, cause.seq, n),
            "at": state.now,
            "source": service,
        }
        if isinstance(draft, ev.Decision):
            fields["based_on"] = state.seq
            fields["cause"] = cause.event.id
        out.append(msgspec.structs.replace(draft, **fields))
    return out


def decide_stamped(decider: Decider[S], state: S, cause: Record) -> list[ev.Event]:
    """What the decider decides on ``cause`` at ``state``, fully stamped (used live and by the audit)."""
    drafts = decider.decide(state, cause.event)
    return stamp(decider.name, drafts, cause, state) if drafts else []


class Snapshot(msgspec.Struct):
    v: int
    seq: int
    state: bytes


async def append_reliably(
    log_: EventLog,
    events: Sequence[ev.Event],
    *,
    expect: Mapping[str, int] | None = None,
    trace: str | None = None,
    give_up_after: float = 3600.0,
) -> AppendResult:
    """Append, retrying through NATS outages; safe because ids make appends idempotent.

    Refusals by the log (LogError, ConcurrencyError among them) are not retried."""
    deadline = time.monotonic() + give_up_after
    delay = 0.05
    while True:
        try:
            return await log_.append(events, expect=expect, trace=trace)
        except LogError:
            raise
        except Exception as exc:  # connection loss, timeouts, no responders while the server restarts
            if time.monotonic() > deadline:
                raise
            log.warning("append failed; retrying", error=repr(exc), events=len(events))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


ExtraTask = Callable[["DeciderRunner[Any]"], Awaitable[None]]


def clock_ticker(service: str, every_s: float) -> ExtraTask:
    """A runner task that appends a ``ClockTicked`` every ``every_s`` seconds once caught up:
    time reaches the decider as an event, so time-based decisions replay exactly. (The tick
    names no node as heard and has a timeout nothing reaches: it declares no node lost.)"""

    async def tick(runner: DeciderRunner[Any]) -> None:
        await runner.caught_up.wait()
        while True:
            await asyncio.sleep(every_s)
            now = time.time()
            event = ev.ClockTicked(
                id=f"{service}:tick:{now:.3f}",
                at=now,
                source=service,
                last_heard={},
                lost_after_s=ev.TICK_ONLY_TIMEOUT_S,
            )
            await append_reliably(runner.log, [event])

    return tick


class DeciderRunner(Generic[S]):
    """Runs one decider against a log: lease, snapshot, catch-up, live loop."""

    def __init__(
        self,
        log_: EventLog,
        decider: Decider[S],
        *,
        instance: str,
        snapshot_every: int = 1000,
        snapshot_interval_s: float = 10.0,
        extra_tasks: Sequence[ExtraTask] = (),
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.log = log_
        self.decider = decider
        self.instance = instance
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        self.extra_tasks = list(extra_tasks)
        self.state: S = decider.initial_state()
        self.is_leader = False
        self.caught_up = asyncio.Event()
        self.decisions_appended = 0
        self.metrics = metrics or ServiceMetrics(decider.name)
        self.metrics_port: int | None = None  # where serve_until_signal_with_http serves /metrics
        self._pending: collections.deque[tuple[Record, float]] = collections.deque()  # with arrival time
        self._pending_passes = 0  # records in _pending the decider calls coalescible
        self._wait_until = 0  # decide nothing before our own outputs up to here are folded
        self._snapshot_seq = 0
        self._snapshot_time = time.monotonic()

    @property
    def name(self) -> str:
        return self.decider.name

    # -- snapshots ------------------------------------------------------------------------

    async def load_snapshot(self) -> None:
        try:
            data = await patiently(lambda: self.log.kv_get(SNAPSHOT_BUCKET, self.name), what="snapshot", patience_s=60)
        except LogUnavailable:
            data = None  # only a cache: rebuilt from the log instead
        if data is None:
            return
        try:
            snap = msgspec.msgpack.decode(zlib.decompress(data), type=Snapshot)
            self.state = self.decider.decode_state(snap.state)
            self._snapshot_seq = snap.seq
        except (msgspec.DecodeError, zlib.error) as exc:
            # A snapshot is only a cache of the log: rebuild from the start.
            log.warning("snapshot unreadable; rebuilding from the log", error=str(exc))
            self.state = self.decider.initial_state()

    async def save_snapshot(self) -> None:
        snap = Snapshot(v=1, seq=self.state.seq, state=self.decider.encode_state(self.state))
        data = zlib.compress(msgspec.msgpack.encode(snap), 1)
        try:
            await self.log.kv_put(SNAPSHOT_BUCKET, self.name, data)
        except Exception as exc:  # a missed snapshot costs a longer catch-up, nothing else
            log.warning("snapshot not saved", error=repr(exc), bytes=len(data))
            return
        self._snapshot_seq = self.state.seq
        self._snapshot_time = time.monotonic()

    # -- lease ---------------------------------------------------------------------------------

    async def acquire_leadership(self, stop: asyncio.Event) -> bool:
        lease = self.log.lease(f"decider.{self.name}", self.instance)
        if not await acquire_lease(lease, stop, f"decider {self.name}"):
            return False
        self._lease = lease
        self.is_leader = True
        return True

    async def _keep_lease(self) -> None:
        while True:
            await asyncio.sleep(self._lease.ttl / 3)
            try:
                await self._lease.renew()  # taken again if it expired unclaimed during an outage
            except LeaseLost:
                raise  # another instance leads: run() turns this one into a standby
            except Exception as exc:  # NATS briefly away: keep trying until the lease would expire
                log.warning("lease renewal failed; retrying", error=repr(exc))

    # -- main loop -----------------------------------------------------------------------------

    def role(self) -> str:
        if not self.is_leader:
            return "standby"
        return "leader" if self.caught_up.is_set() else "catching up"

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Alive: connected to NATS and no loop found itself broken (standbys are healthy too)."""
        connected = self.log.is_connected()
        self.metrics.nats_connected.set(1 if connected else 0)
        ok = connected and self.metrics.healthy
        return ok, {"service": self.name, "nats_connected": connected, "role": self.role(), "seq": self.state.seq}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready: leads and has caught up with the log."""
        ok, detail = self.health()
        return ok and self.role() == "leader", detail

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        reporter = asyncio.create_task(
            status_reporter(
                self.log,
                self.metrics,
                instance=self.instance,
                role=self.role,
                folded=lambda: self.state.seq,
                decisions=lambda: self.decisions_appended,
                metrics_port=self.metrics_port,
            )
        )
        try:
            while not stop.is_set():
                if not await self.acquire_leadership(stop):
                    return
                self.metrics.leader.set(1)
                await self.load_snapshot()
                coroutines = {"lease": self._keep_lease(), "consume": self._consume()}
                for extra in self.extra_tasks:
                    coroutines[getattr(extra, "__name__", f"extra-{len(coroutines)}")] = extra(self)
                try:
                    await run_until_stopped(coroutines, stop)
                    return  # stopped, or a loop died (cancelled from inside): the process ends
                except LeaseLost as exc:
                    log.warning("another instance leads now; back to standby", error=str(exc))
                    self._reset()
                finally:
                    if stop.is_set():
                        with contextlib.suppress(Exception):
                            await self._lease.release()
                    self.is_leader = False
                    self.metrics.leader.set(0)
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter

    def _reset(self) -> None:
        """Forget everything folded: a standby that leads again starts from the snapshot and the log."""
        self.state = self.decider.initial_state()
        self.caught_up = asyncio.Event()
        self._pending.clear()
        self._pending_passes = 0
        self._wait_until = 0
        self._snapshot_seq = 0

    async def _consume(self) -> None:
        head = await self.log.last_seq()
        catching_up = head > self.state.seq
        decided: set[int] = set()
        if not catching_up:
            self.caught_up.set()
        log.info("consuming", decider=self.name, from_seq=self.state.seq + 1, head=head)
        async for record in self.log.read(self.state.seq + 1, follow=True):
            arrived = time.perf_counter()
            if isinstance(record.event, ev.Unreadable):
                await report_unreadable(self.log, record, self.name, self.metrics)
            self.state = self.decider.evolve(self.state, record.seq, record.event)
            self.metrics.events_consumed.inc()
            self.metrics.folded_seq.set(record.seq)
            if catching_up:
                cause = cause_seq_of(record.event, self.name)
                if cause is not None:
                    decided.add(cause)
            self._pending.append((record, arrived))
            self._pending_passes += self.decider.coalescible(record.event)
            if catching_up and record.seq >= head:
                catching_up = False
                self._pending = collections.deque(p for p in self._pending if p[0].seq not in decided)
                self._pending_passes = sum(self.decider.coalescible(p[0].event) for p in self._pending)
                decided.clear()
                log.info("caught up", decider=self.name, seq=record.seq, to_decide=len(self._pending))
                self.caught_up.set()
            if not catching_up and self.state.seq >= self._wait_until:
                await self._decide_pending()
                await self._maybe_snapshot()

    async def _decide_pending(self) -> None:
        while self._pending and self.state.seq >= self._wait_until:
            batch = self._next_batch()
            if not batch:
                continue
            outputs = [out for _, _, decided in batch for out in decided]
            record = batch[0][0]
            with span_from(record.trace, f"{self.name}.decide", cause=record.event.id) as span:
                trace = current_traceparent() if span.get_span_context().is_valid else record.trace
                result = await self._append(outputs, trace)
            self.decisions_appended += len(outputs)
            now = time.perf_counter()
            for _, arrived, _ in batch:
                self.metrics.decision_latency.observe(now - arrived)
            for output in outputs:
                self.metrics.decisions.labels(type(output).__name__).inc()
            if result.seqs:
                self._wait_until = max(result.seqs)

    async def _append(self, outputs: list[ev.Event], trace: str | None) -> AppendResult:
        """All-or-nothing when they fit one atomic append. A pass that places more jobs than that is
        appended in consecutive atomic parts: a crash between parts leaves the rest of that pass to
        the next one (the jobs still wait in the folded state), and the audit reports them missing."""
        step = self.log.max_batch
        if len(outputs) <= step:
            return await append_reliably(self.log, outputs, trace=trace)
        seqs: list[int] = []
        for start in range(0, len(outputs), step):
            part = await append_reliably(self.log, outputs[start : start + step], trace=trace)
            seqs.extend(part.seqs)
        return AppendResult(seqs=tuple(seqs))

    def _next_batch(self) -> list[tuple[Record, float, list[ev.Event]]]:
        """The next waiting events that have decisions, decided on the current state: one event, or
        a run of independent ones with distinct keys (``Decider.independent``). Events decided to
        nothing, and passes a later waiting event makes too, are consumed on the way."""
        batch: list[tuple[Record, float, list[ev.Event]]] = []
        keys: set[str] = set()
        size = 0
        while self._pending:
            record, arrived = self._pending[0]
            key = self.decider.independent(record.event)
            if batch and (key is None or key in keys or size >= MAX_BATCH_DECISIONS):
                break  # decided once the batch is folded
            self._pending.popleft()
            if self.decider.coalescible(record.event):
                self._pending_passes -= 1
                if self._pending_passes > 0:
                    self.metrics.coalesced.inc()
                    continue  # a later waiting event makes this same pass
            outputs = decide_stamped(self.decider, self.state, record)
            if outputs:
                batch.append((record, arrived, outputs))
                size += len(outputs)
            if key is None:
                if batch:
                    break
                continue
            keys.add(key)
        return batch

    async def _maybe_snapshot(self) -> None:
        if self._pending or self.state.seq < self._wait_until:
            return  # only a quiescent state is a valid snapshot: everything in it is decided
        due = self.state.seq - self._snapshot_seq >= self.snapshot_every or (
            self.state.seq > self._snapshot_seq and time.monotonic() - self._snapshot_time >= self.snapshot_interval_s
        )
        if due:
            await self.save_snapshot()


async def report_unreadable(log_: EventLog, record: Record, consumer: str, metrics: ServiceMetrics | None) -> None:
    """Keep an event that does not decode as a dead letter (one per stored message, whoever finds it);
    the reader folds it as nothing and goes on."""
    event = record.event
    assert isinstance(event, ev.Unreadable)
    log.error("unreadable event in the log; kept as a dead letter", seq=record.seq, reason=event.reason)
    if metrics is not None:
        metrics.dead_letters.inc()
    letter = DeadLetter(
        stream=HERD,
        seq=record.seq,
        subject=event.stored_subject,
        consumer=consumer,
        reason=event.reason,
        at=time.time(),
        data=event.data,
    )
    await keep_dead_letter(log_, letter, give_up_after=10.0)


async def keep_dead_letter(log_: EventLog, letter: DeadLetter, *, give_up_after: float = 3600.0) -> bool:
    """Store a dead letter, retrying through NATS outages; False if it could not be stored (a role
    without the right, a long outage: the error log still says it)."""
    try:
        await patiently(
            lambda: asyncio.wait_for(log_.dead_letter(letter), 10.0), what="dead letter", patience_s=give_up_after
        )
    except LogUnavailable as exc:
        log.warning("dead letter not stored", seq=letter.seq, stream=letter.stream, error=str(exc))
        return False
    return True


def params_argument(text: str | None, convert: Callable[[dict[str, float]], object]) -> dict[str, float] | None:
    """A service's ``--params`` JSON as the dict its ``...Configured`` event records; ValueError
    (with the known names) for what its parameters class refuses."""
    if text is None:
        return None
    try:
        raw = json.loads(text)
        params = {str(k): float(v) for k, v in raw.items()}
    except (json.JSONDecodeError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f'not a JSON object of numbers ({exc}); e.g. {{"lease_term_s": 300}}') from None
    convert(params)
    return params


async def serve_decider(
    url: str,
    decider: Decider[Any],
    *,
    tick_s: float,
    configured: ev.Event | None = None,
    instance: str | None = None,
    metrics_port: int | None = None,
) -> None:
    """Run a decider on the log at ``url`` until SIGTERM, with a clock tick every ``tick_s``; append
    ``configured`` (the service's parameters) first when given."""
    from gpuherd.log import open_log

    instance = instance or f"{socket.gethostname()}-{os.getpid()}"
    log_ = await open_log(url, name=f"{decider.name}-{instance}")
    if configured is not None:
        await append_reliably(log_, [configured])
    runner = DeciderRunner(log_, decider, instance=instance, extra_tasks=[clock_ticker(decider.name, tick_s)])
    try:
        await serve_until_signal_with_http(runner, metrics_port)
    finally:
        await log_.close()


def decider_service_main(
    argv: list[str] | None,
    decider: Decider[Any],
    *,
    description: str,
    configured: Callable[..., ev.Event],
    convert: Callable[[dict[str, float]], object],
    example: str,
    tick_s: float,
) -> None:
    """The command line of a service that is one decider with a clock: ``--nats-url``, ``--params``
    (recorded as ``configured(params=...)`` before it starts), ``--tick``, ``--instance``."""
    import asyncio

    from gpuherd.obs import configure

    parser = decider_service_parser(decider.name, description=description, example=example, tick_s=tick_s)
    args = parser.parse_args(argv)
    configure(decider.name)
    try:
        params = params_argument(args.params, convert)
    except ValueError as exc:
        parser.error(f"--params: {exc}")
    now = time.time()
    event = (
        None
        if params is None
        else configured(id=f"{decider.name}:config:{os.getpid()}:{now:.6f}", at=now, source=decider.name, params=params)
    )
    asyncio.run(
        serve_decider(
            args.nats_url,
            decider,
            tick_s=args.tick,
            configured=event,
            instance=args.instance,
            metrics_port=args.metrics_port,
        )
    )


def decider_service_parser(name: str, *, description: str, example: str, tick_s: float) -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog=f"gpuherd-{name}", description=description)
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument(
        "--params", default=None, help=f"record these parameters (JSON, e.g. {example}) before starting"
    )
    parser.add_argument("--tick", type=float, default=tick_s, help="seconds between clock ticks")
    parser.add_argument("--instance", default=None)
    add_metrics_argument(parser)
    return parser


def add_metrics_argument(parser: Any) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=metrics_port_from_env(),
        help="serve /metrics, /healthz and /readyz on this port (0: any free one; default $GPUHERD_METRICS_PORT, "
        "else none)",
    )
