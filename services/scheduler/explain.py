"""The scheduler's queue, explained by its own code: its fold, its pass and its forecast (what
``gpuherd why`` says), for readers that show it (the dashboard gets it through this service's spec;
services never import each other)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.explain import QueueAnswer, Waiting
from gpuherd.fold import TERMINAL, JobState
from gpuherd.log import Record
from services.scheduler.decide import SchedulerDecider
from services.scheduler.forecast import forecast_starts
from services.scheduler.policy import Policy, make_policy
from services.scheduler.state import SchedulerState

FORECAST_EVERY_S = 2.0  # a forecast runs the policy forward: at most this often while the log moves
PLAN_EVERY_S = 0.5  # the pass that explains the queue: at most this often (pages follow within a second)
NEXT_PASS = "next pass"  # the kind of a waiting job the next pass places (``gpuherd why``'s words below)
NEXT_PASS_WHY = "nothing holds it back: it is placed on the scheduler's next pass"


class Forecast(msgspec.Struct):
    """Estimated starts, made at log position ``seq`` (``at``: monotonic seconds) for the jobs in
    ``covers`` (those with no start have no forecast)."""

    seq: int
    at: float
    starts: dict[str, float]
    covers: set[str]


class SchedulerQueue:
    """The scheduler's own state, folded by its own fold, explained by its own pass."""

    def __init__(self) -> None:
        self.decider = SchedulerDecider(make_policy("fifo"))
        self.state = self.decider.initial_state()
        self._forecast = Forecast(seq=-1, at=-FORECAST_EVERY_S, starts={}, covers=set())
        self._rows: tuple[int, list[Waiting]] | None = None  # (log position, the pass's rows)
        self._answer: tuple[float, QueueAnswer] | None = None  # (when, answer)

    def fold(self, seq: int, event: ev.Event) -> None:
        self.state = self.decider.evolve(self.state, seq, event)

    def explain(self) -> QueueAnswer:
        """The queue explained; while the log moves fast, the last answer for up to PLAN_EVERY_S (a
        pass over thousands of waiting jobs costs what a page refresh should not, ten times a second).
        The answer's ``seq`` says which log position it is for: a reused one is older than the log,
        and a reader asks again."""
        now = time.monotonic()
        if self._answer is not None:
            at, answer = self._answer
            if answer.seq == self.state.seq or now - at < PLAN_EVERY_S:
                return answer
        answer = self._explain(now)
        self._answer = (now, answer)
        return answer

    def _explain(self, now: float) -> QueueAnswer:
        state = self.state
        policy = self.decider.policy_for(state)
        fair = {key.removeprefix("vc:"): state.past_usage(key) for key in state.usage if key.startswith("vc:")}
        if not state.queue:
            return QueueAnswer(policy=policy.name, waiting=[], fair_share=fair, seq=state.seq)
        if self._rows is None or self._rows[0] != state.seq:  # (only the forecast may be older: not again)
            self._rows = (state.seq, self._pass_rows(state, policy))
        forecast = self._forecast_for(state, policy, now)
        starts = forecast.starts
        rows = [msgspec.structs.replace(w, estimated_start=starts.get(w.job)) for w in self._rows[1]]
        return QueueAnswer(policy=policy.name, waiting=rows, fair_share=fair, seq=forecast.seq)

    def _pass_rows(self, state: SchedulerState, policy: Policy) -> list[Waiting]:
        """Every waiting job in the policy's order: why it waits, or that the next pass places it
        (the scheduler is down, or has not made that pass yet)."""
        result = self.decider.plan(state)
        rows = [Waiting(job, p.position, p.kind, p.detail) for job, p in result.pending.items()]
        # The pass numbers every waiting job; those it places take the positions the others left.
        taken = {w.position for w in rows}
        free = (n for n in itertools.count(1) if n not in taken)
        placed = list(policy.order(state, [p.job for p in result.placed])) if result.placed else []
        rows += [Waiting(job.job, next(free), NEXT_PASS, NEXT_PASS_WHY) for job in placed]
        return sorted(rows, key=lambda w: w.position)

    def _forecast_for(self, state: SchedulerState, policy: Policy, now: float) -> Forecast:
        """The forecast, made again once FORECAST_EVERY_S passed since the last one (if the log moved
        since). Meanwhile a waiting job the last one was not asked about (submitted or requeued since)
        is forecast now, on the state as it is: it has an estimate at once, not None until the next one."""
        forecast = self._forecast
        if forecast.seq != state.seq and now - forecast.at >= FORECAST_EVERY_S:
            starts = forecast_starts(state, policy)
            forecast = self._forecast = Forecast(seq=state.seq, at=now, starts=starts, covers=set(state.queue))
            return forecast
        uncovered = [job for job in state.queue if job not in forecast.covers]
        if uncovered:
            forecast.starts |= forecast_starts(state, policy, uncovered)
            forecast.covers.update(uncovered)
        return forecast


# -- why a job waited: its waits, replayed ----------------------------------------------------------

MAX_PASSES_REPLAYED = 400  # per wait: a longer one is sampled evenly (each pass costs what a scheduling pass does)


class WaitSpan(msgspec.Struct, frozen=True):
    """A stretch of a wait during which the scheduler's pass gave one reason (``kind``); ``detail``
    is what it said first, ``last_detail`` what it said last (counts and names move within a kind)."""

    start: float
    end: float
    kind: str
    detail: str
    last_detail: str
    passes: int


class Wait(msgspec.Struct, frozen=True):
    """One time a job waited: from its submission (or requeue) until it was placed, or ended unplaced
    (``ended_by``: how; ``placed_by``: the placement decision and what it was decided on)."""

    since: float
    until: float | None  # None: it waits still
    attempt: int
    ended_by: str
    spans: list[WaitSpan]
    passes_replayed: int
    passes_in_wait: int  # the passes the scheduler could have made (more than replayed: sampled)
    placed_by: str = ""


class WaitWindow(msgspec.Struct):
    """Where in the log one wait of a job lies: from the record that made it wait (``first``, its
    submission or a requeue) up to the record that ended the wait (``end``, a placement or an end;
    None: the log ends while it waits). ``passes``: the records in it the scheduler decides on;
    ``cause``: the id of the event the placement that ended it was decided on."""

    first: int
    end: int | None = None
    passes: int = 0
    cause: str = ""


class WaitFinder:
    """The first of the two reads ``gpuherd why`` makes of the log: each wait of ``job``, found a
    record at a time (``see``) without folding anything; ``windows`` once the log is read."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.windows: list[WaitWindow] = []
        self._current: WaitWindow | None = None
        self._follows = SchedulerDecider(make_policy("fifo")).follows

    def see(self, record: Record) -> None:
        event = record.event
        current = self._current
        if getattr(event, "job", None) == self.job:
            kind = type(event)
            if current is None and kind in (ev.JobSubmitted, ev.JobRequeued):
                current = self._current = WaitWindow(first=record.seq)
                self.windows.append(current)
            elif current is not None and kind in (ev.JobPlaced, ev.JobFinished):
                current.end, current.cause = record.seq, getattr(event, "cause", "")
                self._current = None
                return
        if current is not None:
            current.passes += self._follows(event)


def waiting_windows(records: Iterable[Record], job: str) -> list[WaitWindow]:
    """Each wait of ``job`` in ``records`` (``WaitFinder``)."""
    finder = WaitFinder(job)
    for record in records:
        finder.see(record)
    return finder.windows


class WaitReplay:
    """The second read: the log folded by the scheduler's own fold, a record at a time, with its
    pass replayed on the state after each record it would have decided on while ``job`` waited
    (``MAX_PASSES_REPLAYED`` of them, evenly spread, for a longer wait). ``state`` is the
    scheduler's state so far; ``job_state`` the job as last seen (kept once it ended, which the
    scheduler's state forgets). ``replay_passes`` False: fold only (the waits have no reasons)."""

    def __init__(self, job: str, windows: list[WaitWindow], *, replay_passes: bool = True) -> None:
        self.job = job
        self.decider = SchedulerDecider(make_policy("fifo"))
        self.state: SchedulerState = self.decider.initial_state()
        self.job_state: JobState | None = None
        self._windows = iter(windows)
        self._current = next(self._windows, None)
        self._replay = replay_passes
        self._causes = {w.cause for w in windows if w.cause}
        self._described: dict[str, str] = {}  # cause id -> the event in a few words
        self._waits: list[Wait] = []
        self._start_wait()

    def _start_wait(self) -> None:
        self._spans: list[WaitSpan] = []
        self._since, self._attempt, self._passes, self._possible = 0.0, 0, 0, 0
        window = self._current
        if window is None or window.passes <= MAX_PASSES_REPLAYED:
            self._sampled: set[int] | None = None  # every pass
        else:
            step = window.passes / MAX_PASSES_REPLAYED
            self._sampled = {int(n * step) for n in range(MAX_PASSES_REPLAYED - 1)} | {window.passes - 1}

    def fold(self, record: Record) -> None:
        event, seq, job = record.event, record.seq, self.job
        state = self.state = self.decider.evolve(self.state, seq, event)
        if getattr(event, "job", None) == job and (self.job_state is None or self.job_state.status not in TERMINAL):
            # (An end updates it, then drops it from the state. Once it ended it stays as it ended,
            # as the core fold holds it: a later submission under its id is no job of its.)
            self.job_state = state.jobs.get(job, self.job_state)
        if event.id in self._causes:
            self._described[event.id] = _described(event)
        window = self._current
        if window is None or seq < window.first:
            return
        if seq == window.first:
            self._since = event.at
            self._attempt = state.jobs[job].attempt if job in state.jobs else 0
        if window.end is None or seq < window.end:
            if self.decider.follows(event):
                ordinal = self._possible
                self._possible += 1
                if self._replay and (self._sampled is None or ordinal in self._sampled):
                    self._passes += 1
                    self._spans = _with_pass(self._spans, self.decider.plan(state), job, event.at)
            return
        self._waits.append(self._ended_wait(event, ended=True))
        self._current = next(self._windows, None)
        self._start_wait()

    def waits(self) -> list[Wait]:
        """The job's waits, the one it is in at the log's end (so far) included."""
        if self._current is None:
            return self._waits
        return [*self._waits, self._ended_wait(None, ended=False)]

    def _ended_wait(self, event: ev.Event | None, *, ended: bool) -> Wait:
        """The wait that ``event`` ended (``ended``), or that goes on at the log's end."""
        since, attempt, spans, passes, possible = self._since, self._attempt, self._spans, self._passes, self._possible
        if not ended or event is None:
            return Wait(since, None, attempt, "still waiting at the log's end", list(spans), passes, possible)
        if spans:
            spans[-1] = msgspec.structs.replace(spans[-1], end=event.at)
        if isinstance(event, ev.JobPlaced):
            nodes = ", ".join(dict.fromkeys(a.node for a in event.allocations))
            cause = self._described.get(event.cause)
            why = f" on {cause}" if cause is not None else ""
            placed_by = f"{event.id}, decided{why} (log position {event.based_on})"
            return Wait(since, event.at, attempt, f"placed on {nodes}", spans, passes, possible, placed_by)
        outcome = getattr(event, "outcome", "ended")
        reason = getattr(event, "reason", "")
        how = f"{outcome} without being placed" + (f": {reason}" if reason else "")
        return Wait(since, event.at, attempt, how, spans, passes, possible)


def wait_history(records: Sequence[Record], job: str, progress: Callable[[int], None] | None = None) -> list[Wait]:
    """Every wait of ``job`` in ``records``, each explained by the scheduler's own pass replayed on
    the state of the log as the scheduler folded it (``WaitReplay``): why the job waited, when, and
    what finally placed it. ``progress`` is told the records folded so far."""
    windows = waiting_windows(records, job)
    if not windows:
        return []
    replay = WaitReplay(job, windows)
    for i, record in enumerate(records):
        replay.fold(record)
        if progress is not None and i % 1000 == 0:
            progress(i)
    return replay.waits()


def _with_pass(spans: list[WaitSpan], plan: Any, job: str, at: float) -> list[WaitSpan]:
    pending = plan.pending.get(job)
    if pending is not None:
        kind, detail = pending.kind, pending.detail
    elif any(p.job == job for p in plan.placed):
        kind, detail = NEXT_PASS, NEXT_PASS_WHY
    else:
        return spans  # (not waiting at this state: it had ended, or was not yet queued)
    if spans and spans[-1].kind == kind:
        last = spans[-1]
        spans[-1] = msgspec.structs.replace(last, end=at, last_detail=detail, passes=last.passes + 1)
    else:
        if spans:
            spans[-1] = msgspec.structs.replace(spans[-1], end=at)
        spans.append(WaitSpan(start=at, end=at, kind=kind, detail=detail, last_detail=detail, passes=1))
    return spans


def _described(event: ev.Event) -> str:
    """An event in a few words: its type, and what it is about."""
    about = getattr(event, "job", None) or getattr(event, "node", None)
    return f"{type(event).__name__} of {about}" if about else type(event).__name__
