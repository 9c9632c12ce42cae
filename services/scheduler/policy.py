"""Queue policies: in which order waiting jobs are tried, and which running jobs they outrank.

A policy is one small class: a sort key for waiting jobs (lower goes first)
and, for preemptive policies, when a waiting job outranks a running one.
Every policy sorts by priority first (higher first), then by its own key,
then by arrival. Placement, quotas, backfill and preemption are the
scheduling pass's (``schedule.py``), the same for every policy.

| policy     | key                                                        | preempts                 |
|------------|------------------------------------------------------------|--------------------------|
| fifo       | arrival                                                    | no                       |
| sjf        | expected duration (declared, else predicted; unknown last) | no                       |
| srtf       | expected remaining time                                    | a job with more left     |
| las        | Tiresias 2D-LAS queue of attained GPU-time                 | a job in a higher queue  |
| qssf       | a quantile of the predicted duration x GPUs                | no                       |
| fairshare  | decayed GPU use of the job's VC (per weight), then user    | no                       |

Expected duration: the spec's ``duration_s`` if given, else the latest
``JobDurationPredicted``. SRTF's remaining time is that less the work done so far, counted as the
fold's attained service (an elastic job's at each of its sizes; ``work_done_by``). QSSF uses the
prediction only: the ``quantile`` of its log-normal (``fallback_quantile`` for a job whose user
has no history the model knew, when that is set), and ``default_duration_s`` (one hour) before
there is one.

LAS preempts only a job that has run ``min_run_s`` since it last started.

``PolicyConfigured`` also carries cluster-wide parameters that every policy takes
(``services/scheduler/state.py:CLUSTER_PARAMS``); ``check_policy`` says what the scheduler refuses.
Every parameter is a finite number (the log's JSON has no infinity or NaN), non-negative but for
``fallback_quantile``, and within its range:

| parameter                  | range                                                         |
|----------------------------|---------------------------------------------------------------|
| ``queues`` (las)           | at most ``MAX_LAS_QUEUES`` (a loop count; rounded down, >= 1)  |
| ``quantile`` (qssf)        | between 0 and 1, exclusive                                    |
| ``fallback_quantile``      | below 1 (negative: none)                                      |
| ``half_life_s``            | positive                                                      |
| ``declared_durations``     | 0 or 1                                                        |

and its ``rules`` is a version of the scheduling rules this scheduler knows (1 to
``events.SCHEDULING_RULES``: a snapshot holds them, and a pass reads them).
"""

from __future__ import annotations

import abc
import bisect
import itertools
import math
from collections.abc import Callable, Iterable
from typing import ClassVar

from gpuherd import events as ev
from gpuherd.fold import JobState
from gpuherd.stats import quantile_s
from services.scheduler.state import CLUSTER_PARAMS, SchedulerState

DEFAULT_DURATION_S = 3600.0
# LAS works out every queue's bound when it is made (on every restart, every policy change): the
# number of queues is a loop count. Tiresias uses a few; a thousand is already far beyond use.
MAX_LAS_QUEUES = 1000


class Policy(abc.ABC):
    name: ClassVar[str]
    preemptive: ClassVar[bool] = False
    ranks_by_prediction: ClassVar[bool] = False  # its key reads predictions even of declared durations
    # A waiting job's rank changes only with an event that names it (a new prediction) or with the
    # policy's configuration, never with time or other jobs: a decider keeps the order between
    # passes (``ranks.RankIndex``) instead of sorting the queue at every pass.
    static_rank: ClassVar[bool] = False
    # Ranks that change with an event naming the job, and also with time, but at a moment the
    # policy can tell in advance (``rank_holds_until``): the order is kept between passes too, and
    # a job is ranked again once its moment has come.
    timed_rank: ClassVar[bool] = False
    # (Preemptive policies) A running job a waiting job does not outrank stays so until an event
    # names one of the two: time only wears the running job's claim down. A preemption pass that
    # found nothing to take then need not look again (``schedule.VictimMemo``). Not so under LAS,
    # where a running job's service, and with it what outranks it, grows as it runs.
    outranking_fades: ClassVar[bool] = False
    PARAMS: ClassVar[dict[str, float]] = {}  # tunable -> default

    def __init__(self, **params: float) -> None:
        unknown = set(params) - set(self.PARAMS)
        if unknown:
            known = ", ".join(sorted(self.PARAMS)) or "none"
            raise ValueError(f"policy {self.name} has no parameter {', '.join(sorted(unknown))}; it has: {known}")
        self.params = {**self.PARAMS, **params}

    @abc.abstractmethod
    def key(self, job: JobState, state: SchedulerState) -> tuple[float, ...]:
        """The job's rank within its priority: lower goes first."""

    def queue_is_order(self, state: SchedulerState) -> bool:
        """Whether the fold's queue (arrival order) is already this policy's order: then a pass
        that has no kept order (``ranks.RankIndex``) reads it as it is instead of sorting."""
        return False

    def prepare(self, state: SchedulerState) -> None:  # noqa: B027 - optional hook
        """Compute what ``key`` needs once per pass (fair share's usage table)."""

    def order(self, state: SchedulerState, queue: Iterable[str] | None = None) -> Iterable[JobState]:
        """Waiting jobs (``queue``, or all), first to try first (a pass reads only the first few:
        a policy may give them lazily)."""
        self.prepare(state)
        jobs = [state.jobs[j] for j in (state.queue if queue is None else queue)]
        return sorted(jobs, key=lambda j: self.rank(j, state))

    def order_without(self, state: SchedulerState, vcs: set[str], keep: list[str]) -> Iterable[JobState]:
        """Waiting jobs in order, without those of ``vcs`` but for the ones in ``keep``."""
        queue = [j for vc, queued in state.queued_by_vc.items() if vc not in vcs for j in queued]
        return self.order(state, [*queue, *keep]) if queue or keep else []

    def rank(self, job: JobState, state: SchedulerState) -> tuple:
        """The sort key of ``order`` (after ``prepare``): priority, the policy's key, arrival."""
        return (-job.spec.priority, self.key(job, state), job.order)

    def rank_holds_until(self, job: JobState, state: SchedulerState) -> float:
        """(``timed_rank``) Until when a waiting job's rank holds, unless an event names it (``state.now``
        up to then; ``math.inf``: for good)."""
        return math.inf

    def outranks(self, waiting: JobState, running: JobState, state: SchedulerState) -> bool:
        """Whether ``waiting`` may take ``running``'s GPUs (preemptive policies only)."""
        return self.outranked_by(waiting, state)(running)

    def outranked_by(self, waiting: JobState, state: SchedulerState) -> Callable[[JobState], bool]:
        """``outranks(waiting, running, state)`` as a test of running jobs: a preemption pass asks it of
        every running job, so what depends on the waiting job alone is worked out once."""
        return lambda running: False

    def outranking_claim(self, waiting: JobState, state: SchedulerState) -> object:
        """(``outranking_fades``) All that ``outranked_by`` reads of the waiting job but its priority:
        while it stays the same, the running jobs it outranks can only fall away."""
        return None


class Fifo(Policy):
    """First come, first served."""

    name = "fifo"
    static_rank = True

    def key(self, job: JobState, state: SchedulerState) -> tuple[float, ...]:
        return ()

    def queue_is_order(self, state: SchedulerState) -> bool:
        return len(state.queued_priorities) <= 1  # one priority: arrival order is FIFO's

    def order(self, state: SchedulerState, queue: Iterable[str] | None = None) -> Iterable[JobState]:
        if queue is None and self.queue_is_order(state):
            # No sort of a deep queue at every pass, and only the jobs the pass reads are looked up.
            return map(state.jobs.__getitem__, state.queue)
        return super().order(state, queue)

    def order_without(self, state: SchedulerState, vcs: set[str], keep: list[str]) -> Iterable[JobState]:
        if len(state.queued_priorities) > 1:
            return super().order_without(state, vcs, keep)
        jobs = state.jobs
        others = [q for vc, q in state.queued_by_vc.items() if vc not in vcs]
        if sum(map(len, others)) + len(keep) < len(state.queue) // 4:  # a few: sort them by arrival
            return sorted((jobs[j] for j in itertools.chain(*others, keep)), key=lambda job: job.order)
        kept = set(keep)
        return (job for j in state.queue if (job := jobs[j]).spec.vc not in vcs or j in kept)


class Sjf(Policy):
    """Shortest job first, by expected duration; jobs of unknown duration go last."""

    name = "sjf"
    static_rank = True

    def key(self, job: JobState, state: SchedulerState) -> tuple[float, ...]:
        duration = state.expected_duration(job)
        return (math.inf if duration is None else duration,)


def remaining_s(job: JobState, state: SchedulerState) -> float:
    duration = state.expected_duration(job)
    if duration is None:
        return math.inf
    return max(0.0, duration - work_done_by(state.scheduling.rules)(job, state.now))


WorkDone = Callable[[JobState, float], float]  # (job, now) -> seconds of its work done, at the size it asked for


def work_done_by(rules: int) -> WorkDone:
    """How the scheduling ``rules`` in force count a job's work done so far (all attempts and sizes):
    rules 10, the fold's attained service (GPU-seconds at each size over the GPUs it asked for)."""
    return JobState.attained_s if rules >= 10 else _ran_s_before_rules_10


def _ran_s_before_rules_10(job: JobState, now: float) -> float:
    """Rules 9 and before: the time since the start at the size asked for, on top of the GPU time of
    earlier attempts and sizes. A resize puts the attempt's GPU time so far into ``service_gpu_s``,
    so a resized elastic job's time before its resize counted twice (and its size went uncounted)."""
    ran = job.service_gpu_s / job.spec.gpus
    if job.status == "running" and job.started_at is not None:
        ran += now - job.started_at
    return ran


def _never(running: JobState) -> bool:
    return False


class Srtf(Policy):
    """Shortest remaining time first, preemptive: a waiting job takes the GPUs of a running job
    that has more time left than it needs."""

    name = "srtf"
    static_rank = True
    preemptive = True
    outranking_fades = True  # a running job's remaining time only falls as it runs

    def key(self, job: JobState, state: SchedulerState) -> tuple[float, ...]:
        return (remaining_s(job, state),)

    def outranked_by(self, waiting: JobState, state: SchedulerState) -> Callable[[JobState], bool]:
        needs = remaining_s(waiting, state)
        if needs == math.inf:
            return _never  # no job has more time left than one of unknown duration
        expected, now, done = state.expected_duration, state.now, work_done_by(state.scheduling.rules)

        def outranked(running: JobState) -> bool:
            # ``needs < remaining_s(running)``, asked of every running job of a VC at every pass:
            # ``needs`` is never negative, so the remaining time's floor at 0 changes nothing.
            duration = expected(running)
            return duration is None or needs < duration - done(running, now)

        return outranked

    def outranking_claim(self, waiting: JobState, state: SchedulerState) -> object:
        return remaining_s(waiting, state)


class Las(Policy):
    """Tiresias' discretized two-dimensional least-attained-service, with hysteresis.

    A job's attained service is GPUs x seconds it has run (all attempts). Jobs sit in ``queues``
    queues by service: below ``first_queue_gpu_s``, below that times ``queue_ratio``, and so on,
    the last one unbounded; lower queues go first, FIFO within a queue, and a job in a lower queue
    preempts one in a higher queue, but only one that has run ``min_run_s`` since it last started
    (so a job is not stopped again and again for a few seconds of work each time, paying its
    checkpoint and restore every time).

    Starvation guard: a waiting job that has waited more than ``starvation_factor`` times its run
    time so far (and at least ``min_starvation_s``) moves to the first queue, to be the next to
    start, but it preempts only by the queue its service puts it in: a guard that preempted would
    stop the very jobs it was protected from, which then starve in turn.
    """

    name = "las"
    preemptive = True
    timed_rank = True
    PARAMS = {
        "first_queue_gpu_s": 3600.0,
        "queue_ratio": 10.0,
        "queues": 3.0,
        "starvation_factor": 4.0,
        "min_starvation_s": 600.0,
        "min_run_s": 600.0,
    }

    def __init__(self, **params: float) -> None:
        super().__init__(**params)
        if self.params["queues"] > MAX_LAS_QUEUES:  # (a command recorded unchecked may hold more)
            raise ValueError(f"policy las: queues is at most {MAX_LAS_QUEUES}, got {self.params['queues']:g}")
        # Ranking every waiting job at every pass reads these: work them out once.
        bound, self._bounds = self.params["first_queue_gpu_s"], []  # queue i holds service < _bounds[i]
        for _ in range(max(1, int(self.params["queues"])) - 1):
            self._bounds.append(bound)
            bound *= max(self.params["queue_ratio"], 1.0)
        self._min_starvation_s = self.params["min_starvation_s"]
        self._starvation_factor = self.params["starvation_factor"]

    def service_queue(self, job: JobState, state: SchedulerState) -> int:
        """The queue its attained service puts it in."""
        service = job.service_gpu_s
        if job.status == "running":
            service += job.running_gpu_s(state.now)
        return bisect.bisect_right(self._bounds, service)

    def _starves_after(self, job: JobState) -> float:
        """The wait after which a waiting job starves (fixed while it waits: its service is)."""
        return max(self._min_starvation_s, self._starvation_factor * (job.service_gpu_s / job.spec.gpus))

    def starving(self, job: JobState, state: SchedulerState) -> bool:
        if job.status != "pending":
            return False
        return state.now - job.waiting_since > self._starves_after(job)

    def rank_holds_until(self, job: JobState, state: SchedulerState) -> float:
        # A waiting job's rank changes once, without an event: when it starts to starve.
        return math.inf if self.starving(job, state) else job.waiting_since + self._starves_after(job)

    def queue(self, job: JobState, state: SchedulerState) -> int:
        return 0 if self.starving(job, state) else self.service_queue(job, state)

    def rank(self, job: JobState, state: SchedulerState) -> tuple:
        # ``Policy.rank`` without the key's tuple: every waiting job is ranked at every pass.
        return (-job.spec.priority, self.queue(job, state), job.order)

    def key(self, job: JobState, state: SchedulerState) -> tuple[float, ...]:
        return (self.queue(job, state),)

    def outranked_by(self, waiting: JobState, state: SchedulerState) -> Callable[[JobState], bool]:
        queue, now, min_run_s = self.service_queue(waiting, state), state.now, self.params["min_run_s"]

        def outranked(running: JobState) -> bool:
            started = running.started_at
            return started is not None and now - started >= min_run_s and queue < self.service_queue(running, state)

        return outranked


class Qssf(Policy):
    """Helios' quasi-shortest-service-first: a quantile of the predicted duration x GPUs, smallest
    first.

    Only the duration model's prediction counts (``JobDurationPredicted``), not what the spec
    declares: QSSF exists because users' own estimates are unreliable, and in a trace
    simulation the declared duration is the truth, which QSSF must not see. A prediction is a
    log-normal (median ``seconds``, log-spread ``sigma``); QSSF ranks by its ``quantile`` (0.5:
    the median), and a job whose user has no history the model knew (it rests on the cluster's
    history: same VC and size, its burst) by ``fallback_quantile`` (negative: ``quantile``). A job
    not yet predicted counts ``default_duration_s``."""

    name = "qssf"
    static_rank = True
    ranks_by_prediction = True
    PARAMS = {"default_duration_s": DEFAULT_DURATION_S, "quantile": 0.5, "fallback_quantile": -1.0}

    def key(self, job: JobState, state: SchedulerState) -> tuple[float, ...]:
        return (self.duration(job, state) * job.spec.gpus,)

    def duration(self, job: JobState, state: SchedulerState) -> float:
        predicted = state.predicted.get(job.job)
        if predicted is None:
            return self.params["default_duration_s"]
        sigma, user_history = state.predicted_spread.get(job.job, (0.0, 0))
        q = self.params["quantile"]
        if not user_history and self.params["fallback_quantile"] >= 0:
            q = self.params["fallback_quantile"]
        return quantile_s(predicted, sigma, q)


class FairShare(Policy):
    """Least past use first: the job's VC's decayed GPU-seconds divided by the VC's weight,
    then its user's. Past use halves every ``half_life_s`` (a cluster parameter of
    ``PolicyConfigured``, since the fold keeps the decayed usage); running jobs count with their
    time so far."""

    name = "fairshare"

    def prepare(self, state: SchedulerState) -> None:
        vc_use: dict[str, float] = {}
        user_use: dict[str, float] = {}
        for job in state.active_jobs():
            if job.status == "running":
                used = job.running_gpu_s(state.now)
                vc_use[job.spec.vc] = vc_use.get(job.spec.vc, 0.0) + used
                user_use[job.spec.user] = user_use.get(job.spec.user, 0.0) + used
        for key in state.usage:  # "vc:<name>" / "user:<name>"
            kind, _, name = key.partition(":")
            table = vc_use if kind == "vc" else user_use
            table[name] = table.get(name, 0.0) + state.past_usage(key)
        self._vc_share = {
            name: use / (state.vcs[name].weight if name in state.vcs and state.vcs[name].weight > 0 else 1.0)
            for name, use in vc_use.items()
        }
        self._user_use = user_use

    def key(self, job: JobState, state: SchedulerState) -> tuple[float, ...]:
        return (self._vc_share.get(job.spec.vc, 0.0), self._user_use.get(job.spec.user, 0.0))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Fifo, Sjf, Srtf, Las, Qssf, FairShare)}


def make_policy(name: str, params: dict[str, float] | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
    return cls(**(params or {}))


def policy_params(name: str, params: dict[str, float]) -> dict[str, float]:
    """The params the policy itself takes (PolicyConfigured also carries the cluster-wide ones)."""
    known = POLICIES[name].PARAMS if name in POLICIES else {}
    return {k: v for k, v in params.items() if k in known}


def check_policy(name: str, params: dict[str, float], *, rules: int = ev.SCHEDULING_RULES) -> str | None:
    """Why a ``PolicyConfigured`` cannot be applied (None: it can): the policy must exist, every
    parameter must be one of its own or a cluster-wide one, with a value in its range (the module's
    table), and ``rules`` must be a version of the scheduling rules this scheduler knows."""
    if name not in POLICIES:
        return f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}"
    own = POLICIES[name].PARAMS
    unknown = sorted(set(params) - set(own) - set(CLUSTER_PARAMS))
    if unknown:
        takes = ", ".join(sorted({*own, *CLUSTER_PARAMS}))
        return f"policy {name} has no parameter {', '.join(unknown)}; it takes: {takes}"
    if not 1 <= rules <= ev.SCHEDULING_RULES:
        return f"rules {rules} are not scheduling rules this scheduler knows (1 to {ev.SCHEDULING_RULES})"
    # Infinity and NaN would be written to the log as null: an event no service could read back.
    not_finite = sorted(k for k, v in params.items() if not math.isfinite(v))
    if not_finite:
        return f"parameters must be finite numbers: {', '.join(not_finite)}"
    negative_ok = {"fallback_quantile"}  # (negative: none)
    positive = {"half_life_s", "rescale_timeout_s"}
    bad = sorted(k for k, v in params.items() if not (v >= 0 or k in negative_ok) or (k in positive and not v > 0))
    if bad:
        return f"parameters must be non-negative numbers ({' and '.join(sorted(positive))} positive): {', '.join(bad)}"
    if params.get("declared_durations", 1.0) not in (0.0, 1.0):
        return "declared_durations is 1 (jobs run what they declare) or 0 (predictions count instead)"
    if not 0 < params.get("quantile", 0.5) < 1 or params.get("fallback_quantile", -1.0) >= 1:
        return "quantile and fallback_quantile must lie between 0 and 1 (fallback_quantile negative: none)"
    queues = params.get("queues", 0.0)
    if queues > MAX_LAS_QUEUES:
        return f"queues is at most {MAX_LAS_QUEUES} (LAS works out every queue's bound when built), got {queues:g}"
    return None
