"""The analytics decider: duration predictions and cluster energy saving, from the log alone.

State (``state.py``): the core fold, the duration model, and the CES demand history. All of them
change only in ``evolve``, so a replay rebuilds them exactly.

- ``JobSubmitted`` -> ``JobDurationPredicted``: the prediction the fold made when it folded the
  submission (the model as it stood: it had learned from every job finished before this
  submission, never from the future).
- ``JobFinished`` -> the model learned the job's run time (GPU-seconds / GPUs over all its
  attempts) in the fold, if it ran at all; its burst-mates that have not ended are predicted
  again (``JobDurationPredicted``) where what it taught moves their prediction by more than
  ``REVISE_LOG`` (about 22%) or their spread by more than ``REVISE_SIGMA``.
- ``AnalyticsTicked`` (its timer, with CES on) -> samples demand, forecasts its peak, and powers
  idle nodes down (``NodePowerDownRequested``) or powered-down nodes up (``NodePowerUpRequested``).
  The scheduler also wakes nodes when jobs wait for GPUs that only powered-down nodes have
  (``NodeWakeRequested``); the agents carry out both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gpuherd import events as ev
from gpuherd.fold import TERMINAL
from gpuherd.runtime.decider import Decider
from services.analytics.ces import CesParams, forecast_peak, plan_power
from services.analytics.predict import MODEL_NAME, DurationModel, Prediction
from services.analytics.state import AnalyticsState, evolve

REVISE_LOG = 0.2  # a revision is recorded when it moves the median by more than this (log seconds)
REVISE_SIGMA = 0.25  # ... or the spread by more than this


class AnalyticsDecider(Decider[AnalyticsState]):
    name = "analytics"
    # 3: the duration model of trees, bursts and spreads; predictions made in the fold. 4: its bursts
    # keep their open jobs grouped by what a revision of them depends on. 5: a submission's training row
    # holds the gap since its key's previous submission (4's rows held NaN: a refold learns otherwise)
    STATE_FORMAT = 5
    FOLLOWS = frozenset({ev.JobSubmitted, ev.JobFinished, ev.AnalyticsTicked})
    EMITS = frozenset({ev.JobDurationPredicted, ev.NodePowerDownRequested, ev.NodePowerUpRequested, ev.AnalyticsTicked})

    def __init__(
        self,
        *,
        predict: bool = True,
        ces: CesParams | None = None,
        estimates: Mapping[str, float] | None = None,
        model: Mapping[str, Any] | None = None,
        learn: bool = True,
    ) -> None:
        self.predict = predict
        self.model = dict(model or {})  # the duration model's settings (``DurationModel``'s fields)
        DurationModel(**self.model)  # (an unknown setting fails here, not at the first event)
        self.ces = ces  # None: no energy saving
        # Given estimates (intake id -> seconds), e.g. another system's, instead of the model's:
        # a job without one gets the model's prediction.
        self.estimates = estimates
        # False (only with estimates): the duration model is neither trained nor asked, and a job
        # without an estimate gets no prediction. A simulation whose every job has an estimate runs
        # so: the model's predictions would all go unused (the same log, without the model's cost).
        if not learn and estimates is None:
            raise ValueError("learn=False needs estimates: without them nothing would be predicted")
        self.learn = learn

    def follows(self, event: ev.Event) -> bool:
        kind = type(event)
        if kind is ev.JobFinished:
            return self.predict and self.learn  # (a revision is the model's)
        return (kind is ev.JobSubmitted and self.predict) or (kind is ev.AnalyticsTicked and self.ces is not None)

    def initial_state(self) -> AnalyticsState:
        return AnalyticsState(retain_finished=False, model=DurationModel(**self.model))

    def state_type(self) -> type[AnalyticsState]:
        return AnalyticsState

    def evolve(self, state: AnalyticsState, seq: int, event: ev.Event) -> AnalyticsState:
        return evolve(state, seq, event, self.ces, predict=self.predict and self.learn)

    def independent(self, event: ev.Event) -> str | None:
        # A prediction reads the model and the job alone.
        return event.job if type(event) is ev.JobSubmitted else None

    def decide(self, state: AnalyticsState, event: ev.Event) -> list[ev.Event]:
        if isinstance(event, ev.JobSubmitted) and self.predict:
            job = state.jobs.get(event.job)
            # The job may be placed by the time this is decided (a runner decides on all it has
            # folded): it is still forecast, as long as it has not ended.
            if job is None or job.status in TERMINAL or event.job in state.predicted:
                return []
            given = self.estimates.get(job.spec.intake_id or "") if self.estimates is not None else None
            if given is not None:
                return [ev.JobDurationPredicted(job=event.job, seconds=given, model="given", basis="estimates file")]
            guess = state.fresh.get(event.job)
            return [] if guess is None else [_predicted(event.job, guess)]
        if isinstance(event, ev.JobFinished) and self.predict:
            jobs, estimates = state.jobs, self.estimates
            revised = [
                (jobs[mate], guess)
                for mate, guess in state.model.revisions(event.job, _moved).items()
                if mate in jobs and jobs[mate].status not in TERMINAL
                and (estimates is None or jobs[mate].spec.intake_id not in estimates)  # (given: never revised)
            ]  # fmt: skip
            revised.sort(key=lambda pair: pair[0].order)  # in submission order
            return [_predicted(job.job, guess) for job, guess in revised]
        if isinstance(event, ev.AnalyticsTicked) and self.ces is not None:
            return self._power(state, event.at)
        return []

    def _power(self, state: AnalyticsState, now: float) -> list[ev.Event]:
        params = self.ces
        assert params is not None
        nodes = [n for n in state.nodes.values() if n.status == "up"]
        powered = [n for n in nodes if n.power in ("on", "booting")]
        forecast = forecast_peak(state.demand, now, params)
        plan = plan_power(len(powered), len(nodes), forecast, now, state.last_power_down_at, params)
        reason = f"forecast peak {forecast} nodes + buffer {params.buffer_nodes}; {len(powered)} powered"
        if plan.down:
            idle = sorted((n for n in nodes if n.power == "on" and not n.busy()), key=lambda n: n.node, reverse=True)
            return [ev.NodePowerDownRequested(node=n.node, reason=reason) for n in idle[: plan.down]]
        if plan.up:
            asleep = sorted((n for n in nodes if n.power in ("draining", "off")), key=lambda n: (n.power, n.node))
            return [ev.NodePowerUpRequested(node=n.node, reason=reason) for n in asleep[: plan.up]]
        return []


def _predicted(job: str, guess: Prediction) -> ev.JobDurationPredicted:
    return ev.JobDurationPredicted(
        job=job,
        seconds=guess.seconds,
        model=MODEL_NAME,
        basis=guess.basis,
        sigma=guess.sigma,
        user_history=guess.user_history,
        version=guess.version,
        features=guess.digest,
    )


def _moved(before: tuple[float, float], seconds: float, sigma: float) -> bool:
    """Whether a revision is worth recording: it moves the prediction in force enough."""
    old_seconds, old_sigma = before
    return (
        abs(math.log(max(seconds, 1.0) / max(old_seconds, 1.0))) > REVISE_LOG or abs(sigma - old_sigma) > REVISE_SIGMA
    )
