"""Online job-duration prediction from the history of finished jobs (Helios' QSSF input).

What a submission says about a job (user, name, VC, GPUs, nodes, the time it came) is turned into
a feature vector made of the history the model has folded so far, and a gradient-boosted tree model
(LightGBM), refitted in batches inside the fold, maps it to a log-duration. Between refits the
features themselves are the cheap online layer: they move with every finished job.

Features (``FEATURES``; NaN where a trace does not have it):

- the job: log2 GPUs, nodes, hour of day and day of week of its submission;
- for each history key (``user+name``, ``user+gpus``, ``user``, ``vc+gpus``, ``vc``, ``gpus``,
  ``all``): the median, spread and last value of the log-durations of its last ``window``
  finished jobs, and how many there were. Traces without users or names (``philly.csv``, ITP)
  keep the keys they have;
- its *burst*: jobs of the same (user, VC, GPUs) submitted within ``burst_gap_s`` of each other
  (a sweep, a resubmission): its place in the burst, the burst's age, the gap since the previous
  submission of that key, and the previous burst's size and median finished duration.

What it predicts is a log-normal: ``mu`` (log seconds) and ``sigma``, the spread of the model's
own out-of-sample errors (each job's error at its submission, learned when it finishes), so a
scheduler can rank by any quantile (``Prediction.quantile``). When jobs of a burst finish, the
prediction of their burst-mates that have not ended is revised (``revise``): a normal-normal update
of ``mu`` with the finished mates' median, weighted by the within-burst spread learned online.

Learning happens only in ``observe`` (a job finished) and ``refit`` (every ``refit_every``
finished jobs, at most ``train_window`` of the latest), both called from the analytics decider's
fold: the model knows only jobs that finished before the prediction it makes (``evaluate`` holds
trace replays to the same rule), and the same log refolds the same model, bit for bit
(LightGBM single-threaded, deterministic, seeded). ``version`` counts refits and goes into each
``JobDurationPredicted`` with a digest of the feature vector, so an audit can re-derive it.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import statistics
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np

from gpuherd.fold import oldest_first
from gpuherd.stats import quantile_s

if TYPE_CHECKING:
    import pandas as pd

MODEL_NAME = "history-gbdt"
# What a trace records for a user or a job name it does not have (intake needs both to be given).
UNKNOWN = "-"
# Times above this are seconds since the Unix epoch (1973 on); below it, offsets from a trace's start
# (ITP, Alibaba: simulated from 0), which have no date or time of day.
CALENDAR_TIME_FROM_S = 1e8

KEYS = ("user+name", "user+gpus", "user", "vc+gpus", "vc", "gpus", "all")
_PER_KEY = ("med", "sd", "last", "n")
FEATURES: tuple[str, ...] = (
    "log2_gpus",
    "nodes",
    "hour",
    "weekday",
    *(f"{key}.{stat}" for key in KEYS for stat in _PER_KEY),
    "burst.position",
    "burst.age_s",
    "burst.gap_s",
    "burst.previous_size",
    "burst.previous_med",
    "ladder",  # the back-off median (the trees learn a correction of it)
)
_NAN = float("nan")
_NO_HISTORY = (_NAN, _NAN, _NAN, 0.0)  # a history key's features where it has none


class Features(msgspec.Struct, frozen=True):
    """What a submission says about a job."""

    vc: str
    gpus: int
    user: str = ""
    name: str = ""
    nodes: int = 0
    at: float = 0.0  # submission time (Unix seconds)

    def history_keys(self) -> list[tuple[str, str]]:
        """(key kind, history key) for each key the job has (unknown users and names are left out)."""
        user = self.user if self.user != UNKNOWN else ""
        name = self.name if self.name != UNKNOWN else ""
        out = []
        if user and name:
            out.append(("user+name", f"un|{user}|{name}"))
        if user:
            out.append(("user+gpus", f"ug|{user}|{self.gpus}"))
            out.append(("user", f"u|{user}"))
        out.append(("vc+gpus", f"vg|{self.vc}|{self.gpus}"))
        out.append(("vc", f"v|{self.vc}"))
        out.append(("gpus", f"g|{self.gpus}"))
        out.append(("all", "all"))
        return out

    def burst_key(self) -> str:
        user = self.user if self.user != UNKNOWN else ""
        return f"{user}|{self.vc}|{self.gpus}"


class Prediction(msgspec.Struct, frozen=True):
    seconds: float  # the median: exp(mu)
    basis: str  # what it rests on
    mu: float = 0.0  # log seconds
    sigma: float = 0.0  # spread of log seconds
    version: int = 0  # the model's refit count
    digest: str = ""  # of the feature vector
    user_history: int = 0  # the user's finished jobs the model knew

    def quantile(self, q: float) -> float:
        return quantile_s(self.seconds, self.sigma, q)


class Burst(msgspec.Struct, kw_only=True, gc=False):
    """Jobs of one key submitted close together: their number, first and last submission, and the
    log-durations of those finished."""

    first_at: float
    last_at: float
    size: int = 0
    finished: list[float] = msgspec.field(default_factory=list)
    open_jobs: list[str] = msgspec.field(default_factory=list)  # submitted, not ended (forgotten when none is)
    # Its open jobs with a recorded prediction, grouped by all a revision of them depends on (see
    # ``RevisionGroup``): an end among its jobs is weighed once per group, not once per job.
    groups: dict[str, RevisionGroup] = msgspec.field(default_factory=dict)


class RevisionGroup(msgspec.Struct, array_like=True, gc=False):
    """Open jobs of one burst that a revision treats alike: the same model mu and error key (fixed at
    their submission) and the same prediction in force (seconds, sigma)."""

    mu: float
    error_key: str
    in_force: tuple[float, float]
    jobs: dict[str, None] = msgspec.field(default_factory=dict)


class BurstPosterior(NamedTuple):
    """A burst's finished jobs: how many, their median log-duration, a job's spread around it."""

    finished: int
    median: float
    within: float


class BurstUpdate(NamedTuple):
    """The normal-normal update of a model mu (spread ``sigma``) with the median of a burst's finished
    mates (each of spread ``within``): what it takes from the spread and the burst, worked out once
    for every mu of that spread."""

    prior: float  # the weight of the model's mu: 1 / sigma**2
    pull: float  # the finished mates' weight times their median
    total: float  # both weights
    sigma: float  # the updated spread
    recorded_sigma: float  # the updated spread as a prediction records it (what ``Moved`` compares)

    @classmethod
    def of(cls, sigma: float, posterior: BurstPosterior) -> BurstUpdate:
        w0, w1 = 1.0 / sigma**2, posterior.finished / posterior.within**2
        updated = math.sqrt(1.0 / (w0 + w1))
        return cls(w0, w1 * posterior.median, w0 + w1, updated, round(updated, 4))

    def mu(self, mu: float) -> float:
        return (self.prior * mu + self.pull) / self.total


def _with_burst(mu: float, sigma: float, posterior: BurstPosterior) -> tuple[float, float]:
    """The model's mu (spread sigma) updated with the median of the finished burst-mates."""
    update = BurstUpdate.of(sigma, posterior)
    return update.mu(mu), update.sigma


def _seconds(mu: float) -> float:
    return round(math.exp(min(mu, 25.0)), 1)


def _with_burst_basis(basis: str, posterior: BurstPosterior) -> str:
    return f"{basis}; {posterior.finished} of its burst finished"


def _as_prediction(pending: Pending, mu: float, sigma: float, basis: str, seconds: float) -> Prediction:
    """The prediction of mu (``seconds``: its median) and ``sigma`` for the job ``pending`` stands for."""
    return Prediction(
        seconds=seconds,
        basis=basis,
        mu=round(mu, 6),
        sigma=round(sigma, 4),
        version=pending.version,
        digest=pending.digest,
        user_history=pending.user_history,
    )


# Whether a revised (seconds, sigma) differs enough from the prediction in force to be recorded.
Moved = Callable[[tuple[float, float], float, float], bool]


@dataclass(slots=True)
class _Weighing:
    """What one end's revisions work out once: each burst's posterior, and its update of the jobs of
    each error key (with the revised spread as recorded: every job of the key shares it)."""

    posteriors: dict[str, BurstPosterior | None] = field(default_factory=dict)
    updates: dict[tuple[str, str], BurstUpdate] = field(default_factory=dict)


class Pending(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A submitted job the model has predicted and not yet seen finish."""

    x: tuple[float, ...]  # its features at submission (a training row once it finishes)
    mu: float  # the model's log-duration at submission (its error feeds sigma)
    burst: str  # its burst's id
    version: int  # the model's version at submission
    error_key: str  # the history key whose errors give its spread
    user_history: int
    basis: str
    digest: str  # of ``x``


# Trees compiled from a model's text, once per process (the state keeps only the text).
_TREES: dict[str, Trees] = {}


class Trees:
    """A LightGBM model's trees, evaluated in Python: one row at a time, as the decider predicts, this
    is many times faster than a call into LightGBM, and gives the same numbers
    (``tests/unit/test_predict.py`` holds it to ``Booster.predict``).

    The trees become the source of one Python function, nested ``if``s with their thresholds as
    literals, compiled once per model (a few ms, once per refit): it walks a row some 4x faster than
    a loop over the trees' arrays (``walk``, which stays for trees too deep to nest)."""

    def __init__(self, text: str) -> None:
        self.trees = _read_trees(text)
        self.predict: Callable[[list[float]], float] = _compile(self.trees) or self.walk

    def walk(self, x: list[float]) -> float:
        """The trees' sum for row ``x``, walked node by node."""
        total = 0.0
        for feature, threshold, left, right, mode, leaf_value in self.trees:
            node = 0
            while node >= 0:
                value = x[feature[node]]
                how = mode[node]
                if how == 0:
                    if value != value:
                        value = 0.0
                    node = left[node] if value <= threshold[node] else right[node]
                elif (value != value) if how < 4 else (value != value or abs(value) <= 1e-35):
                    node = left[node] if how & 1 else right[node]
                else:
                    node = left[node] if value <= threshold[node] else right[node]
            total += leaf_value[-node - 1]
        return total


_MAX_NESTING = 80  # nested ``if``s a generated function may hold (Python's parser allows 100 levels)


def _compile(trees: list[Tree]) -> Callable[[list[float]], float] | None:
    """``Trees.walk`` as one generated function (None if a tree is too deep to nest): the same
    comparisons, and the leaves added in the same order, so the same float, bit for bit."""
    lines = ["def predict(x):", " total = 0.0"]
    for tree in trees:
        if not _emit(tree, 0, 1, lines):
            return None
    lines.append(" return total")
    namespace: dict[str, Any] = {}
    exec(compile("\n".join(lines), "<gpuherd trees>", "exec"), namespace)  # (numbers only: see _emit)
    return namespace["predict"]


def _emit(tree: Tree, node: int, depth: int, lines: list[str]) -> bool:
    """The source of ``tree`` from ``node`` on, at ``depth``; False if it nests too deep. Only ints and
    float reprs reach the source (a float's repr reads back as the same float)."""
    feature, threshold, left, right, mode, leaf_value = tree
    pad = " " * depth
    if node < 0:
        leaf = float(leaf_value[-node - 1])
        lines.append(f"{pad}total += {leaf!r}")
        return math.isfinite(leaf)
    value, limit, how = f"x[{int(feature[node])}]", float(threshold[node]), mode[node]
    if limit == math.inf and how == 0 and left[node] == right[node]:  # (a tree of one leaf)
        return _emit(tree, left[node], depth, lines)
    if depth > _MAX_NESTING or not math.isfinite(limit) or how not in (0, 1, 2, 5, 6):
        return False  # (walked instead)
    lines.append(f"{pad}v = {value}")
    # When NaN (or, for mode 5/6, zero too) goes left: the test that is true exactly for the rows that
    # go left. ``v <= t`` is false for NaN; ``not v > t`` is true for it.
    if how == 0:
        test = f"not v > {limit!r}" if limit >= 0.0 else f"v <= {limit!r}"  # (NaN reads as 0.0)
    elif how in (1, 2):
        test = f"not v > {limit!r}" if how == 1 else f"v <= {limit!r}"
    elif how == 5:
        test = f"v != v or -1e-35 <= v <= 1e-35 or v <= {limit!r}"
    else:  # 6: NaN and zero go right
        test = f"v <= {limit!r} and not -1e-35 <= v <= 1e-35"
    lines.append(f"{pad}if {test}:")
    if not _emit(tree, left[node], depth + 1, lines):
        return False
    lines.append(f"{pad}else:")
    return _emit(tree, right[node], depth + 1, lines)


# One tree as lists: split feature, threshold, left and right child (a leaf as a negative index, -1
# the first), how a missing value goes (0: as 0.0; 1/2: NaN goes left/right; 5/6: NaN or zero goes
# left/right), leaf values.
Tree = tuple[list[int], list[float], list[int], list[int], list[int], list[float]]


class UnsupportedModel(ValueError):
    """A LightGBM model of a kind the duration model never fits, and ``Trees`` does not evaluate."""


def _read_trees(text: str) -> list[Tree]:
    """The trees of a LightGBM model's text (``Booster.model_to_string``). The duration model fits
    numeric splits only (``DurationModel.refit``): categorical splits, linear trees and averaged
    outputs (random forests) are refused (``UnsupportedModel``), not evaluated wrongly."""
    if "average_output" in text.split("\nTree=", 1)[0]:
        raise UnsupportedModel("a LightGBM model that averages its trees (a random forest)")
    trees: list[Tree] = []
    for block in text.split("\nTree=")[1:]:
        fields = dict(line.split("=", 1) for line in block.split("\n")[1:] if "=" in line)
        if fields.get("is_linear", "0") != "0" or fields.get("num_cat", "0") != "0":
            raise UnsupportedModel("a LightGBM model with linear trees or categorical splits")
        leaf_value = [float(v) for v in fields["leaf_value"].split()]
        if int(fields["num_leaves"]) == 1:  # a tree of one leaf: a split that always goes to it
            trees.append(([0], [math.inf], [-1], [-1], [0], leaf_value))
            continue
        kinds = [int(v) for v in fields["decision_type"].split()]
        if any(kind & 1 for kind in kinds):
            raise UnsupportedModel("a LightGBM model with categorical splits")
        # decision_type: bit 1 default left; bits 2-3 missing type (0 none, 1 zero, 2 NaN).
        mode = [
            0 if (kind >> 2) & 3 == 0 else (1 if kind & 2 else 2) + (4 if (kind >> 2) & 3 == 1 else 0) for kind in kinds
        ]
        trees.append(
            (
                [int(v) for v in fields["split_feature"].split()],
                [float(v) for v in fields["threshold"].split()],
                [int(v) for v in fields["left_child"].split()],
                [int(v) for v in fields["right_child"].split()],
                mode,
                leaf_value,
            )
        )
    return trees


_LAST: list[Any] = [None, None]  # the text last compiled, and its trees (most calls ask for it again)


def _trees(text: str) -> Trees:
    if _LAST[0] is text:
        return _LAST[1]
    key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    trees = _TREES.get(key)
    if trees is None:
        if len(_TREES) > 8:
            _TREES.clear()
        trees = _TREES[key] = Trees(text)
    _LAST[:] = [text, trees]
    return trees


class DurationModel(msgspec.Struct, kw_only=True, dict=True):
    """The learned history (part of the analytics decider's state, so it snapshots and replays).
    (``dict``: it also keeps what it works out of its history, ``_stats``, which is not encoded.)"""

    window: int = 32  # finished jobs per history key
    min_samples: int = 3  # before a key's median counts for the fallback ladder
    default_s: float = 3600.0  # before anything has finished
    burst_gap_s: float = 60.0
    refit_every: int = 1000  # finished jobs between refits (and the first refit)
    train_window: int = 20_000  # the latest finished jobs a refit learns from
    trees: int = 30
    learning_rate: float = 0.05
    min_leaf: int = 100
    objective: str = "regression_l1"  # the conditional median of log seconds
    seed: int = 0
    learner: str = "lightgbm"  # or "ladder": no trees, the back-off median alone
    history: dict[str, list[float]] = msgspec.field(default_factory=dict)  # key -> recent log(seconds)
    bursts: dict[str, Burst] = msgspec.field(default_factory=dict)  # burst id -> burst
    open_burst: dict[str, str] = msgspec.field(default_factory=dict)  # burst key -> its latest burst's id
    previous_burst: dict[str, tuple[int, float]] = msgspec.field(default_factory=dict)  # key -> (size, median)
    pending: dict[str, Pending] = msgspec.field(default_factory=dict)  # job -> its submission's features
    grouped: dict[str, str] = msgspec.field(default_factory=dict)  # open job -> its burst's ``RevisionGroup`` key
    rows: list[tuple[float, ...]] = msgspec.field(default_factory=list)  # training rows (features + target)
    errors: list[float] = msgspec.field(default_factory=list)  # recent out-of-sample errors of mu
    burst_errors: list[float] = msgspec.field(default_factory=list)  # finished job vs its burst's earlier ones
    error_sq: float = 0.0  # sums of squares of both (kept as they move)
    burst_error_sq: float = 0.0
    key_errors: dict[str, list[float]] = msgspec.field(default_factory=dict)  # the errors of each VC+GPUs or user
    key_error_sq: dict[str, float] = msgspec.field(default_factory=dict)
    # recently ended job -> its burst (bounded; oldest first, see __post_init__)
    ended_in: dict[str, str] = msgspec.field(default_factory=OrderedDict)
    observed: int = 0
    since_refit: int = 0
    version: int = 0
    booster: str = ""  # LightGBM model text ("" before the first refit)
    fit_s: float = 0.0  # wall time spent refitting (not part of any decision)

    def __post_init__(self) -> None:
        self.ended_in = oldest_first(self.ended_in)  # (every end drops the oldest)

    def compiled(self) -> Trees:
        return _trees(self.booster)

    # -- features ---------------------------------------------------------------------------------

    def features(
        self,
        f: Features,
        burst_id: str | None = None,
        previous_at: float | None = None,
        *,
        ladder: float | None = None,
    ) -> list[float]:
        """The feature vector of a job submitted now (``FEATURES``' order). ``burst_id``: the burst it
        joined, and ``previous_at``: the latest submission of its burst key before it (None: none);
        without a burst, a job asked about without joining, the open burst's latest is that.
        ``ladder``: its back-off median, where the caller has worked it out (``_ladder``)."""
        x = [math.log2(max(f.gpus, 1)), float(f.nodes or 0)]
        if f.at > CALENDAR_TIME_FROM_S:  # (traces that give offsets have no time of day)
            day = f.at / 86400.0
            x += [(day % 1.0) * 24.0, float(int(day + 3) % 7)]  # 1970-01-01 was a Thursday
        else:
            x += [_NAN, _NAN]
        present = dict(f.history_keys())
        for kind in KEYS:
            stats = self._key_stats(present.get(kind, ""))
            x += stats if stats is not None else _NO_HISTORY
        burst = self.bursts.get(burst_id) if burst_id is not None else None
        key = f.burst_key()
        size, med = self.previous_burst.get(key, (0, _NAN))
        if burst is not None:
            # (a mate the stream stored earlier than the burst's first, clocks apart: age 0, not a crash)
            x += [math.log1p(burst.size - 1), math.log1p(max(f.at - burst.first_at, 0.0))]
        else:
            x += [0.0, 0.0]
        if burst_id is None:
            last = self.bursts.get(self.open_burst.get(key, ""))
            previous_at = last.last_at if last is not None else None
        # (Read once the job had joined its burst, the latest submission was the job itself: the gap
        # of every training row was NaN, and the trees never learned from it.)
        gap = f.at - previous_at if previous_at is not None else _NAN
        x += [math.log1p(max(gap, 0.0)) if gap == gap else _NAN, math.log1p(size), med]
        x.append(self._ladder(f)[0] if ladder is None else ladder)
        return x

    def _stats(self) -> dict[str, tuple[float, float, float, float]]:
        """History key -> (median, spread, last, count) of its recent values, as worked out: every
        submission reads seven keys, and a key changes only when a job of it finishes (``observe``
        forgets it then). Not part of the state: a copy or a decoded snapshot starts without."""
        return self.__dict__.setdefault("stats", {})

    def _key_stats(self, key: str) -> tuple[float, float, float, float] | None:
        """The median, spread (interquartile), latest value and count of the history of ``key``
        (None: it has none)."""
        cache = self._stats()
        stats = cache.get(key)
        if stats is None:
            recent = self.history.get(key)
            if not recent:
                return None
            ordered = sorted(recent)
            n = len(ordered)
            med = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
            stats = cache[key] = (med, ordered[(3 * n) // 4] - ordered[n // 4], recent[-1], float(n))
        return stats

    # -- predicting ---------------------------------------------------------------------------------

    def submit(self, job: str, f: Features) -> Prediction:
        """Predict a job submitted now and remember its features (its training row once it finishes)."""
        last = self.bursts.get(self.open_burst.get(f.burst_key(), ""))
        previous_at = last.last_at if last is not None else None
        burst_id = self._join_burst(job, f)
        ladder = self._ladder(f)  # (a feature, and what the trees correct: worked out once)
        x = self.features(f, burst_id, previous_at, ladder=ladder[0])
        mu, basis = self._mu(x, ladder)
        pending = self._pending(f, x, mu, basis, burst_id)
        self.pending[job] = pending
        return self._prediction(pending)

    def predict(self, f: Features) -> Prediction:
        """What ``submit`` would predict, without remembering the job."""
        ladder = self._ladder(f)
        x = self.features(f, None, ladder=ladder[0])
        mu, basis = self._mu(x, ladder)
        return self._prediction(self._pending(f, x, mu, basis, ""))

    def _pending(self, f: Features, x: list[float], mu: float, basis: str, burst_id: str) -> Pending:
        error_key, history = self._error_key(f), self._user_history(f)
        return Pending(tuple(x), mu, burst_id, self.version, error_key, history, basis, features_digest(x))

    def revise(self, current: Mapping[str, tuple[float, float]], moved: Moved) -> dict[str, Prediction]:
        """New predictions of jobs not yet ended (``current``: job -> its prediction in force, as
        (seconds, sigma)), with what their burst-mates' ends taught since their submission: only
        those whose new (seconds, sigma) ``moved`` says differ enough. Mates that share a burst, model
        mu, error key and prediction in force are weighed once for all (``revisions`` does this for
        the groups the model keeps)."""
        groups: dict[tuple[str, float, str, tuple[float, float]], list[str]] = {}
        for job, before in current.items():
            pending = self.pending.get(job)
            if pending is not None:
                groups.setdefault((pending.burst, pending.mu, pending.error_key, before), []).append(job)
        weighed = _Weighing()
        out: dict[str, Prediction] = {}
        for (burst_id, mu, error_key, before), jobs in groups.items():
            posterior = self._moves(burst_id, mu, error_key, before, moved, weighed)
            if posterior is not None:
                for job in jobs:
                    out[job] = self._prediction(self.pending[job], posterior)
        return {job: out[job] for job in current if job in out}

    def revisions(self, ended: str, moved: Moved) -> dict[str, Prediction]:
        """``revise`` for every open mate of ``ended`` (which just ended) with a recorded prediction,
        from the groups its burst keeps: the work grows with the groups and the jobs whose prediction
        moved, not with the burst's size (a sweep may hold thousands of jobs, and each of their ends
        revises the rest). In no particular order."""
        burst = self.bursts.get(self.ended_in.get(ended, ""))
        if burst is None or not burst.finished or not burst.groups:
            return {}  # (nothing to weigh, or nothing weighed moves: no finished mate)
        posterior = self._burst_posterior(burst)
        # The groups of one error key share the update but for their mu (a sweep's groups nearly all
        # share one key): it is worked out once per key, not per group.
        updates: dict[str, BurstUpdate] = {}
        out: dict[str, Prediction] = {}
        for group in burst.groups.values():
            update = updates.get(group.error_key)
            if update is None:
                update = updates[group.error_key] = BurstUpdate.of(self.sigma(group.error_key), posterior)
            mu = update.mu(group.mu)
            seconds = _seconds(mu)
            if moved(group.in_force, seconds, update.recorded_sigma):
                # (What ``_prediction`` works out for each of them: they share mu and error key.)
                for job in group.jobs:
                    pending = self.pending[job]
                    basis = _with_burst_basis(pending.basis, posterior)
                    out[job] = _as_prediction(pending, mu, update.sigma, basis, seconds)
        return out

    def _moves(
        self, burst_id: str, mu: float, error_key: str, before: tuple[float, float], moved: Moved, weighed: _Weighing
    ) -> BurstPosterior | None:
        """The posterior of burst ``burst_id`` if it moves the prediction in force (``before``) of its
        jobs of model ``mu`` and ``error_key`` enough to revise them, else None."""
        if burst_id not in weighed.posteriors:
            burst = self.bursts.get(burst_id)
            posterior = self._burst_posterior(burst) if burst is not None and burst.finished else None
            weighed.posteriors[burst_id] = posterior
        posterior = weighed.posteriors[burst_id]
        if posterior is None:
            return None
        update = weighed.updates.get((burst_id, error_key))
        if update is None:
            update = weighed.updates[burst_id, error_key] = BurstUpdate.of(self.sigma(error_key), posterior)
        return posterior if moved(before, _seconds(update.mu(mu)), update.recorded_sigma) else None

    def recorded(self, job: str, seconds: float, sigma: float) -> None:
        """A prediction of ``job`` was recorded: the one in force when its mates' ends revise it."""
        pending = self.pending.get(job)
        burst = self.bursts.get(pending.burst) if pending is not None else None
        if pending is None or burst is None:
            return  # (ended, or submitted before the model followed it: never revised)
        self._ungroup(job, burst)
        key = f"{pending.mu!r}|{pending.error_key}|{seconds!r}|{sigma!r}"
        group = burst.groups.get(key)
        if group is None:
            group = burst.groups[key] = RevisionGroup(pending.mu, pending.error_key, (seconds, sigma))
        group.jobs[job] = None
        self.grouped[job] = key

    def _ungroup(self, job: str, burst: Burst) -> None:
        key = self.grouped.pop(job, None)
        if key is not None:
            group = burst.groups[key]
            del group.jobs[job]
            if not group.jobs:
                del burst.groups[key]

    def mates(self, job: str) -> list[str]:
        """The jobs of the burst of ``job`` (which just ended) that have not ended."""
        burst = self.bursts.get(self.ended_in.get(job, ""))
        return list(burst.open_jobs) if burst is not None else []

    def _user_history(self, f: Features) -> int:
        user = f.user if f.user != UNKNOWN else ""
        return len(self.history.get(f"u|{user}", ())) if user else 0

    @staticmethod
    def _error_key(f: Features) -> str:
        user = f.user if f.user != UNKNOWN else ""
        return f"u|{user}" if user else f"vg|{f.vc}|{f.gpus}"

    def sigma(self, error_key: str) -> float:
        """The spread of the model's errors on jobs of ``error_key`` (else on all jobs)."""
        errors = self.key_errors.get(error_key)
        if errors is not None and len(errors) >= 10:
            return max(math.sqrt(max(self.key_error_sq[error_key], 0.0) / len(errors)), 0.05)
        n = len(self.errors)
        return max(math.sqrt(max(self.error_sq, 0.0) / n), 0.05) if n >= 20 else 1.5

    def _mu(self, x: list[float], ladder: tuple[float, str]) -> tuple[float, str]:
        """The model's log-duration of the features ``x`` (with their back-off median and its basis)."""
        base, basis = ladder
        if self.booster and self.learner == "lightgbm":
            value = base + self.compiled().predict(x)
            return value, f"gbdt v{self.version} on {min(self.observed, self.train_window):,} jobs + {basis}"
        return base, basis

    def _ladder(self, f: Features) -> tuple[float, str]:
        """The back-off median: of the most specific history key with ``min_samples`` jobs."""
        for kind, key in f.history_keys():
            stats = self._key_stats(key)
            if stats is not None and stats[3] >= self.min_samples:
                return stats[0], f"{kind}: last {int(stats[3])} jobs"  # (the median, as statistics.median)
        return math.log(self.default_s), "default: no history yet"

    def _burst_posterior(self, burst: Burst) -> BurstPosterior:
        """What a burst's finished jobs say: how many, their median log-duration, and the spread of a
        job around its burst's median (learned from earlier bursts)."""
        n = len(self.burst_errors)
        within = max(math.sqrt(max(self.burst_error_sq, 0.0) / n), 0.1) if n >= 20 else 0.5
        return BurstPosterior(len(burst.finished), statistics.median(burst.finished), within)

    def _prediction(self, pending: Pending, posterior: BurstPosterior | None = None) -> Prediction:
        mu, basis, sigma = pending.mu, pending.basis, self.sigma(pending.error_key)
        if posterior is None:
            burst = self.bursts.get(pending.burst) if pending.burst else None
            if burst is not None and burst.finished:
                posterior = self._burst_posterior(burst)
        if posterior is not None:
            mu, sigma = _with_burst(mu, sigma, posterior)
            basis = _with_burst_basis(basis, posterior)
        return _as_prediction(pending, mu, sigma, basis, _seconds(mu))

    def _join_burst(self, job: str, f: Features) -> str:
        key = f.burst_key()
        current = self.open_burst.get(key)
        burst = self.bursts.get(current) if current is not None else None
        if burst is None or f.at - burst.last_at > self.burst_gap_s:
            if burst is not None:
                self._close_burst(key, burst, current)  # type: ignore[arg-type]
            current = f"{key}#{job}"
            burst = self.bursts[current] = Burst(first_at=f.at, last_at=f.at)
            self.open_burst[key] = current
        burst.last_at = f.at
        burst.size += 1
        burst.open_jobs.append(job)
        return current

    def _close_burst(self, key: str, burst: Burst, burst_id: str) -> None:
        med = statistics.median(burst.finished) if burst.finished else _NAN
        if burst.finished or key not in self.previous_burst:
            self.previous_burst[key] = (burst.size, med)
        if not burst.open_jobs:
            self.bursts.pop(burst_id, None)

    # -- learning ---------------------------------------------------------------------------------

    def observe(self, job: str, f: Features, seconds: float) -> None:
        """A job finished after running ``seconds``: learn it."""
        value = math.log(max(seconds, 1.0))
        stats = self._stats()
        for _, key in f.history_keys():
            recent = self.history.setdefault(key, [])
            recent.append(value)
            if len(recent) > self.window:
                del recent[0]
            stats.pop(key, None)
        self.observed += 1
        pending = self.pending.pop(job, None)
        if pending is None:
            return  # (submitted before the model followed it: nothing to train on)
        error = value - pending.mu
        self.error_sq += _push(self.errors, error, 2000)
        key_errors = self.key_errors.setdefault(pending.error_key, [])
        self.key_error_sq[pending.error_key] = self.key_error_sq.get(pending.error_key, 0.0) + _push(
            key_errors, error, 64
        )
        burst = self.bursts.get(pending.burst)
        if burst is not None:
            if burst.finished:
                self.burst_error_sq += _push(self.burst_errors, value - statistics.median(burst.finished), 2000)
            burst.finished.append(value)
            if len(burst.finished) > self.window:
                del burst.finished[0]
        self._ended(job, pending, f.burst_key())
        self.rows.append((*pending.x, value))
        if len(self.rows) > self.train_window:
            del self.rows[: len(self.rows) - self.train_window]
        self.since_refit += 1
        if self.learner == "lightgbm" and self.since_refit >= max(self.refit_every, self.observed // 8):
            self.refit()

    def forget(self, job: str, f: Features) -> None:
        """A job ended without running (cancelled, failed to start): nothing to learn."""
        pending = self.pending.pop(job, None)
        if pending is not None:
            self._ended(job, pending, f.burst_key())

    def _ended(self, job: str, pending: Pending, key: str) -> None:
        """``job`` left its burst (a burst with no open job left, and no longer the open one, goes)."""
        self.ended_in[job] = pending.burst
        if len(self.ended_in) > 4096:
            del self.ended_in[next(iter(self.ended_in))]
        burst = self.bursts.get(pending.burst)
        if burst is None:
            self.grouped.pop(job, None)
            return
        burst.open_jobs.remove(job)
        self._ungroup(job, burst)
        if not burst.open_jobs and self.open_burst.get(key) != pending.burst:
            del self.bursts[pending.burst]

    def refit(self) -> None:
        """Fit the trees on the latest finished jobs (deterministic: one thread, fixed seed)."""
        import lightgbm

        t0 = time.perf_counter()
        data = np.asarray(self.rows, dtype=np.float64)
        params = {
            "objective": self.objective,
            "learning_rate": self.learning_rate,
            "num_leaves": 31,
            "min_data_in_leaf": self.min_leaf,
            "feature_fraction": 0.9,
            "bagging_fraction": 1.0,
            "lambda_l2": 1.0,
            "num_threads": 1,
            "deterministic": True,
            "force_row_wise": True,
            "seed": self.seed,
            "verbosity": -1,
        }
        # The trees learn what to add to the back-off median (the last feature): a staircase of
        # splits approximates the identity badly, a correction of it well.
        label = data[:, -1] - data[:, -2]
        dataset = lightgbm.Dataset(data[:, :-1], label=label, feature_name=list_names(), free_raw_data=True)
        booster = lightgbm.train(params, dataset, num_boost_round=self.trees)
        self.booster = booster.model_to_string()
        self.version += 1
        self.since_refit = 0
        self.fit_s += time.perf_counter() - t0


def features_digest(x: Iterable[float]) -> str:
    """A short digest of a feature vector (what ``JobDurationPredicted.features`` records)."""
    values = tuple(x)
    # (The bytes of a float64 array in native order, packed without building one.)
    return hashlib.blake2b(struct.pack(f"={len(values)}d", *values), digest_size=6).hexdigest()


def list_names() -> list[str]:
    return [name.replace("+", "_").replace(".", "_") for name in FEATURES]


def _push(values: list[float], value: float, limit: int) -> float:
    """Append ``value`` to the window ``values``; returns the change of its sum of squares."""
    values.append(value)
    change = value * value
    if len(values) > limit:
        change -= values[0] * values[0]
        del values[0]
    return change


# -- accuracy on a trace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Accuracy:
    jobs: int
    mae_s: float
    median_relative_error: float
    within_2x: float  # share of predictions within a factor of two of the truth
    by_basis: dict[str, int]
    fit_s: float = 0.0
    predict_s: float = 0.0

    def row(self) -> dict[str, float | int | None]:
        """The figures as a table row; None where there is no figure (no jobs: each is NaN)."""

        def rounded(value: float, digits: int | None = None) -> float | int | None:
            return None if math.isnan(value) else round(value, digits)

        return {
            "jobs": self.jobs,
            "MAE (s)": rounded(self.mae_s),
            "median rel. error": rounded(self.median_relative_error, 3),
            "within 2x": rounded(self.within_2x, 3),
        }


def features_of(row: object) -> Features:
    """A trace row's features (offline: evaluation on a trace's table)."""
    import pandas as pd  # the live decider never reads a table, and does not load pandas

    def text(value: object) -> str:
        return "" if value is None or pd.isna(value) else str(value)

    nodes = getattr(row, "nodes", 0)
    return Features(
        vc=text(getattr(row, "vc", "")) or "default",
        gpus=int(getattr(row, "gpus", 1)),
        user=text(getattr(row, "user", "")),
        name=text(getattr(row, "name", "")),
        nodes=0 if nodes is None or pd.isna(nodes) else int(nodes),
        at=float(getattr(row, "submit_time", 0.0)),
    )


def evaluate(
    jobs: pd.DataFrame,
    model: DurationModel | None = None,
    *,
    on_predict: Callable[[int, Prediction], None] | None = None,
    freeze_after: float | None = None,
) -> tuple[Accuracy, np.ndarray]:
    """Predict every job at its submission from the jobs that had *finished* by then (a
    time-ordered split: the model never sees the future), learning as they finish.

    A job's finish is its recorded end time, else submit + queue + duration, else (no queueing
    recorded, as in ``philly.csv``) submit + duration: the earliest it could have finished, so
    with unknown queueing the model may learn from a job slightly before it really finished.
    ``freeze_after``: the model learns nothing from jobs that finish after this time (a time
    split: how well a model trained on the first weeks does on the rest, without learning).
    Returns the accuracy and the predictions (in the table's row order)."""
    model = model or DurationModel()
    ends = jobs["end_time"].to_numpy(dtype="float64", na_value=np.nan)
    queue = jobs["queue"].fillna(0.0).to_numpy(dtype="float64")
    submit = jobs["submit_time"].to_numpy(dtype="float64")
    duration = jobs["duration"].to_numpy(dtype="float64")
    finish = np.where(np.isfinite(ends), ends, submit + queue + duration)
    order = np.argsort(submit, kind="stable")
    rows = list(jobs.itertuples(index=False))
    ids = [str(i) for i in range(len(rows))]
    feats = [features_of(r) for r in rows]
    predicted = np.empty(len(rows))
    bases: dict[str, int] = {}
    finished: list[tuple[float, int]] = []  # (finish time, row) of submitted jobs not yet learned
    predict_s = 0.0
    for i in order:
        while finished and finished[0][0] <= submit[i]:
            end, j = heapq.heappop(finished)
            if freeze_after is None or end <= freeze_after:
                model.observe(ids[j], feats[j], duration[j])
        t0 = time.perf_counter()
        guess = model.submit(ids[i], feats[i])
        predict_s += time.perf_counter() - t0
        predicted[i] = guess.seconds
        if on_predict is not None:
            on_predict(int(i), guess)
        level = guess.basis.split(":")[0].split(" v")[0]
        bases[level] = bases.get(level, 0) + 1
        heapq.heappush(finished, (finish[i], int(i)))
    result = accuracy(predicted, duration, bases)
    return (
        Accuracy(**{**result.__dict__, "fit_s": model.fit_s, "predict_s": predict_s}),
        predicted,
    )


def accuracy(predicted: np.ndarray, actual: np.ndarray, by_basis: dict[str, int] | None = None) -> Accuracy:
    actual = np.maximum(actual, 1.0)
    predicted = np.asarray(predicted, dtype=np.float64)
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
