"""Online job-duration prediction from the history of finished jobs (Helios' QSSF input).

The model learns as jobs finish, from what a submission says about a job:
user, job name, VC and GPU count. Public traces often lack some of these
(``philly.csv`` has neither user nor name; ITP has no VC), so features are
used as a back-off ladder, most specific first:

    user+name  ->  user+gpus  ->  vc+gpus  ->  vc  ->  gpus  ->  all

The prediction is the median of the last ``window`` durations seen under the
first key with at least ``min_samples`` of them, taken in log space (durations
span seconds to months; the median is robust to the long tail). Recent jobs
weigh by being in the window: repeated runs of one experiment, the common
case in DL clusters, are what the user+name key catches when a trace has it.

Why not a GBDT (LightGBM, as in Helios)? The model must learn after every
finished job inside a pure decider (deterministic, replayable, cheap enough
for 82k-job simulations); a median over a back-off ladder updates in O(1)
and, on the features these traces have, a tree model has little more to
split on. ``evaluate`` reports the accuracy this gets on any trace.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import numpy as np
import pandas as pd

MODEL_NAME = "backoff-median"


# What a trace records for a user or a job name it does not have (intake needs both to be given).
UNKNOWN = "-"


class Features(msgspec.Struct, frozen=True):
    vc: str
    gpus: int
    user: str = ""
    name: str = ""

    def ladder(self) -> list[tuple[str, str]]:
        """(ladder level, history key), most specific first; levels whose features are absent (or
        ``UNKNOWN``) are skipped."""
        out = []
        user = self.user if self.user != UNKNOWN else ""
        name = self.name if self.name != UNKNOWN else ""
        if user and name:
            out.append(("user+name", f"un|{self.user}|{self.name}"))
        if user:
            out.append(("user+gpus", f"ug|{self.user}|{self.gpus}"))
        out.append(("vc+gpus", f"vg|{self.vc}|{self.gpus}"))
        out.append(("vc", f"v|{self.vc}"))
        out.append(("gpus", f"g|{self.gpus}"))
        out.append(("all", "all"))
        return out


class Prediction(msgspec.Struct, frozen=True):
    seconds: float
    basis: str  # the ladder level and how many jobs it rests on


class DurationModel(msgspec.Struct, kw_only=True):
    """The learned history (part of the analytics decider's state, so it snapshots and replays)."""

    window: int = 32
    min_samples: int = 3
    default_s: float = 3600.0  # before anything has finished
    history: dict[str, list[float]] = msgspec.field(default_factory=dict)  # key -> recent log(seconds)
    observed: int = 0

    def observe(self, features: Features, seconds: float) -> None:
        value = math.log(max(seconds, 1.0))
        for _, key in features.ladder():
            recent = self.history.setdefault(key, [])
            recent.append(value)
            if len(recent) > self.window:
                del recent[0]
        self.observed += 1

    def predict(self, features: Features) -> Prediction:
        for level, key in features.ladder():
            recent = self.history.get(key)
            if recent is not None and len(recent) >= self.min_samples:
                seconds = math.exp(statistics.median(recent))
                return Prediction(seconds=round(seconds, 1), basis=f"{level}: last {len(recent)} jobs")
        return Prediction(seconds=self.default_s, basis="default: no history yet")


# -- accuracy on a trace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Accuracy:
    jobs: int
    mae_s: float
    median_relative_error: float
    within_2x: float  # share of predictions within a factor of two of the truth
    by_basis: dict[str, int]

    def row(self) -> dict[str, float | int]:
        return {
            "jobs": self.jobs,
            "MAE (s)": round(self.mae_s),
            "median rel. error": round(self.median_relative_error, 3),
            "within 2x": round(self.within_2x, 3),
        }


def features_of(row: object) -> Features:
    def text(value: object) -> str:
        return "" if value is None or pd.isna(value) else str(value)

    return Features(
        vc=text(getattr(row, "vc", "")) or "default",
        gpus=int(getattr(row, "gpus", 1)),
        user=text(getattr(row, "user", "")),
        name=text(getattr(row, "name", "")),
    )


def evaluate(jobs: pd.DataFrame, model: DurationModel | None = None) -> tuple[Accuracy, np.ndarray]:
    """Predict every job at its submission from the jobs that had *finished* by then (a
    time-ordered split: the model never sees the future), learning as they finish.

    A job's finish is its recorded end time, else submit + queue + duration, else (no queueing
    recorded, as in ``philly.csv``) submit + duration: the earliest it could have finished, so
    with unknown queueing the model may learn from a job slightly before it really finished.
    Returns the accuracy and the predictions (in the table's row order)."""
    model = model or DurationModel()
    ends = jobs["end_time"].to_numpy(dtype="float64", na_value=np.nan)
    queue = jobs["queue"].fillna(0.0).to_numpy(dtype="float64")
    submit = jobs["submit_time"].to_numpy(dtype="float64")
    duration = jobs["duration"].to_numpy(dtype="float64")
    finish = np.where(np.isfinite(ends), ends, submit + queue + duration)
    order = np.argsort(submit, kind="stable")
    rows = list(jobs.itertuples(index=False))
    feats = [features_of(r) for r in rows]
    predicted = np.empty(len(rows))
    bases: dict[str, int] = {}
    finished: list[tuple[float, int]] = []  # (finish time, row) of submitted jobs not yet learned
    for i in order:
        while finished and finished[0][0] <= submit[i]:
            _, j = heapq.heappop(finished)
            model.observe(feats[j], duration[j])
        guess = model.predict(feats[i])
        predicted[i] = guess.seconds
        level = guess.basis.split(":")[0]
        bases[level] = bases.get(level, 0) + 1
        heapq.heappush(finished, (finish[i], int(i)))
    return accuracy(predicted, duration, bases), predicted


def accuracy(predicted: np.ndarray, actual: np.ndarray, by_basis: dict[str, int] | None = None) -> Accuracy:
    actual = np.maximum(actual, 1.0)
    error = np.abs(predicted - actual)
    ratio = np.maximum(predicted / actual, actual / np.maximum(predicted, 1e-9))
    return Accuracy(
        jobs=len(actual),
        mae_s=float(error.mean()) if len(actual) else math.nan,
        median_relative_error=float(np.median(error / actual)) if len(actual) else math.nan,
        within_2x=float((ratio <= 2.0).mean()) if len(actual) else math.nan,
        by_basis=dict(by_basis or {}),
    )


def constant_baseline(jobs: pd.DataFrame, values: Iterable[float] | None = None) -> Accuracy:
    """The accuracy of always predicting the trace's overall median (a yardstick for the model)."""
    duration = jobs["duration"].to_numpy(dtype="float64")
    guess = float(np.median(duration)) if values is None else float(np.median(list(values)))
    return accuracy(np.full(len(duration), guess), duration)
