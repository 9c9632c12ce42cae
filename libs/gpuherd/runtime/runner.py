"""The live shell of a decider: leadership, snapshot, catch-up, consume -> ``DecisionCore`` -> append.

All of a decider's I/O is here; what is decided on which state is the core's (``core.py``):

* **Output ids come from the input.** The n-th decision caused by the event at sequence ``s`` has
  id ``<service>:<s>:<n>`` and is stamped with ``based_on`` and ``cause``. A re-run after a crash
  produces the same ids, and the log's dedupe makes the append a no-op.
* **Decisions overlap appends.** A batch is handed to the log and the next decided while its append
  waits for the fsync (at most ``max_in_flight`` batches not yet stored; one append in flight, the
  batches decided meanwhile stored together in the next): the core decides meanwhile only what
  the batches in flight cannot have changed, on the state folded so far (``core.py``, "In flight").
* **Restart.** The runner loads its snapshot (state, sequence; a snapshot of another
  ``STATE_FORMAT``, or one beyond the log's head, is ignored), then folds the log to its head; the
  core decides what the tail still lacks.
* **One active instance.** The runner acts only while it holds the KV leadership ``decider.<service>``;
  standbys wait for it to expire, and a stopping leader releases it so a standby takes over at once
  (if NATS answers within ``SHUTDOWN_REQUEST_TIMEOUT_S``: a process stops at once, NATS or not).
* **Fenced.** Having taken the lease, the runner appends ``LeadershipTaken`` (expecting the last
  leader's as the last event of ``herd.cluster.leader.<service>``), and every later append of its
  own (decisions, its timer's ticks, recorded parameters) expects its own to still be the last
  there. The lease alone cannot stop a leader that froze past it (a paused process, a partition
  healed) from appending what it decided on stale state; the fence makes the log refuse it, and
  the refusal turns it into a standby. So does reading a newer leader's ``LeadershipTaken``.
* **Fenced snapshots.** A snapshot says its state's inputs are all decided, a promise only the
  leader can make: a runner snapshots only while its fence is the subject's last, and never a
  state holding a newer leader's fence (see ``save_snapshot``).
* **Parameters.** The operator's parameters an instance was started with (``--params``) are
  recorded by it, fenced, when it leads, before it reads the log: a standby's never overwrite the
  leader's, and an instance that leads again after another one did records its own again (the
  other's are not its). Leading again with no other leader in between records nothing: what is in
  force is still its own, or an operator's newer command, which it must not undo.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic

from gpuherd import events as ev
from gpuherd.aio import run_until_stopped
from gpuherd.errors import UNDECODABLE, ConcurrencyError, LeadershipLost, LogError, LogUnavailable
from gpuherd.log import AppendResult, EventLog, EventStore, Leadership, Record
from gpuherd.log.interfaces import Traces, trace_of
from gpuherd.metrics import ServiceMetrics, status_reporter
from gpuherd.obs import child_traceparent, get_logger
from gpuherd.runtime.core import Decided, DecisionCore, Flight, outputs_of
from gpuherd.runtime.deadletters import report_unreadable
from gpuherd.runtime.decider import Decider, S
from gpuherd.runtime.snapshots import Cadence, beyond_the_log, load_snapshot, pack_snapshot, store_snapshot
from gpuherd.runtime.stages import BatchTrace, StageTracer

# Batches decided and not yet stored, at most. One append is in flight (waiting for the log's
# fsync) while the decider decides what the batches before cannot have changed (``DecisionCore``);
# those go together in the next append. 1: every batch is folded back before the next is decided.
MAX_IN_FLIGHT = 8
REPORT_FOLDED_EVERY = 256  # records folded between two updates of ``events_consumed`` (while catching up)
# A stopping process asks NATS once more (to release its leadership) for this long at most: stopped
# with NATS away, it must not wait out a request timeout (seconds) before it ends.
SHUTDOWN_REQUEST_TIMEOUT_S = 0.1

log = get_logger("gpuherd.runtime")


async def append_reliably(
    log_: EventStore,
    events: Sequence[ev.Event],
    *,
    expect: Mapping[str, int] | None = None,
    trace: Traces = None,
    give_up_after: float = 3600.0,
) -> AppendResult:
    """Append, retrying through NATS outages; safe because ids make appends idempotent.

    Refusals by the log (LogError, ConcurrencyError among them) are not retried. An atomic batch
    refused because one of its events is stored already (a re-run after a crash) is appended one
    by one instead, so the others are not lost (each still checked against ``expect``)."""
    deadline = time.monotonic() + give_up_after
    delay = 0.05
    while True:
        try:
            result = await log_.append(events, expect=expect, trace=trace)
            if result.duplicate and len(events) > 1 and not result.seqs:
                if expect:
                    seqs_: list[int] = []
                    for n, event in enumerate(events):
                        seqs_ += (await log_.append([event], expect=expect, trace=trace_of(trace, n))).seqs
                    return AppendResult(seqs=tuple(seqs_), duplicate=True)
                seqs = await log_.append_pipelined(events)
                return AppendResult(seqs=tuple(seqs), duplicate=True)
            return result
        except LogError:
            raise
        except Exception as exc:  # connection loss, timeouts, no responders while the server restarts
            if time.monotonic() > deadline:
                raise
            log.warning("append failed; retrying", error=repr(exc), events=len(events))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


async def unless_stopped(work: Coroutine[Any, Any, bool], stop: asyncio.Event) -> bool:
    """``work``'s result, or False once ``stop`` is set first (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return False if task.cancelled() else task.result()


ExtraTask = Callable[["DeciderRunner[Any]"], Awaitable[None]]
OnDecided = Callable[[Decided], Awaitable[None]]
OnRefused = Callable[[Decided, LogError], Awaitable[None]]


@dataclass(slots=True)
class _Outgoing:
    """A batch decided and handed to the log (``Flight``), not stored yet."""

    batch: list[Decided]
    flight: Flight
    trace: BatchTrace | None

    @property
    def size(self) -> int:
        """Its outputs: events to append."""
        return sum(len(decided.outputs) for decided in self.batch)


class DeciderRunner(Generic[S]):
    """Runs one decider against a log: leadership, snapshot, catch-up, live loop."""

    def __init__(
        self,
        log_: EventLog,
        decider: Decider[S],
        *,
        instance: str,
        snapshot_every: int = 10_000,
        snapshot_interval_s: float = 10.0,
        extra_tasks: Sequence[ExtraTask] = (),
        metrics: ServiceMetrics | None = None,
        on_external: OnDecided | None = None,
        on_refused: OnRefused | None = None,
        read_linger_s: float = 0.0,
        parameters: Callable[[], ev.Event] | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.log = log_
        self.decider = decider
        self.instance = instance
        self.snapshots = Cadence(snapshot_every, snapshot_interval_s)
        self.extra_tasks = list(extra_tasks)
        self.max_in_flight = max_in_flight  # batches decided, not yet stored (1: each folded before the next)
        self.core = self._new_core()
        self.is_leader = False
        self.caught_up = asyncio.Event()
        self.decisions_appended = 0
        self.metrics = metrics or ServiceMetrics(decider.name)
        self.metrics.watch_connection(lambda: self.log.is_connected())
        # Read at scrape time, not set per record: a busy decider folds thousands a second.
        self.metrics.folded_seq.set_function(lambda: self.core.state.seq)
        self.metrics_port: int | None = None  # where serve_until_signal_with_http serves /metrics
        self.on_external = on_external  # answers an external input once its verdict is stored
        self.on_refused = on_refused  # an external input whose verdict the log refused
        self.read_linger_s = read_linger_s  # (see EventStore.read) for a decider nothing waits on at once
        # Makes the operator's parameters command (``--params``, None: given none), recorded when this
        # instance leads unless it led last (``_parameters_fence``: the fence they were recorded under).
        self.parameters = parameters
        self._parameters_fence: int | None = None
        self._leadership: Leadership | None = None
        self._fence: tuple[str, int] | None = None  # (subject, sequence) of this leadership's LeadershipTaken
        self._fence_after: int | None = None  # the subject's last sequence before it: the previous leader's
        self._fence_id = ""  # and its event id
        self._wake = asyncio.Event()  # an external input arrived
        self.snapshot_bytes = 0  # the size of the last snapshot saved
        self.stages = StageTracer.from_env(decider.name)  # where decisions' time goes (benchmarks)
        self._unreported = 0  # records folded and not yet counted in ``events_consumed``

    @property
    def name(self) -> str:
        return self.decider.name

    @property
    def state(self) -> S:
        return self.core.state

    # -- snapshots ------------------------------------------------------------------------

    async def load_snapshot(self) -> None:
        snap = await load_snapshot(self.log, self.name, self.decider.STATE_FORMAT)
        if snap is None:
            return
        try:
            self.core.state = self.decider.decode_state(snap.state)
        except UNDECODABLE as exc:
            # A snapshot is only a cache of the log: rebuild from the start.
            log.warning("snapshot unreadable; rebuilding from the log", error=str(exc))
            self.core.state = self.decider.initial_state()
            return
        self.snapshots.seq = snap.seq

    async def save_snapshot(self) -> None:
        """Store the state as this decider's snapshot, unless a newer leader fenced this one out
        (LeadershipLost: a former leader that wakes from a freeze must not write over the new
        leader's snapshot). The check precedes the write, as the snapshot bucket cannot check the
        fence itself (another stream): a leader frozen between the two can still store one, but
        only of a state it folded before the newer fence (it steps down on reading that, see
        ``_consume``), which is a true, older snapshot: it costs a longer catch-up, never a decision."""
        state = self.core.state
        if self._fence is not None:
            subject, fence = self._fence
            try:
                last = await self.log.subject_last_seq(subject)
            except LogUnavailable as exc:  # only a cache: taken at the next chance
                log.warning("snapshot put off: the fence could not be checked", decider=self.name, error=str(exc))
                return
            if last != fence:
                raise LeadershipLost(
                    f"{self.name}: a newer leader fenced this one (its snapshot not written over the newer's)"
                )
        started = time.perf_counter()
        data = pack_snapshot(self.decider.STATE_FORMAT, state.seq, self.decider.encode_state(state))
        cost = time.perf_counter() - started  # (the part that takes this process's time; storing it awaits)
        size = await store_snapshot(self.log, self.name, data)
        if size is None:
            self.snapshots.missed()
            self.metrics.snapshots_missed.inc()
            return
        self.snapshot_bytes = size
        self.snapshots.taken(state.seq, cost)

    # -- leadership ---------------------------------------------------------------------------------

    async def acquire_leadership(self, stop: asyncio.Event) -> bool:
        leadership = self.log.leadership(f"decider.{self.name}", self.instance)
        if not await leadership.acquire(stop, f"decider {self.name}"):
            return False
        self._leadership = leadership
        await self._take_fence()
        self.is_leader = True
        return True

    async def _take_fence(self, tries: int = 20) -> None:
        """Append this leadership's ``LeadershipTaken``, expecting the last one seen to still be the
        subject's last: from then on, appends of any earlier leader are refused."""
        subject = ev.leadership_subject(self.name)
        for _ in range(tries):
            last = await self.log.subject_last_seq(subject)
            taken = ev.LeadershipTaken(
                id=f"{self.name}:leader:{self.instance}:{uuid.uuid4().hex[:12]}",
                at=time.time(),
                source=self.name,
                service=self.name,
                instance=self.instance,
            )
            try:
                result = await append_reliably(self.log, [taken], expect={subject: last})
            except ConcurrencyError:
                continue  # read a stale last sequence, or another instance fenced in between: read again
            self._fence = (subject, result.seqs[0])
            self._fence_id = taken.id
            self._fence_after = last
            log.info("leadership fenced", decider=self.name, instance=self.instance, fence_seq=result.seqs[0])
            return
        raise LeadershipLost(f"{self.name}: could not append the leadership's fence in {tries} tries")

    def _expect(self) -> dict[str, int] | None:
        """What every append of this leader expects: its fence is still the latest."""
        return None if self._fence is None else {self._fence[0]: self._fence[1]}

    async def append_input(self, events: Sequence[ev.Event]) -> AppendResult:
        """Append inputs the shell records (its timer's ticks, parameters given at start), fenced like
        decisions: a former leader's stale tick never reaches the log either."""
        try:
            return await append_reliably(self.log, events, expect=self._expect())
        except ConcurrencyError as exc:
            raise LeadershipLost(f"{self.name}: a newer leader fenced this one ({exc})") from exc

    async def _record_parameters(self) -> None:
        """Record the operator's parameters this instance was started with, as the leader: fenced, and
        before it reads the log, so that they are in force for its first decision. Not again when the
        fence before this leadership's is the one they were recorded under (no one led in between)."""
        if self.parameters is None or self._fence is None:
            return
        if self._parameters_fence is not None and self._parameters_fence == self._fence_after:
            self._parameters_fence = self._fence[1]  # (still in force: this instance led last)
            return
        event = self.parameters()
        await self.append_input([event])
        self._parameters_fence = self._fence[1]
        log.info("parameters recorded", decider=self.name, instance=self.instance, command=type(event).__name__)

    async def _keep_leadership(self) -> None:
        assert self._leadership is not None
        while True:
            await asyncio.sleep(self._leadership.ttl / 3)
            try:
                await self._leadership.renew()  # taken again if it expired unclaimed during an outage
            except LeadershipLost:
                raise  # another instance leads: run() turns this one into a standby
            except Exception as exc:  # NATS briefly away: keep trying until the leadership would expire
                log.warning("leadership renewal failed; retrying", error=repr(exc))

    # -- health ----------------------------------------------------------------------------------

    def role(self) -> str:
        if not self.is_leader:
            return "standby"
        return "leader" if self.caught_up.is_set() else "catching up"

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Alive: connected to NATS and no loop found itself broken (standbys are healthy too)."""
        connected = self.log.is_connected()
        ok = connected and self.metrics.healthy
        return ok, {"service": self.name, "nats_connected": connected, "role": self.role(), "seq": self.state.seq}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready: leads and has caught up with the log."""
        ok, detail = self.health()
        return ok and self.role() == "leader", detail

    # -- main loop -----------------------------------------------------------------------------

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
                try:
                    if not await unless_stopped(self._begin_leading(stop), stop):
                        return
                except LeadershipLost as exc:
                    log.warning("fenced out as it began to lead; standby again", error=str(exc))
                    self.is_leader = False
                    self._reset()
                    continue
                self.metrics.leader.set(1)
                coroutines = {
                    "leadership": self._keep_leadership(),
                    "consume": self._consume(),
                    "decide": self._decide(),
                }
                for extra in self.extra_tasks:
                    coroutines[getattr(extra, "__name__", f"extra-{len(coroutines)}")] = extra(self)
                try:
                    await run_until_stopped(coroutines, stop)
                    return  # stopped, or a loop died (cancelled from inside): the process ends
                except LeadershipLost as exc:
                    log.warning("another instance leads now; back to standby", error=str(exc))
                    self._reset()
                finally:
                    self.is_leader = False
                    self.metrics.leader.set(0)
        finally:
            if stop.is_set():
                await self._release_leadership()
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter

    async def _begin_leading(self, stop: asyncio.Event) -> bool:
        """Wait for the leadership, fence it, record the parameters, load the snapshot: False if
        ``stop`` came first. (Each step waits through NATS outages: ``run`` stops it when stopped.)"""
        if not await self.acquire_leadership(stop):
            return False
        await self._record_parameters()
        await self.load_snapshot()
        return True

    async def _release_leadership(self) -> None:
        """Let a standby lead at once, if NATS answers in time. Otherwise the process still ends at
        once: the leadership's key expires ``ttl`` after its last renewal (the bucket's max age), and
        a standby takes it then (checked: 3 s after its holder vanished, with a TTL of 2 s)."""
        if self._leadership is None or not self.log.is_connected():
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._leadership.release(), SHUTDOWN_REQUEST_TIMEOUT_S)

    def _reset(self) -> None:
        """Forget everything folded: a standby that leads again starts from the snapshot and the log."""
        self.core = self._new_core()
        self.caught_up = asyncio.Event()
        self.snapshots.seq = self.snapshots.since = 0
        self._coalesced_seen = 0
        self._fence = None
        self._fence_after = None
        self._fence_id = ""

    def _new_core(self) -> DecisionCore[S]:
        return DecisionCore(self.decider, serial=self.max_in_flight <= 1)

    def offer(self, external: Any) -> None:
        """An input from outside the log (intake), decided in its turn."""
        self.core.offer(external, time.perf_counter())
        self._wake.set()

    async def _consume(self) -> None:
        head = await self.log.last_seq()
        if beyond_the_log(self.name, self.state.seq, head):
            self.core.state = self.decider.initial_state()
            self.snapshots.seq = 0  # (and the next snapshot replaces it)
        self.core.catch_up(head)
        if self.core.caught_up:
            self.caught_up.set()
        log.info("consuming", decider=self.name, from_seq=self.state.seq + 1, head=head)
        async for record in self.log.read(self.state.seq + 1, follow=True, linger_s=self.read_linger_s):
            kind = type(record.event)  # (exact: the codec decodes exact types, and none subclasses these two)
            if kind is ev.LeadershipTaken:
                self._check_fence(record)
            elif kind is ev.Unreadable:
                await report_unreadable(self.log, record, self.name, self.metrics)
            self.core.fold(record, time.perf_counter())
            self.snapshots.folded()
            if self.stages is not None:
                self.stages.folded(record.seq)
            self._unreported += 1
            if self._unreported >= REPORT_FOLDED_EVERY:
                self._report_folded()
            if not self.caught_up.is_set() and self.core.caught_up:
                log.info("caught up", decider=self.name, seq=record.seq, to_decide=self.core.waiting)
                self.caught_up.set()
            if self.core.ready() or self.core.quiescent():
                self._wake.set()  # decide; or, idle, see whether a snapshot is due

    def _check_fence(self, record: Record) -> None:
        """A newer leader's ``LeadershipTaken`` in the log: this instance leads no more. It stops
        before folding it, so nothing it decides or snapshots is of a state after the newer fence."""
        event = record.event
        if (
            isinstance(event, ev.LeadershipTaken)
            and event.service == self.name
            and self._fence is not None
            and record.seq > self._fence[1]
            and event.id != self._fence_id
        ):
            raise LeadershipLost(f"{self.name}: {event.instance} took the lead at position {record.seq}")

    async def _decide(self) -> None:
        """Decide whenever the core has something decidable; hand each batch to the log without
        waiting for the last one's append (``DecisionCore``: what is decided meanwhile is what that
        batch cannot have changed), at most ``max_in_flight`` batches not yet stored."""
        outbox: list[_Outgoing] = []
        appender: asyncio.Task[None] | None = None
        failed: list[BaseException] = []

        def finished(task: asyncio.Task[None]) -> None:
            if task.cancelled():  # (not by this loop, which cancels it only as it ends)
                failed.append(asyncio.CancelledError())
            elif task.exception() is not None:
                failed.append(task.exception())  # type: ignore[arg-type]
            self._wake.set()

        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if failed:
                    raise failed[0]
                self._report_folded()
                while self.core.ready() and len(outbox) < self.max_in_flight:
                    stages = self.stages if self.stages is not None and self.stages.active else None
                    start = time.time()
                    waiting = self.core.waiting
                    batch = self.core.next_batch(time.perf_counter())
                    if not batch:
                        if self.core.waiting == waiting:
                            break  # nothing decidable until a batch in flight is folded back
                        continue
                    trace = stages.decided(batch, start, time.time()) if stages is not None else None
                    outbox.append(_Outgoing(batch, self.core.dispatched(batch), trace))
                    if appender is None or appender.done():
                        if appender is not None:
                            appender.result()  # (raises what ended it, if anything did, before its callback ran)
                        appender = asyncio.create_task(self._send(outbox))
                        appender.add_done_callback(finished)
                if not outbox:
                    await self._maybe_snapshot()
        finally:
            if appender is not None and not appender.done():
                appender.cancel()
                await asyncio.gather(appender, return_exceptions=True)

    async def _send(self, outbox: list[_Outgoing]) -> None:
        """Append what the decider put in ``outbox``, in order, one append at a time: the batches
        decided while an append waits for its fsync go together in the next one (one page, one
        fsync, all or nothing; and one fenced append in flight, which a clustered stream requires
        of appends that check the same subject)."""
        while outbox:
            group, size = [outbox[0]], outbox[0].size
            for item in outbox[1:]:
                if size + item.size > self.log.max_batch:
                    break
                group.append(item)
                size += item.size
            await self._commit_group(group)
            del outbox[: len(group)]

    def _report_folded(self) -> None:
        """Count the records folded since the last call in ``events_consumed`` (once per wake of the
        decider, not once per record)."""
        if self._unreported:
            self.metrics.events_consumed.inc(self._unreported)
            self._unreported = 0

    def _traces(self, batch: list[Decided]) -> list[str | None]:
        """Each output's traceparent: a span of this decider's, child of its cause's trace (a
        submission's trace runs on through its verdict, its placement, its start)."""
        out: list[str | None] = []
        for decided in batch:
            if not decided.outputs:
                continue
            cause = decided.cause
            trace_in = getattr(cause, "trace", None)
            cause_id = cause.event.id if hasattr(cause, "event") else str(getattr(cause, "cause", ""))
            out += [child_traceparent(trace_in, f"{self.name}.decide", cause=cause_id)] * len(decided.outputs)
        return out

    async def _commit_group(self, group: list[_Outgoing]) -> None:
        """Append the outputs of several batches as one; refused, each batch on its own."""
        if len(group) == 1:
            await self._commit(group[0])
            return
        outputs = [out for item in group for out in outputs_of(item.batch)]
        traces = [trace for item in group for trace in self._traces(item.batch)]
        try:
            result = await self._append(outputs, traces)
        except LogError:
            for item in group:  # (each as alone: one with answers to outside inputs is refused alone)
                await self._commit(item)
            return
        seqs = list(result.seqs)
        for item in group:
            count = item.size
            mine, seqs = (seqs[:count], seqs[count:]) if len(result.seqs) == len(outputs) else ([], seqs)
            await self._stored(item, AppendResult(seqs=tuple(mine)), [])

    async def _commit(self, item: _Outgoing) -> None:
        batch = item.batch
        outputs = outputs_of(batch)
        traces = self._traces(batch)
        refused: list[Decided] = []
        try:
            result = await self._append(outputs, traces)
        except LogError as exc:
            if not any(decided.external for decided in batch):
                raise  # the decider's own decisions refused: a bug to stop on, not to skip
            result, refused = await self._append_each(batch, exc)
        await self._stored(item, result, refused)

    async def _stored(self, item: _Outgoing, result: AppendResult, refused: list[Decided]) -> None:
        """A batch's outputs are stored (or refused): count them, let the core know, answer."""
        batch = item.batch
        outputs = outputs_of(batch)
        acked = time.time()
        self.decisions_appended += len(outputs)
        now = time.perf_counter()
        for decided in batch:
            self.metrics.decision_latency.observe(now - decided.arrived)
        for kind, count in collections.Counter(type(output).__name__ for output in outputs).items():
            self.metrics.decisions.labels(kind).inc(count)
        self.metrics.coalesced.inc(self.core.coalesced - self._coalesced_seen)
        self._coalesced_seen = self.core.coalesced
        self.core.landed(item.flight, result.seqs)
        if item.trace is not None and self.stages is not None:
            self.stages.appended(item.trace, result.seqs, acked)
        for decided in batch:
            if not decided.external:
                continue
            if decided in refused:
                if self.on_refused is not None:
                    await self.on_refused(decided, decided.refusal)  # type: ignore[arg-type]
            elif self.on_external is not None:
                await self.on_external(decided)

    async def _append_each(self, batch: list[Decided], cause: LogError) -> tuple[AppendResult, list[Decided]]:
        """The log refused a batch with answers to outside inputs: append each input's events on its
        own, so one the log refuses (too large, say) fails alone; the shell hears of those."""
        seqs: list[int] = []
        refused: list[Decided] = []
        for decided in batch:
            try:
                part = await self._append(decided.outputs, self._traces([decided]))
            except LogError as exc:
                if not decided.external:
                    raise cause from exc
                decided.refusal = exc
                refused.append(decided)
                continue
            seqs.extend(part.seqs)
        return AppendResult(seqs=tuple(seqs)), refused

    _coalesced_seen = 0

    async def _append(self, outputs: list[ev.Event], traces: list[str | None]) -> AppendResult:
        """All-or-nothing when they fit one atomic append. A batch larger than that is appended in
        consecutive atomic parts: a crash between parts leaves the rest to the next pass (the jobs
        still wait in the folded state), and the audit reports them missing."""
        if not outputs:
            return AppendResult(seqs=())
        step = self.log.max_batch
        expect = self._expect()
        try:
            if len(outputs) <= step:
                return await append_reliably(self.log, outputs, trace=traces, expect=expect)
            seqs: list[int] = []
            for start in range(0, len(outputs), step):
                part = await append_reliably(
                    self.log, outputs[start : start + step], trace=traces[start : start + step], expect=expect
                )
                seqs.extend(part.seqs)
        except ConcurrencyError as exc:  # a newer leader's fence: what this one decided is stale
            raise LeadershipLost(f"{self.name}: a newer leader fenced this one ({exc})") from exc
        return AppendResult(seqs=tuple(seqs))

    async def _maybe_snapshot(self) -> None:
        if not self.core.quiescent():
            return  # only a quiescent state is a valid snapshot: everything in it is decided
        if self.snapshots.due(self.state.seq):
            await self.save_snapshot()
