"""The ordering core: which inputs a decider decides, on which state, and in what groups.

Live (``runner.DeciderRunner``, on JetStream) and in simulation (``apps/sim``, on a virtual clock)
the same ``DecisionCore`` decides; only the I/O around it differs. Its rules:

* **Fold, then decide.** Every record is folded; the ones the decider follows wait to be decided.
* **A decision sees every earlier decision of its decider** that could change it. After its outputs
  are appended, the core decides nothing more until they are folded (``appended`` -> ``wait_until``);
  the inputs that arrive meanwhile wait in order (live, only those the batch could change: see "In
  flight" below). So the state a decision was made on is exactly ``fold(log[1..based_on])``, which
  is what the audit re-runs.
* **Coalescing.** Of several waiting inputs that only make a pass over the whole state
  (``Decider.coalescible``), only the last is decided: same state, same pass, once. Live, a pass
  is not put off for longer than ``MAX_PASS_DEFERRAL_S``: under a steady stream of events there is
  always a later pass waiting, behind other inputs, and putting each off to the next one left jobs
  waiting for a pass for seconds. An overdue pass is decided when its turn comes, and the later
  waiting passes are dropped: everything waiting is folded already, so the pass sees what they
  would have seen. (A simulation, which asks with no clock, always coalesces to the last.)
* **Batching.** Waiting inputs the decider calls independent (distinct keys) are decided on one
  state and appended together: one round trip instead of one per input. Where the decider says
  its answers read nothing a pass decides (``TAKES_BESIDE_PASSES``), the external inputs right
  behind a pass join the pass's batch: a submission does not wait a round trip for a pass. A
  pass joins the batch of the independent inputs waiting ahead of it too (decided on the same
  state), unless it decides about one of their keys (``Decider.keys_of``): live, the jobs a batch
  accepted are placed in the next round trip even while submissions and task ends keep arriving.
* **Catch-up.** After a restart the core folds the log to its head before deciding anything; the
  inputs of that tail whose decisions are already in the log (found by their ids, which encode
  the cause) are not decided again.
* **Repeats.** A report a relay paged may be stored twice (``gpuherd.log.relay``). Every fold
  takes the first word on a task, so the second copy is folded as nothing new, and it is not
  decided either: a copy (the same node and id) of a report among the last ``RECENT_REPORTS``
  followed is passed over.
  (Decided, it would make a pass at a moment no other input asked for one.)
* **External inputs** (submissions from intake) wait in the same queue as records, are decided on
  the state of their turn, and get an ``Answer`` (the verdict) for the shell to send back.
* **In flight** (live). The runner may hand a batch to the log (``dispatched``) and ask for the
  next one before the first is folded back: its append's fsync is then not a wait of every
  decision behind it. What is decided meanwhile is what could have joined that batch, decided on
  the state of now (never a guess at the log to come, so the audit re-decides every batch on
  exactly ``fold(log[1..based_on])``): inputs of other keys than those of the batches in flight,
  and while a pass is in flight, no pass or other input that reads the whole state. A pass is
  decided once no pass is in flight, beside the batches of other keys (as it joins their batch).
  The simulation dispatches nothing: for it, and for ``serial`` cores, every batch is folded
  before the next is decided, as above.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.log.relay import PAGED_REPORTS
from gpuherd.runtime.decider import MAX_BATCH_DECISIONS, Answer, Decider, S, cause_seq_of, decide_stamped

MAX_PASS_DEFERRAL_S = 0.005  # live: a pass waiting this long is decided in its turn, not put off again
SCAN_BESIDE = 2048  # waiting inputs looked at for ones decidable beside the batches in flight
# Reports followed lately, by id, to pass over a second copy: it comes a relay's answer timeout (2 s)
# and an agent's own append after the first; this many cover that at the 2,000 jobs/s targeted.
RECENT_REPORTS = 32_768


@dataclass(slots=True)
class Decided:
    """One input decided: a record of the log, or an external input with the answer to send back."""

    cause: Record | Any
    arrived: float
    outputs: list[ev.Event]
    answer: Answer | None = None
    refusal: Exception | None = None  # the log refused its outputs (set by the live runner)
    key: str | None = None  # its key (``Decider.independent``/``external_key``): None for a pass or alike

    @property
    def external(self) -> bool:
        return self.answer is not None


@dataclass(slots=True)
class _Waiting:
    item: Record | Any
    arrived: float
    external: bool
    coalescible: bool = False  # a record that only makes a pass (asked of the decider once, as it is folded)
    passing: bool = False  # a record that makes a pass or nothing (``Decider.only_passes``)


@dataclass(slots=True)
class Flight:
    """A batch handed to the log and not yet folded back (``DecisionCore.dispatched``)."""

    keys: frozenset[str]  # what it decides about: its inputs' keys, and the keys its passes decide about
    whole: bool  # it holds a pass (or another decision on an event of no key)
    unknown: bool  # a pass of it decides about keys ``Decider.keys_of`` does not know
    sole: bool  # it answers an input of no key (e.g. a workflow): nothing is decided beside it
    last: int | None = None  # the position of its last output, once stored


@dataclass
class DecisionCore(Generic[S]):
    decider: Decider[S]
    state: S = field(default=None)  # type: ignore[assignment]
    max_batch: int = MAX_BATCH_DECISIONS
    wait_until: int = 0  # decide nothing before its own outputs up to here are folded
    coalesced: int = 0  # passes made by a later waiting input instead (a metric)
    serial: bool = False  # decide nothing while a dispatched batch is not folded back

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = self.decider.initial_state()
        self._pending: collections.deque[_Waiting] = collections.deque()
        self._passes = 0  # waiting inputs the decider calls coalescible
        self._head: int | None = None  # catching up to this sequence
        self._decided: set[int] = set()  # causes whose decisions the tail holds (while catching up)
        self._flights: list[Flight] = []  # dispatched, not folded back yet (live)
        # The head of the queue, looked at beside the flights and left waiting, in order (before
        # ``_pending``): looked at again only once a flight is over (what held them back is gone).
        self._held: list[_Waiting] = []
        self._held_keys: set[str] = set()  # their keys: a later input of one of them waits too
        self._busy: frozenset[str] | None = None  # the flights' keys (None: to be gathered again)
        # Reports followed lately, as (node, id): a second copy is not decided again (``_repeated``).
        self._recent: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    # -- feeding -----------------------------------------------------------------------------------

    def catch_up(self, head: int) -> None:
        """Fold up to ``head`` (the log's end when the decider starts) before deciding anything.
        A state folded beyond it is of another log (see ``snapshots.beyond_the_log``): refused, as
        its reader would wait past the head and fold nothing."""
        if head < self.state.seq:
            raise ValueError(f"{self.decider.name}: state folded to {self.state.seq}, beyond the log's head {head}")
        self._head = head if head > self.state.seq else None

    @property
    def caught_up(self) -> bool:
        return self._head is None

    def fold(self, record: Record, arrived: float = 0.0) -> None:
        """Fold one record of the log (in sequence order); it waits to be decided if followed."""
        decider = self.decider
        self.state = decider.evolve(self.state, record.seq, record.event)
        event = record.event
        if self._head is not None:
            cause = cause_seq_of(event, decider.name)
            if cause is not None:
                self._decided.add(cause)
        if decider.follows(event) and not (type(event) in PAGED_REPORTS and self._repeated(event)):
            coalescible = decider.coalescible(event)
            passing = coalescible or decider.only_passes(event)
            self._pending.append(_Waiting(record, arrived, False, coalescible, passing))
            self._passes += coalescible
        if self._head is not None and record.seq >= self._head:
            self._head = None
            decided = self._decided
            self._pending = collections.deque(
                w
                for w in self._pending
                if w.external or w.item.seq not in decided  # type: ignore[union-attr]
            )
            self._passes = sum(w.coalescible for w in self._pending if not w.external)
            self._decided = set()

    def _repeated(self, report: Any) -> bool:
        """Whether ``report`` was followed lately (this is its second copy: the same id from the
        same node, which another node's agent cannot write)."""
        recent = self._recent
        key = (report.node, report.id)
        if key in recent:
            return True
        recent[key] = None
        if len(recent) > RECENT_REPORTS:
            recent.popitem(last=False)
        return False

    def offer(self, external: Any, arrived: float = 0.0) -> None:
        """An input from outside the log (a submission), decided in turn with the records."""
        self._pending.append(_Waiting(external, arrived, True))

    # -- deciding ------------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._held) + len(self._pending)

    def ready(self) -> bool:
        """Something waits, and the decider's own outputs appended (``appended``) are folded. (Live,
        with batches in flight, ``next_batch`` says what of it is decidable now.)"""
        return bool(self._pending or self._held) and self._head is None and self.state.seq >= self.wait_until

    def quiescent(self) -> bool:
        """Nothing waits and every output is folded: the state is a valid snapshot."""
        return (
            not self._pending
            and not self._held
            and self._head is None
            and self.state.seq >= self.wait_until
            and not self._open_flights()
        )

    # -- batches in flight (live) ---------------------------------------------------------------------

    def dispatched(self, batch: list[Decided]) -> Flight:
        """``batch`` is being appended: until it is folded back (``landed``, then folded), what is
        decided is only what it cannot have changed."""
        keys: set[str] = set()
        whole = unknown = sole = False
        for decided in batch:
            if decided.key is not None:
                keys.add(decided.key)
            elif decided.external:
                sole = True
            else:
                whole = True
                touched = self.decider.keys_of(decided.outputs)
                if touched is None:
                    unknown = True
                else:
                    keys |= touched
        flight = Flight(frozenset(keys), whole, unknown, sole)
        self._flights.append(flight)
        self._busy = None
        return flight

    def landed(self, flight: Flight, seqs: Iterable[int]) -> None:
        """``flight``'s outputs are stored at ``seqs`` (none: refused, or stored already): it is over
        once they are folded."""
        flight.last = max(seqs, default=0)
        if flight.last <= self.state.seq:
            self._flights.remove(flight)
            self._release_held()

    @property
    def in_flight(self) -> int:
        """Dispatched batches not folded back yet."""
        return len(self._open_flights())

    def _open_flights(self) -> list[Flight]:
        flights = self._flights
        if flights:
            seq = self.state.seq
            open_ = [f for f in flights if f.last is None or f.last > seq]
            if len(open_) != len(flights):
                self._flights = flights = open_
                self._release_held()
        return flights

    def _release_held(self) -> None:
        """A flight is over: what it held back is looked at again, in its turn at the head."""
        self._busy = None
        if self._held:
            self._pending.extendleft(reversed(self._held))
            self._held = []
        self._held_keys.clear()

    def next_batch(self, now: float | None = None) -> list[Decided]:
        """The next waiting inputs that have decisions (or answers), decided on the current state: one
        input, or a run of independent ones with distinct keys. Inputs decided to nothing, and passes
        a later waiting input makes too, are consumed on the way. ``now`` (live: the clock of
        ``arrived``) lets a pass that has waited ``MAX_PASS_DEFERRAL_S`` be decided in its turn.

        With batches in flight (``dispatched``), what they cannot have changed: [] when none of what
        waits is, or what was is decided to nothing (``waiting`` then fell); ask again once something
        arrives or a flight ends."""
        flights = self._open_flights()
        if not flights:
            return self._next_batch(now)
        if self.serial or self._head is not None or any(f.sole for f in flights):
            return []
        return self._next_beside(flights)

    def _next_batch(self, now: float | None) -> list[Decided]:
        """``next_batch`` with nothing in flight (always, in a simulation)."""
        decider, state = self.decider, self.state
        batch: list[Decided] = []
        keys: set[str] = set()
        record_keys: set[str] = set()  # the keys the batch decides about (of the log's events, not answers)
        size = 0
        answers_only = False  # behind a pass: only external inputs may join the batch
        while self._pending:
            waiting = self._pending[0]
            item = waiting.item
            key = decider.external_key(item) if waiting.external else decider.independent(item.event)  # type: ignore[union-attr]
            if batch and ((key is None and not self._pass_may_join(waiting)) or key in keys or size >= self.max_batch):
                break  # decided once the batch is folded
            if answers_only and not waiting.external:
                break
            self._pending.popleft()
            if waiting.external:
                answer = decider.take(state, waiting.item)
                batch.append(Decided(waiting.item, waiting.arrived, answer.events, answer, key=key))
                size += len(answer.events)
            else:
                record: Record = waiting.item  # type: ignore[assignment]
                coalescible = waiting.coalescible
                if coalescible:
                    self._passes -= 1
                    if self._passes > 0:
                        if now is None or now - waiting.arrived < MAX_PASS_DEFERRAL_S:
                            self.coalesced += 1
                            continue  # a later waiting input makes this same pass
                        self._drop_passes()  # overdue: this pass is theirs too (they are folded)
                outputs = decide_stamped(decider, state, record)
                if outputs and key is None and record_keys and self._overlaps(outputs, record_keys):
                    self._pending.appendleft(waiting)  # it waits for those decisions to be folded
                    self._passes += coalescible
                    break
                if outputs:
                    batch.append(Decided(record, waiting.arrived, outputs, key=key))
                    size += len(outputs)
                    if key is not None:
                        record_keys.add(key)
            if key is None:
                if batch and not (decider.TAKES_BESIDE_PASSES and not waiting.external):
                    break
                answers_only = answers_only or bool(batch)
                continue
            keys.add(key)
        return batch

    def _next_beside(self, flights: list[Flight]) -> list[Decided]:
        """The waiting inputs of a key that every batch in flight leaves alone, passed over by the
        others (a pass in flight, or a key in flight at the head of the queue): answers (where the
        decider takes them beside passes) and independent events, in their order per key. An input
        that makes only a pass waits while a pass is in flight; otherwise the first one is decided
        (and the other waiting passes are dropped: it sees what they would) unless its pass decides
        about a key of the batch or of one in flight, and only answers join the batch behind it.
        Everything from the first other input of no key on waits (it may read anything)."""
        decider, state = self.decider, self.state
        busy = self._busy
        if busy is None:
            busy = self._busy = frozenset().union(*(f.keys for f in flights))
        records_ok = not any(f.unknown for f in flights)
        passes_ok = not any(f.whole for f in flights)
        answers_ok = decider.TAKES_BESIDE_PASSES
        batch: list[Decided] = []
        keys = self._held_keys  # held back, or taken into this batch
        kept = self._held
        taken: set[str] = set()  # the keys of this batch
        drop_passes = False
        size = 0
        pending = self._pending
        for _ in range(min(len(pending), SCAN_BESIDE)):
            if size >= self.max_batch:
                break
            waiting = pending[0]
            if waiting.external:
                key = decider.external_key(waiting.item)
                if key is None:
                    break
                eligible = answers_ok
            elif waiting.passing:
                if not passes_ok:
                    kept.append(pending.popleft())  # once no pass is in flight
                    continue
                pending.popleft()
                if waiting.coalescible:
                    self._passes -= 1
                    if drop_passes:  # a pass on this state was decided already: it is this one's too
                        self.coalesced += 1
                        continue
                    drop_passes = True
                record: Record = waiting.item  # type: ignore[assignment]
                outputs = decide_stamped(decider, state, record)
                if outputs:
                    if self._overlaps(outputs, busy | taken):
                        kept.append(waiting)  # it waits for those to be folded, and so do the passes behind it
                        self._passes += waiting.coalescible
                        drop_passes = passes_ok = False
                        continue
                    batch.append(Decided(record, waiting.arrived, outputs))
                    size += len(outputs)
                    passes_ok = records_ok = False  # one pass a batch, then only answers beside it
                continue
            else:
                key = decider.independent(waiting.item.event)  # type: ignore[union-attr]
                if key is None:
                    break
                eligible = records_ok
            if not eligible or key in busy or key in keys:
                keys.add(key)
                kept.append(pending.popleft())
                continue
            keys.add(key)
            taken.add(key)
            pending.popleft()
            if waiting.external:
                answer = decider.take(state, waiting.item)
                batch.append(Decided(waiting.item, waiting.arrived, answer.events, answer, key=key))
                size += len(answer.events)
            else:
                record = waiting.item  # type: ignore[assignment]
                outputs = decide_stamped(decider, state, record)
                if outputs:
                    batch.append(Decided(record, waiting.arrived, outputs, key=key))
                    size += len(outputs)
        if drop_passes:
            self._drop_passes()  # the pass decided sees all they would (they are folded)
        return batch

    def _pass_may_join(self, waiting: _Waiting) -> bool:
        """A pass joins the batch of the independent inputs waiting ahead of it (answers, events of
        distinct keys), decided on their state: the jobs just folded are placed in this round trip,
        not after the batch ahead of them has made one."""
        return not waiting.external and waiting.coalescible

    def _overlaps(self, outputs: list[ev.Event], record_keys: set[str]) -> bool:
        """Whether a pass's outputs decide about a key the batch already decides about."""
        touched = self.decider.keys_of(outputs)
        return touched is None or not touched.isdisjoint(record_keys)

    def _drop_passes(self) -> None:
        """Forget every waiting input that only makes a pass: the one being decided makes it."""
        kept = collections.deque(w for w in self._pending if w.external or not w.coalescible)
        held = [w for w in self._held if w.external or not w.coalescible]
        self.coalesced += len(self._pending) - len(kept) + len(self._held) - len(held)
        self._pending = kept
        self._held = held
        self._passes = 0

    def appended(self, seqs: Iterable[int]) -> None:
        """The batch's outputs are stored at ``seqs``: decide nothing more until they are folded."""
        last = max(seqs, default=0)
        if last > self.wait_until:
            self.wait_until = last


def outputs_of(batch: list[Decided]) -> list[ev.Event]:
    """The outputs of a batch, in order (a batch of one: its own list, not a copy; nobody changes it)."""
    if len(batch) == 1:
        return batch[0].outputs
    return [out for decided in batch for out in decided.outputs]
