"""The scheduler's queue, explained by its own code: its fold, its pass and its forecast (what
``gpuherd why`` says), for readers that show it (the dashboard gets it through this service's spec;
services never import each other)."""

from __future__ import annotations

import time

from gpuherd import events as ev
from gpuherd.explain import QueueAnswer, Waiting
from services.scheduler.decide import SchedulerDecider
from services.scheduler.forecast import forecast_starts
from services.scheduler.policy import make_policy

FORECAST_EVERY_S = 2.0  # a forecast runs the policy forward: at most this often while the log moves
PLAN_EVERY_S = 0.5  # the pass that explains the queue: at most this often (pages follow within a second)


class SchedulerQueue:
    """The scheduler's own state, folded by its own fold, explained by its own pass."""

    def __init__(self) -> None:
        self.decider = SchedulerDecider(make_policy("fifo"))
        self.state = self.decider.initial_state()
        self._forecast: dict[str, float] = {}
        self._forecast_at = -FORECAST_EVERY_S
        self._answer: tuple[float, QueueAnswer] | None = None  # (when, answer)

    def fold(self, seq: int, event: ev.Event) -> None:
        self.state = self.decider.evolve(self.state, seq, event)

    def explain(self) -> QueueAnswer:
        """The queue explained; while the log moves fast, the last answer for up to PLAN_EVERY_S (a
        pass over thousands of waiting jobs costs what a page refresh should not, ten times a second).
        (The view asks again only after the log moved.)"""
        now = time.monotonic()
        if self._answer is not None and now - self._answer[0] < PLAN_EVERY_S:
            return self._answer[1]
        answer = self._explain()
        self._answer = (now, answer)
        return answer

    def _explain(self) -> QueueAnswer:
        state = self.state
        policy = self.decider.policy_for(state)
        fair = {key.removeprefix("vc:"): state.past_usage(key) for key in state.usage if key.startswith("vc:")}
        if not state.queue:
            return QueueAnswer(policy=policy.name, waiting=[], fair_share=fair)
        pending = self.decider.plan(state).pending
        if time.monotonic() - self._forecast_at >= FORECAST_EVERY_S:
            self._forecast = forecast_starts(state, policy)
            self._forecast_at = time.monotonic()
        starts = self._forecast
        rows = sorted(
            (Waiting(job, p.position, p.kind, p.detail, starts.get(job)) for job, p in pending.items()),
            key=lambda w: w.position,
        )
        return QueueAnswer(policy=policy.name, waiting=rows, fair_share=fair)
