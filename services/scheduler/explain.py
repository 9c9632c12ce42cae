"""The scheduler's queue, explained by its own code: its fold, its pass and its forecast (what
``gpuherd why`` says), for readers that show it (the dashboard gets it through this service's spec;
services never import each other)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.explain import QueueAnswer, Waiting
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


def wait_history(records: list[Record], job: str, progress: Callable[[int], None] | None = None) -> list[Wait]:
    """Every wait of ``job`` in the log, each explained by the scheduler's own pass replayed on the
    state of the log as the scheduler folded it, after each record it would have decided on while
    the job waited (``MAX_PASSES_REPLAYED`` of them, evenly spread, for a longer wait): why the job
    waited, when, and what finally placed it. ``progress`` is told the records folded so far."""
    decider = SchedulerDecider(make_policy("fifo"))
    windows = _waiting_windows(records, job)
    if not windows:
        return []
    replayed: set[int] = set()
    for first, last in windows:  # (records first..last, as positions in ``records``)
        candidates = [i for i in range(first, last + 1) if decider.follows(records[i].event)]
        if len(candidates) > MAX_PASSES_REPLAYED:
            step = len(candidates) / MAX_PASSES_REPLAYED
            candidates = [candidates[int(n * step)] for n in range(MAX_PASSES_REPLAYED - 1)] + [candidates[-1]]
        replayed.update(candidates)
    # The causes of the placements that ended a wait, by id (what each was decided on).
    causes = {getattr(records[last + 1].event, "cause", "") for _, last in windows if last + 1 < len(records)}
    by_id = {r.event.id: r for r in records if r.event.id in causes}
    state = decider.initial_state()
    waits: list[Wait] = []
    spans: list[WaitSpan] = []
    window = iter(windows)
    current = next(window, None)
    since, attempt, passes, possible = 0.0, 0, 0, 0
    for i, record in enumerate(records):
        state = decider.evolve(state, record.seq, record.event)
        if progress is not None and i % 1000 == 0:
            progress(i)
        if current is None:
            break
        first, last = current
        if i == first:
            spans, passes, possible = [], 0, 0
            since, attempt = record.event.at, state.jobs[job].attempt if job in state.jobs else 0
        if first <= i <= last:
            possible += decider.follows(record.event)
            if i in replayed:
                passes += 1
                spans = _with_pass(spans, decider.plan(state), job, record.event.at)
        if i == last + 1:
            waits.append(_ended_wait(since, attempt, spans, passes, possible, record, job, by_id, ended=True))
            current = next(window, None)
    if current is not None:  # the log ends while it waits
        waits.append(_ended_wait(since, attempt, spans, passes, possible, records[-1], job, by_id, ended=False))
    return waits


def _waiting_windows(records: list[Record], job: str) -> list[tuple[int, int]]:
    """The positions in ``records`` of each wait of ``job``: from the record that made it wait (its
    submission, a requeue) to the record before the one that ended the wait (a placement, an end)."""
    windows: list[tuple[int, int]] = []
    start: int | None = None
    for i, record in enumerate(records):
        event = record.event
        if getattr(event, "job", None) != job:
            continue
        kind = type(event)
        if kind in (ev.JobSubmitted, ev.JobRequeued) and start is None:
            start = i
        elif start is not None and kind in (ev.JobPlaced, ev.JobFinished):
            windows.append((start, i - 1))
            start = None
    if start is not None:
        windows.append((start, len(records) - 1))
    return windows


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


def _ended_wait(
    since: float,
    attempt: int,
    spans: list[WaitSpan],
    passes: int,
    possible: int,
    record: Record,
    job: str,
    by_id: dict[str, Record],
    *,
    ended: bool,
) -> Wait:
    """The wait that ``record`` ended (``ended``), or that goes on at the log's end."""
    event = record.event
    if not ended:
        return Wait(since, None, attempt, "still waiting at the log's end", spans, passes, possible)
    if spans:
        spans[-1] = msgspec.structs.replace(spans[-1], end=event.at)
    if isinstance(event, ev.JobPlaced):
        nodes = ", ".join(dict.fromkeys(a.node for a in event.allocations))
        cause = by_id.get(event.cause)
        why = f" on {_described(cause.event)}" if cause is not None else ""
        placed_by = f"{event.id}, decided{why} (log position {event.based_on})"
        return Wait(since, event.at, attempt, f"placed on {nodes}", spans, passes, possible, placed_by)
    outcome = getattr(event, "outcome", "ended")
    reason = getattr(event, "reason", "")
    how = f"{outcome} without being placed" + (f": {reason}" if reason else "")
    return Wait(since, event.at, attempt, how, spans, passes, possible)


def _described(event: ev.Event) -> str:
    """An event in a few words: its type, and what it is about."""
    about = getattr(event, "job", None) or getattr(event, "node", None)
    return f"{type(event).__name__} of {about}" if about else type(event).__name__
