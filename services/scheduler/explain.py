"""The scheduler's queue, explained by its own code: its fold, its pass and its forecast (what
``gpuherd why`` says), for readers that show it (the dashboard gets it through this service's spec;
services never import each other)."""

from __future__ import annotations

import itertools
import time

import msgspec

from gpuherd import events as ev
from gpuherd.explain import QueueAnswer, Waiting
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
