"""A discrete-event simulation of a gpuherd cluster: the live deciders, and the live runtime core, on a
virtual clock.

Nothing here decides anything. The engine

* keeps a virtual clock and a heap of what happens next (a trace job is submitted, a simulated task
  ends, a service's timer ticks, a node finishes booting);
* hands submissions to the scheduler's intake judge (``Decider.take``) through the same ordering core
  (``gpuherd.runtime.core.DecisionCore``) the live runner drives, so coalescing, batching and
  ``based_on`` are the live ones: the same inputs give the same decisions, record for record;
* appends what happens to its log (a list of records: one process, nothing to wait for, no
  duplicate to refuse since every id is derived from what it is about), and feeds
  every record, in order, to each decider's core and to the node agents (``agents.py``: the live
  agent's reconcile step and the ``sim`` executor's task bookkeeping).

The deciders are the production classes (``apps.registry``), so a simulation exercises exactly the
code that runs live: there is no second copy of any policy or of the runtime.

Work carried across preemption: a sim job checkpoints when it is preempted (live agents send
SIGUSR1 and wait its grace), so its next attempt runs only what is left of its duration. Jobs are
deterministic: the same inputs give the same log, record for record.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from apps.sim.agents import NOT_FOR_AGENTS, SimAgents
from apps.sim.elastic import ElasticRuns
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from gpuherd.runtime.core import DecisionCore, outputs_of
from gpuherd.runtime.decider import Decider


class SimulationError(GpuherdError):
    """The simulation cannot go on (a decider failed, or it cannot finish)."""


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """A run keeps every record and job state it makes: millions of long-lived objects and no
    reference cycles. CPython's default thresholds collect every 700 allocations and keep
    rescanning them (a third of the run time on philly.csv), so a run collects every 100,000
    instead; the thresholds are put back after it."""
    before = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


# (Looked up by type, per record: no subclass of an event type is ever written.)
_MOVES = frozenset({ev.JobFinished, ev.JobRequeued, ev.JobResized, ev.RescaleCompleted})


@dataclass(frozen=True)
class Timer:
    """A service's timer in the simulation: its tick type, every ``every_s`` virtual seconds, while
    ``needed`` says so of its decider's state (a live service ticks the same way)."""

    decider: str
    kind: type[ev.Tick]
    every_s: float
    needed: Callable[[Any], bool] | None = None  # None: while jobs remain
    # Started again after a pause, it ticks when it would have had it never paused (its ticks keep
    # their times: a timer whose pauses only skip ticks that could change nothing changes no decision).
    on_grid: bool = False
    # When a time-based decision falls due in its decider's state (a job's time limit): it also ticks
    # then, as the live timer does, whether or not ``needed``.
    due: Callable[[Any], float | None] | None = None


class Simulation:
    """A cluster on a virtual clock: set-up events, then trace submissions, until every job ends."""

    def __init__(
        self,
        deciders: Sequence[Decider[Any]],
        *,
        timers: Sequence[Timer] = (),
        boot_s: float = 300.0,
        agents: bool = True,
        checkpoint_cost: Callable[[int], float] | None = None,
        per_moment: bool = False,
        keep_log: bool = True,
        sinks: Sequence[Callable[[Sequence[Record]], None]] = (),
        elastic_runs: ElasticRuns | None = None,
    ) -> None:
        self.now = 0.0
        # ``keep_log`` False: a record is dropped once every core, the agents and ``sinks`` (which see
        # every record, in order, a run of records at a time) have had it; a long run then holds its
        # states, not its history.
        self.keep_log = keep_log
        self.sinks = tuple(sinks)
        self.appended = 0  # records appended so far (the last seq)
        # Decide once per moment of the clock, after all that happens at it (tasks end first, then
        # jobs arrive), and the scheduler last: the model of simulators that step a whole second.
        self.per_moment = per_moment
        self._records: list[Record] = []  # the log (keep_log), else the records not yet fed
        self.cores = [DecisionCore(d) for d in deciders]
        by_name = {core.decider.name: core for core in self.cores}
        if "scheduler" not in by_name:
            raise SimulationError("a simulation needs the scheduler's decider")
        self.scheduler = by_name["scheduler"]
        self._others = [core for core in self.cores if core is not self.scheduler]  # (what it waits for per moment)
        # None: the caller plays the agents. ``checkpoint_cost``: a preempted job's restore, by its GPUs.
        self.agents = (
            SimAgents(boot_s=boot_s, checkpoint_cost=checkpoint_cost, elastic=elastic_runs) if agents else None
        )
        self.timers = [t for t in timers if t.decider in by_name]
        self._timer_cores = {t.decider: by_name[t.decider] for t in self.timers}
        self._heap: list[tuple[float, int, str, Any]] = []
        self._order = itertools.count()
        self._fed = 0  # records of ``_records`` handed to the cores, the agents and the sinks
        self._more_jobs = False
        self._ticking: set[int] = set()  # timers with a tick on the heap
        self._last_tick: dict[int, float] = {}  # on-grid timers: the time of their latest tick, made or skipped
        self._due_at: dict[int, float] = {}  # timers with a tick for a due decision on the heap: its time
        self._ticked_at: dict[int, float] = {}  # each timer's latest tick made (one tick per moment)
        self.submitted = 0
        self.decisions = 0

    # -- the loop --------------------------------------------------------------------------------

    def _push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, payload))

    def _append(self, events: list[ev.Event]) -> range:
        """Append ``events`` to the log; their sequences (a range: nothing is built per record)."""
        first = self.appended + 1
        if events:
            self._records.extend(map(Record, range(first, first + len(events)), events))
            self.appended += len(events)
        return range(first, self.appended + 1)

    def _drain(self) -> None:
        """What the live runners and agents do between two moments of the clock: fold every record
        there is (the agents react to each), then let each decider that is ready decide one batch and
        append it, and again, until nothing new is appended. (A live runner folds what has arrived
        before it decides, and folds what arrives while its append is on its way.)"""
        records = self._records
        while True:
            if self._fed < len(records):  # (often nothing new: the decider's outputs were folded already)
                self._fold_new()
            if not self._decide():
                return

    def _fold_new(self) -> None:
        # (Run once per record of the whole simulation: what does not change per record is read once.)
        records = self._records
        state = self.scheduler.state
        cores = self.cores
        agents = self.agents
        sinks = self.sinks
        first = self._fed
        while self._fed < len(records):
            record = records[self._fed]
            self._fed += 1
            event = record.event
            concerned = agents is not None and type(event) not in NOT_FOR_AGENTS
            if concerned:
                job_id = getattr(event, "job", None)
                # (Where the job was matters to the agents only when the event moves it, or ends it.)
                before = agents.nodes_of(state, job_id) if job_id is not None and type(event) in _MOVES else ()  # type: ignore[union-attr]
            for core in cores:
                try:
                    core.fold(record)
                except Exception as exc:
                    raise self._failed(core, record, exc) from exc
            if concerned:
                out, timers = agents.observe(record, state, job_id, before, self.now)  # type: ignore[union-attr]
                for at, kind, payload in timers:
                    self._push(at, kind, payload)
                if out:
                    self._append(out)
        if sinks and self._fed > first:
            fed = records[first:] if first else records
            for sink in sinks:
                sink(fed)
        if not self.keep_log:
            records.clear()
            self._fed = 0

    def _decide(self) -> bool:
        """One batch of every decider that is ready; False if none was. Deciding once per moment, the
        scheduler waits until every other decider has decided on what it folded (its predictions
        are in before the pass that ranks by them)."""
        decided = False
        for core in self.cores:
            if not core.ready():
                continue
            if self.per_moment and core is self.scheduler and self._others and any(c.ready() for c in self._others):
                continue
            decided = True
            try:
                batch = core.next_batch()
            except Exception as exc:
                raise self._failed(core, None, exc) from exc
            if batch:
                outputs = outputs_of(batch)
                self.decisions += len(outputs)
                core.appended(self._append(outputs))
        return decided

    def _failed(self, core: DecisionCore[Any], record: Record | None, exc: Exception) -> SimulationError:
        where = (
            f"record {record.seq} ({type(record.event).__name__} at t={record.event.at:.0f})" if record else "a batch"
        )
        return SimulationError(f"decider {core.decider.name} failed on {where}: {exc!r}")

    def step(self, at: float, events: Sequence[ev.Event] = (), submissions: Sequence[Any] = ()) -> None:
        """At ``at``, ``events`` are appended (in one append) and ``submissions`` reach intake; then
        everything runs until nothing more happens at that moment."""
        self.now = max(self.now, at)
        self._append(list(events))
        for submission in submissions:
            self._submit(submission)
        self._drain()

    def setup(self, events: Iterable[ev.Event], *, at: float = 0.0) -> None:
        """Cluster set-up before the workload: nodes, VCs, the policy. Events get ``at`` and ids."""
        self.now = at
        stamped = []
        for n, event in enumerate(events):
            fields: dict[str, Any] = {"at": at}
            if not event.id:
                fields["id"] = f"sim:setup:{n}"
            if not event.source:
                fields["source"] = "sim"
            stamped.append(msgspec.structs.replace(event, **fields))
        self._append(stamped)
        self._drain()

    def run(
        self,
        submissions: Iterable[Any],
        *,
        on_submit: Callable[[int], None] | None = None,
        until: float | None = None,
    ) -> None:
        """Submit each job (an intake ``Submission``) at its ``at`` and run until every job has ended
        (or ``until``)."""
        with _few_collections():
            self._run(iter(submissions), on_submit, until)

    def _run(self, jobs: Iterator[Any], on_submit: Callable[[int], None] | None, until: float | None) -> None:
        self._next_submission(jobs)
        for n, timer in enumerate(self.timers):
            self._schedule_tick(n, timer)
        while self._heap:
            at, _, kind, payload = heapq.heappop(self._heap)
            if until is not None and at > until:
                break
            self.now = max(self.now, at)
            moment = [(kind, payload)]
            if self.per_moment:  # all that happens at this moment, arrivals included as they come
                if kind == "submit":
                    self._next_submission(jobs)
                while self._heap and self._heap[0][0] <= at:
                    moment.append(heapq.heappop(self._heap)[2:])
                    if moment[-1][0] == "submit":
                        self._next_submission(jobs)
                if len(moment) > 1:
                    moment.sort(key=lambda item: item[0] == "submit")  # tasks end (and timers tick) first
            for kind, payload in moment:
                if kind == "submit":
                    self._submit(payload)
                    if not self.per_moment:
                        self._next_submission(jobs)
                    if on_submit is not None:
                        on_submit(1)
                elif kind == "tick":
                    self._tick(payload)
                elif kind == "due":
                    self._due_tick(payload, at)
                elif self.agents is not None:
                    self._append(self.agents.fire(kind, payload, self.scheduler.state, self.now))
            self._drain()
            for n, timer in enumerate(self.timers):  # a timer that was not needed may be now
                if n not in self._ticking:
                    self._schedule_tick(n, timer)
                if timer.due is not None:
                    self._schedule_due(n, timer)
        if until is None and self._open_jobs():
            raise SimulationError(
                f"{self._open_jobs()} jobs never finished: nothing left to happen while they wait "
                "(jobs no node of the cluster can run; check the cluster spec)"
            )

    def _open_jobs(self) -> int:
        state = self.scheduler.state
        return len(state.queue) + len(state.active)

    def _busy(self) -> bool:
        return self._more_jobs or self._open_jobs() > 0  # (asked after every moment: the cheap test first)

    def _needed(self, timer: Timer) -> bool:
        return self._busy() and (timer.needed is None or timer.needed(self._timer_cores[timer.decider].state))

    def _schedule_tick(self, n: int, timer: Timer) -> None:
        if n not in self._ticking and self._needed(timer):
            self._ticking.add(n)
            at = self.now + timer.every_s
            if timer.on_grid and n in self._last_tick:
                at = self._last_tick[n] + timer.every_s  # (the same sums as an unbroken run of ticks)
                while at <= self.now:
                    at += timer.every_s
            self._push(at, "tick", n)

    def _schedule_due(self, n: int, timer: Timer) -> None:
        """A tick when the timer's decider has a decision due (at once, if that time has come)."""
        assert timer.due is not None
        at = timer.due(self._timer_cores[timer.decider].state)
        if at is None:
            return
        at = max(at, self.now)
        scheduled = self._due_at.get(n)
        if scheduled is not None and scheduled <= at:
            return  # one is on its way, no later than this
        if at == self.now and self._ticked_at.get(n) == self.now:
            return  # it ticked at this moment: what it decided is folded, nothing more is due now
        self._due_at[n] = at
        self._push(at, "due", n)

    def _due_tick(self, n: int, at: float) -> None:
        if self._due_at.get(n) != at:
            return  # replaced by an earlier one
        del self._due_at[n]
        if self._ticked_at.get(n) != self.now:  # (its periodic tick at this moment does the same)
            self._append([self._tick_event(self.timers[n])])
            self._ticked_at[n] = self.now

    def _tick(self, n: int) -> None:
        self._ticking.discard(n)
        timer = self.timers[n]
        self._last_tick[n] = self.now
        if not self._needed(timer):
            return  # nothing left for it to do: it stops ticking
        if self._ticked_at.get(n) != self.now:
            self._append([self._tick_event(timer)])
            self._ticked_at[n] = self.now
        self._schedule_tick(n, timer)

    def _tick_event(self, timer: Timer) -> ev.Event:
        if timer.kind is ev.ClockTicked:
            tick: ev.Event = ev.ClockTicked(
                id=f"{timer.decider}:tick:{self.now:.3f}",
                at=self.now,
                source=timer.decider,
                last_heard={},
                lost_after_s=ev.TICK_ONLY_TIMEOUT_S,
            )
        else:
            tick = timer.kind(id=f"{timer.decider}:tick:{self.now:.3f}", at=self.now, source=timer.decider)
        return tick

    def _next_submission(self, jobs: Iterator[Any]) -> None:
        job = next(jobs, None)
        self._more_jobs = job is not None
        if job is not None:
            self._push(max(job.at, self.now), "submit", job)

    def _submit(self, submission: Any) -> None:
        self.submitted += 1
        self.scheduler.offer(msgspec.structs.replace(submission, at=self.now))

    # -- results ---------------------------------------------------------------------------------

    @property
    def rejected(self) -> int:
        return self.scheduler.state.rejected

    @property
    def records(self) -> Sequence[Record]:
        """The log (empty when the simulation keeps none: see ``sinks``)."""
        return self._records if self.keep_log else ()

    def state_of(self, name: str) -> Any:
        for core in self.cores:
            if core.decider.name == name:
                return core.state
        raise KeyError(f"no decider named {name!r} in this simulation")
