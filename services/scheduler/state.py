"""The scheduler's own state: the core fold plus what only the scheduler needs.

- **queue indexes**: waiting jobs by VC and by priority, placed/running jobs by priority and by
  VC, GPUs held per VC (a pass skips a VC whose quota is used up without looking at each of its
  jobs, and reserves quota for a VC's first waiting job from its own running jobs' ends);
- **node changes**: nodes by their last change, so a pass recomputes only the views of nodes
  changed since the pass before;
- **queue changes**: jobs by the last event that named them as they waited, entered or left the
  queue, so a decider re-ranks only those (``services/scheduler/ranks.py``);
- **fair-share usage**: decayed GPU-seconds per user and VC;
- **preemption bookkeeping**: when each job's attempts were preempted (at most N per hour);
- **the policy in force**, **duration predictions**, and **intake's index** of submitted ids;
- **dependencies**: the outcome of recently ended jobs and arrays (what a dependency may still
  name), each array's elements placed or running, the waiting jobs that depend on each job, and
  those whose dependency can no longer be met (to be cancelled);
- **limits**: GPUs and placed or running jobs per user of each VC, and running jobs by the time
  their time limit is reached (the timer fires then).

Finished jobs leave the state (``retain_finished`` off): it is bounded by the live jobs, whatever
the length of the history. Every index is kept from the core's transitions (a job entering or
leaving the queue, or the placed and running jobs), never recomputed.
"""

from __future__ import annotations

import bisect
import functools
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState, JobState, apply, oldest_first

DEFAULT_HALF_LIFE_S = 12 * 3600.0  # how fast past GPU use stops counting under fair share
# Cluster-wide scheduling parameters (PolicyConfigured.params), whatever the policy, and their defaults.
CLUSTER_PARAMS: dict[str, float] = {
    "half_life_s": DEFAULT_HALF_LIFE_S,
    "preemption_grace_s": 30.0,  # SIGUSR1 to SIGTERM: time for a preempted job to checkpoint
    "max_preemptions_per_hour": 2.0,  # per job
    # 1: a spec's duration_s is what a job is expected to run; 0: it is not trusted, predictions
    # count (as for jobs that declare none): what a trace simulation of a scheduler told no durations runs
    "declared_durations": 1.0,
    # (rules 12) A rescale not reported done this long after the scheduler committed it is taken as
    # failed and rolled back: the report is one datagram, and can be lost. Well above what a switch
    # takes, joiners starting included (their workers give up on a store after 300 s).
    "rescale_timeout_s": 1800.0,
}


class SchedulingConfig(msgspec.Struct, kw_only=True, dict=True):
    """The policy in force, from the latest applied PolicyConfigured (None: the scheduler's default).
    Its parameters never change once made (a new PolicyConfigured makes a new one): what is read of
    them at every ranking is worked out once (``cached_property``, never encoded)."""

    policy: str | None = None
    backfill: bool = True
    params: dict[str, float] = msgspec.field(default_factory=dict)
    rules: int = ev.SCHEDULING_RULES  # the pass's rules (``events.SCHEDULING_RULES``) in force

    def param(self, name: str) -> float:
        return self.params.get(name, CLUSTER_PARAMS[name])

    @functools.cached_property
    def half_life_s(self) -> float:
        return self.param("half_life_s")

    @functools.cached_property
    def trusts_declared(self) -> bool:
        return self.param("declared_durations") > 0


class Usage(msgspec.Struct, kw_only=True, gc=False):
    """Decayed GPU-seconds of a user or VC, as of ``at`` (halves every ``half_life_s``)."""

    gpu_s: float = 0.0
    at: float = 0.0

    def value(self, now: float, half_life_s: float) -> float:
        return self.gpu_s * 0.5 ** (max(0.0, now - self.at) / half_life_s)


def intake_key(source: str, intake_id: str) -> str:
    return f"{source}/{intake_id}"


# How long (log time) and how many ended jobs' outcomes are kept for dependencies to name (Slurm's
# MinJobAge, longer): a dependency on a job forgotten longer ago is refused as unknown. An outcome
# a waiting job still depends on is kept whatever its age.
OUTCOMES_KEPT_S = 14 * 86400.0
OUTCOMES_KEPT = 50_000

# Rejections kept for answering a redelivered submission (``SchedulerState.recent_rejections``):
# several times what one leader has in hand (intake fetches 512 at a time).
RECENT_REJECTIONS_KEPT = 8192


class RecordedRejection(msgspec.Struct, array_like=True, gc=False):
    """What identifies a rejected submission when it is delivered again, and its answer: its source,
    its size and a checksum of the start of its payload (a recreated intake stream numbers anew, so
    the sequence alone may name another submission), and the reason it was given."""

    source: str
    size: int
    excerpt_crc: int
    reason: str


def rejection_of(source: str, size: int, excerpt: str, reason: str) -> RecordedRejection:
    return RecordedRejection(source, size, zlib.crc32(excerpt.encode()), reason)


class EndedJob(msgspec.Struct, array_like=True, gc=False):
    outcome: str
    at: float


class ArrayBook(msgspec.Struct, kw_only=True, gc=False):
    """A job array while any element of it has not ended."""

    size: int
    max_running: int | None = None
    live: int = 0  # elements not ended
    active: int = 0  # elements placed or running
    begun: int = 0  # elements placed at least once, or ended
    not_ok: int = 0  # elements that ended other than completed


def user_key(vc: str, user: str) -> str:
    return f"{vc}/{user}"


class SchedulerState(ClusterState, kw_only=True, gc=False):
    vc_used: dict[str, int] = msgspec.field(default_factory=dict)  # GPUs the active jobs hold, per VC
    # The queue by VC (unordered: a pass sorts by policy) and how many wait at each priority.
    queued_by_vc: dict[str, dict[str, None]] = msgspec.field(default_factory=dict)
    queued_priorities: dict[int, int] = msgspec.field(default_factory=dict)
    queued_sizes: dict[str, dict[int, int]] = msgspec.field(default_factory=dict)  # VC -> GPUs asked -> jobs
    active_priorities: dict[int, int] = msgspec.field(default_factory=dict)  # placed/running jobs per priority
    active_by_vc: dict[str, dict[str, None]] = msgspec.field(default_factory=dict)  # placed/running jobs per VC
    # Running jobs by expected end (inf: unknown), sorted, overall and per VC, for reservations: kept as
    # jobs start, end or learn their duration, never recomputed by a pass. ``end_of``: each one's key.
    ends: list[tuple[float, str]] = msgspec.field(default_factory=list)
    ends_by_vc: dict[str, list[tuple[float, str]]] = msgspec.field(default_factory=dict)
    end_of: dict[str, float] = msgspec.field(default_factory=dict)
    unstarted: dict[str, None] = msgspec.field(default_factory=dict)  # placed jobs not running yet
    # Elastic jobs with a rescale in flight (at least those: one a node's loss ended may stay until
    # its job's next event): what a tick looks through for overdue rescales (rules 12).
    rescaling: dict[str, None] = msgspec.field(default_factory=dict)
    node_changes: dict[str, int] = msgspec.field(default_factory=dict)  # node -> its version, oldest first
    # Job -> seq of the last event that named it while it waited, or as it entered or left the queue,
    # oldest first (a job that leaves the state leaves it too). A waiting job's rank under FIFO,
    # SJF, SRTF and QSSF changes only with such an event (or the policy's configuration).
    queue_changes: dict[str, int] = msgspec.field(default_factory=dict)
    # VC -> seq of the last event that named one of its placed or running jobs (or one that became
    # so): what may wait for those jobs' GPUs changes only with such an event, or with time.
    active_changes: dict[str, int] = msgspec.field(default_factory=dict)
    usage: dict[str, Usage] = msgspec.field(default_factory=dict)  # "user:<name>" / "vc:<name>" -> past use
    scheduling: SchedulingConfig = msgspec.field(default_factory=SchedulingConfig)
    predicted: dict[str, float] = msgspec.field(default_factory=dict)  # job -> its latest predicted duration
    # job -> (log-spread, the user's finished jobs the model knew) of that prediction, where sigma > 0
    predicted_spread: dict[str, tuple[float, int]] = msgspec.field(default_factory=dict)
    preempted_at: dict[str, list[float]] = msgspec.field(default_factory=dict)  # job -> when it was preempted
    # Preemptors and the victims still stopping for them: a preemptor waits for its victims' GPUs.
    stopping_for: dict[str, dict[str, None]] = msgspec.field(default_factory=dict)
    intake_index: dict[str, str] = msgspec.field(default_factory=dict)  # "source/intake_id" -> job id
    rejected: int = 0
    # The latest rejections by intake sequence, oldest first. A submission is delivered again when
    # its acknowledgement was lost (the leader died after storing the verdict): answered from here,
    # it is not rejected twice. (An accepted one is found by its intake id.) Only the latest are
    # kept: a redelivery is of what the last leader had in hand.
    recent_rejections: dict[int, RecordedRejection] = msgspec.field(default_factory=dict)
    # Dependencies: ended jobs and arrays (oldest first), live arrays, and for each job or array the
    # waiting jobs that depend on it; ``doomed``: waiting jobs whose dependency can no longer be met
    # (and that are cancelled for it, or ``stuck`` waiting until cancelled), with the reason.
    outcomes: dict[str, EndedJob] = msgspec.field(default_factory=OrderedDict)  # (see __post_init__)
    arrays: dict[str, ArrayBook] = msgspec.field(default_factory=dict)
    dependants: dict[str, dict[str, None]] = msgspec.field(default_factory=dict)
    doomed: dict[str, str] = msgspec.field(default_factory=dict)
    stuck: dict[str, str] = msgspec.field(default_factory=dict)  # the same, kept waiting (kill_on_invalid_dep off)
    # Per user of a VC ("vc/user"): GPUs held and jobs placed or running.
    user_gpus: dict[str, int] = msgspec.field(default_factory=dict)
    user_active: dict[str, int] = msgspec.field(default_factory=dict)
    gpu_seconds: dict[str, float] = msgspec.field(default_factory=dict)  # "vc/user" -> GPU-seconds charged
    # Running jobs with a time limit, by when they reach it (sorted), and each one's.
    deadlines: list[tuple[float, str]] = msgspec.field(default_factory=list)
    deadline_of: dict[str, float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.outcomes = oldest_first(self.outcomes)  # (every end drops the oldest)

    # -- derived views --------------------------------------------------------------------------

    def vc_usage(self) -> dict[str, int]:
        """GPUs held per VC by placed and running jobs (a copy: a pass adds its own placements)."""
        return dict(self.vc_used)

    def borrowing(self, vc_name: str) -> set[str]:
        """The VC's placed or running jobs that borrow now (rules 9): what a VC borrows is its usage
        beyond its quota (as Kueue counts it), held by its newest placements first (``active_by_vc``
        keeps each VC's jobs in the order they were placed). A job's ``borrowed``, frozen when it was
        placed, outlives the borrowing once the VC's older jobs end. Cheap: an over-quota VC's newest
        jobs, only as many as hold its excess."""
        vc = self.vcs.get(vc_name)
        excess = 0 if vc is None else vc.borrowing(self.vc_used.get(vc_name, 0))
        out: set[str] = set()
        for job_id in reversed(self.active_by_vc.get(vc_name, {})):
            if excess <= 0:
                break
            held = self.jobs[job_id].held
            if held:
                out.add(job_id)
                excess -= held
        return out

    def changed_since(self, clock: int) -> list[str]:
        """Nodes changed after node clock ``clock``, most recent first."""
        return _changed_after(self.node_changes, clock)

    def queue_changed_since(self, seq: int) -> list[str]:
        """Jobs whose waiting changed (see ``queue_changes``) after sequence ``seq``, most recent first."""
        return _changed_after(self.queue_changes, seq)

    def past_usage(self, key: str) -> float:
        """Decayed GPU-seconds of ``user:<name>`` or ``vc:<name>`` as of the newest event."""
        usage = self.usage.get(key)
        return 0.0 if usage is None else usage.value(self.now, self.scheduling.half_life_s)

    def expected_duration(self, job: JobState) -> float | None:
        """The spec's ``duration_s`` if given (and the cluster trusts declared durations), else the
        latest prediction."""
        if job.spec.duration_s is not None and self.scheduling.trusts_declared:
            return job.spec.duration_s
        return self.predicted.get(job.job)

    def duration_bound(self, job: JobState) -> float | None:
        """How long the job runs at most, started now: its expected duration, bounded by its time limit."""
        duration = self.expected_duration(job)
        limit = job.spec.time_limit_s
        if limit is None:
            return duration
        return limit if duration is None else min(duration, limit)

    def expected_end(self, job: JobState, *, starting: bool = False) -> float:
        """When a placed or running job (``starting``: one placed now, or not started yet) is expected
        to end (inf: unknown): what its duration leaves after the work done before, counted from when
        its work was last accounted (its start, or its latest resize); at the latest when its attempt
        reaches its time limit."""
        duration = self.expected_duration(job)
        end = math.inf
        if duration is not None:
            start = self.now if starting or job.started_at is None else (job.service_from or job.started_at)
            left = max(0.0, duration - job.service_gpu_s / job.spec.gpus)
            if job.spec.elastic is not None and job.held and self.scheduling.rules >= 5:
                left *= job.spec.gpus / job.held  # an elastic job at another size: its work at that rate (linear)
            end = start + left
        if job.spec.time_limit_s is not None:
            begun = self.now if starting or job.started_at is None else job.started_at
            end = min(end, begun + job.spec.time_limit_s)
        return end

    def next_deadline(self) -> float | None:
        """The earliest time limit a running job (not stopping already) reaches: when the timer must tick."""
        jobs = self.jobs
        for at, job_id in self.deadlines:
            if not jobs[job_id].stopping():
                return at
        return None

    def preemptions_within(self, job: str, seconds: float) -> int:
        return sum(1 for t in self.preempted_at.get(job, ()) if self.now - t < seconds)


def _changed_after(changes: dict[str, int], clock: int) -> list[str]:
    """The keys of a change list (key -> clock of its last change, oldest first) changed after
    ``clock``, most recent first: read from the end, so a caller pays for what changed only."""
    out = []
    for key, at in reversed(changes.items()):
        if at <= clock:
            break
        out.append(key)
    return out


def gpu_seconds_by_user(state: SchedulerState) -> dict[tuple[str, str], float]:
    """GPU-seconds used per (VC, user): what was charged, and the running jobs' use up to the newest event."""
    out = {tuple(key.split("/", 1)): used for key, used in state.gpu_seconds.items()}
    for job_id in state.active:
        job = state.jobs[job_id]
        running = job.running_gpu_s(state.now)
        if running:
            key = (job.spec.vc, job.spec.user)
            out[key] = out.get(key, 0.0) + running  # type: ignore[index]
    return out  # type: ignore[return-value]


def new_state() -> SchedulerState:
    return SchedulerState(retain_finished=False)


PolicyCheck = Callable[[str, dict[str, float]], str | None]


def evolve(state: SchedulerState, seq: int, e: ev.Event, *, policy_problem: PolicyCheck) -> SchedulerState:
    """Fold ``e``: the core first, then the scheduler's own part from what the core changed."""
    job_id = getattr(e, "job", None)
    job = state.jobs.get(job_id) if job_id is not None else None
    before = (job.status, job.held, job.preempt_reason, job.preempted_for) if job is not None else None
    apply(state, seq, e)
    if job is None and job_id is not None:
        job = state.jobs.get(job_id)
    if job is not None:
        _follow_job(state, job, before, e)
    for name in state.touched:
        state.node_changes.pop(name, None)
        state.node_changes[name] = state.nodes[name].version
    # (By exact type, as the core fold's handlers and the scheduler's routes are: this runs per event.)
    kind = type(e)
    if kind is ev.PolicyConfigured:
        if e.unchecked or policy_problem(e.policy, e.params) is None:  # type: ignore[attr-defined]  # else refused
            trusted = state.scheduling.trusts_declared
            state.scheduling = SchedulingConfig(
                policy=e.policy, backfill=e.backfill, params=dict(e.params), rules=e.rules
            )
            if state.scheduling.trusts_declared != trusted:  # every expected end moves
                for active in list(state.active):
                    _follow_end(state, state.jobs[active], True)
    elif kind is ev.JobRejected:
        state.rejected += 1
        recent = state.recent_rejections
        recent.pop(e.intake_seq, None)
        recent[e.intake_seq] = rejection_of(e.intake_source, e.payload_size, e.payload_excerpt, e.reason)
        if len(recent) > RECENT_REJECTIONS_KEPT:
            del recent[next(iter(recent))]
    return state


def _follow_job(state: SchedulerState, job: JobState, before: tuple | None, e: ev.Event) -> None:
    """Keep the indexes in step with what the core did to ``job``."""
    status, held, preempt_reason, preempted_for = before if before is not None else (None, 0, None, "")
    spec = job.spec
    kind = type(e)  # (by exact type, as the core fold's handlers are)
    # (Read once: nothing below adds or removes a job, or changes which are placed or running.)
    job_id = job.job
    kept = job_id in state.jobs  # (not: it finished, and leaves the state)
    created = kind is ev.JobSubmitted and before is None and kept
    if created and spec.intake_id is not None:
        state.intake_index[intake_key(e.intake_source, spec.intake_id)] = e.job  # type: ignore[union-attr]
    was_queued, queued = status == "pending", job.status == "pending" and kept
    if was_queued != queued:
        if queued:
            state.queued_by_vc.setdefault(spec.vc, {})[job_id] = None
            _count_up(state.queued_priorities, spec.priority, 1)
            _count_up(state.queued_sizes.setdefault(spec.vc, {}), spec.gpus, 1)
        else:
            by_vc = state.queued_by_vc[spec.vc]
            del by_vc[job_id]
            if not by_vc:
                del state.queued_by_vc[spec.vc]
            _count_down(state.queued_priorities, spec.priority, 1)
            sizes = state.queued_sizes[spec.vc]
            _count_down(sizes, spec.gpus, 1)
            if not sizes:
                del state.queued_sizes[spec.vc]
    was_active, active = status in ("placed", "running"), job_id in state.active
    if was_active or active:
        state.active_changes[spec.vc] = state.seq
    if was_active != active:
        _count_up(state.active_priorities, spec.priority, 1 if active else -1)
        _count_up(state.user_active, user_key(spec.vc, spec.user), 1 if active else -1)
        if active:
            state.active_by_vc.setdefault(spec.vc, {})[job_id] = None
        else:
            of_vc = state.active_by_vc[spec.vc]
            del of_vc[job_id]
            if not of_vc:
                del state.active_by_vc[spec.vc]
    now_held = job.held if active else 0
    if now_held != (held if was_active else 0):
        _count_up(state.vc_used, spec.vc, now_held - (held if was_active else 0))
        _count_up(state.user_gpus, user_key(spec.vc, spec.user), now_held - (held if was_active else 0))
    if created or spec.depends_on is not None or spec.array_of is not None or not kept:
        follow_dependencies(state, job, created=created, was_active=was_active, active=active)
    if spec.time_limit_s is not None:
        _follow_deadline(state, job)
    for _, at, used in state.accounted:
        _charge(state, job, at, used)
    if preempt_reason is None and job.preempt_reason is not None and kind is ev.JobPreempted:
        state.preempted_at.setdefault(job_id, []).append(e.at)
        state.stopping_for.setdefault(job.preempted_for, {})[job_id] = None
    elif preempt_reason is not None and (job.preempt_reason is None or not kept):
        victims = state.stopping_for.get(preempted_for)
        if victims is not None:
            victims.pop(job_id, None)
            if not victims:
                del state.stopping_for[preempted_for]
    if job.rescale is not None and active:
        state.rescaling[job_id] = None
    elif job_id in state.rescaling:
        del state.rescaling[job_id]
    if kind is ev.JobDurationPredicted and kept:
        state.predicted[job_id] = e.seconds
        if e.sigma > 0 or e.user_history:
            state.predicted_spread[job_id] = (e.sigma, e.user_history)
        else:
            state.predicted_spread.pop(job_id, None)
    if was_queued or queued:
        state.queue_changes.pop(job_id, None)
        state.queue_changes[job_id] = state.seq
    if not kept:  # finished: what the scheduler kept of it goes too
        state.queue_changes.pop(job_id, None)
        state.predicted.pop(job_id, None)
        state.predicted_spread.pop(job_id, None)
        state.preempted_at.pop(job_id, None)
    if was_active != active or kind in _MOVES_END:
        _follow_end(state, job, active)


# What can move a placed job's expected end: its start, a new prediction, a resize (it accounts
# the work done so far). Its placement and its end come with a change of ``active``.
_MOVES_END = frozenset({ev.JobStarted, ev.JobDurationPredicted, ev.JobResized, ev.RescaleCompleted})


def _follow_end(state: SchedulerState, job: JobState, active: bool) -> None:
    """Keep the job's place among the running jobs' expected ends."""
    started = active and job.started_at is not None
    end = state.expected_end(job) if started else None
    old = state.end_of.get(job.job)
    if old != end:
        by_vc = state.ends_by_vc.setdefault(job.spec.vc, [])
        if old is not None:
            for ends in (state.ends, by_vc):
                del ends[bisect.bisect_left(ends, (old, job.job))]
            del state.end_of[job.job]
        if end is not None:
            for ends in (state.ends, by_vc):
                bisect.insort(ends, (end, job.job))
            state.end_of[job.job] = end
        if not by_vc:
            del state.ends_by_vc[job.spec.vc]
    if active and not started:
        state.unstarted[job.job] = None
    else:
        state.unstarted.pop(job.job, None)


def _follow_deadline(state: SchedulerState, job: JobState) -> None:
    """Keep the job's place among the running jobs by time limit (it leaves once it reached it)."""
    deadline = job.deadline() if job.job in state.jobs and not job.time_limit_reached else None
    old = state.deadline_of.get(job.job)
    if old == deadline:
        return
    if old is not None:
        del state.deadlines[bisect.bisect_left(state.deadlines, (old, job.job))]
        del state.deadline_of[job.job]
    if deadline is not None:
        bisect.insort(state.deadlines, (deadline, job.job))
        state.deadline_of[job.job] = deadline


# -- dependencies -----------------------------------------------------------------------------------


def follow_dependencies(state: SchedulerState, job: JobState, *, created: bool, was_active: bool, active: bool) -> None:
    """Keep what dependencies read in step with ``job``: its array's counts, its own outcome once it
    ended, which waiting jobs depend on what, and which of them can no longer start."""
    spec = job.spec
    ended = job.job not in state.jobs
    member = spec.array_of
    book = state.arrays.get(member.array) if member is not None else None
    if created:
        if member is not None:
            book = state.arrays.setdefault(member.array, ArrayBook(size=member.size, max_running=member.max_running))
            book.live += 1
        if spec.depends_on is not None:
            for dep in spec.depends_on.ids():
                state.dependants.setdefault(dep, {})[job.job] = None
            _check_dependant(state, job.job, spec)
    placed_now = active and not was_active
    if book is not None and was_active != active:
        book.active += 1 if active else -1
        if placed_now and job.attempt == 0:
            book.begun += 1  # (attempt 0 is placed once: a requeued job's next placement is attempt 1)
    if spec.depends_on is not None and (ended or placed_now):
        _forget_dependant(state, job.job, spec.depends_on)  # placed (its dependencies were met), or ended
    if not ended:
        return
    state.doomed.pop(job.job, None)
    state.stuck.pop(job.job, None)
    at = job.finished_at if job.finished_at is not None else state.now
    _ended(state, job.job, job.status, at)
    if book is not None and member is not None:
        book.live -= 1
        book.begun += job.first_placed_at is None  # (ended without ever starting: it will not begin)
        book.not_ok += job.status != "completed"
        if book.live == 0:
            del state.arrays[member.array]
            _ended(state, member.array, "completed" if book.not_ok == 0 else "failed", at)
        elif job.status != "completed":
            _dependency_moved(state, member.array)  # an `afterok` on the array can no longer be met


def _ended(state: SchedulerState, job_or_array: str, outcome: str, at: float) -> None:
    """Remember how a job (or a whole array) ended, forget the oldest outcomes no waiting job depends
    on, and mark the waiting jobs this end leaves without a way to start."""
    outcomes = state.outcomes
    outcomes[job_or_array] = EndedJob(outcome, at)
    for _ in range(len(outcomes)):
        oldest = next(iter(outcomes))
        if len(outcomes) <= OUTCOMES_KEPT and outcomes[oldest].at >= at - OUTCOMES_KEPT_S:
            break
        kept = outcomes.pop(oldest)
        if oldest in state.dependants:
            outcomes[oldest] = kept  # a waiting job still depends on it: keep it (at the young end)
    _dependency_moved(state, job_or_array)


def _dependency_moved(state: SchedulerState, dep: str) -> None:
    for waiting in state.dependants.get(dep, ()):
        job = state.jobs.get(waiting)
        if job is not None and waiting not in state.doomed and waiting not in state.stuck:
            _check_dependant(state, waiting, job.spec)


def _check_dependant(state: SchedulerState, job_id: str, spec: ev.JobSpec) -> None:
    if spec.depends_on is None:
        return
    never = dependency_wait(state, spec.depends_on)[1]
    if never is not None:
        (state.doomed if spec.kill_on_invalid_dep else state.stuck)[job_id] = never


def _forget_dependant(state: SchedulerState, job_id: str, deps: ev.Dependencies) -> None:
    for dep in deps.ids():
        waiting = state.dependants.get(dep)
        if waiting is not None:
            waiting.pop(job_id, None)
            if not waiting:
                del state.dependants[dep]


DepVerdict = Literal["met", "wait", "never"]


def dependency_verdict(state: SchedulerState, kind: str, dep: str) -> tuple[DepVerdict, str]:
    """Whether one dependency is met, may still be, or can never be, and the dependency's state in words."""
    book = state.arrays.get(dep)
    if book is not None:
        ended = book.size - book.live
        where = f"array of {book.size}: {ended} ended, {book.not_ok} not completed, {book.active} placed or running"
        if kind == "afterok" and book.not_ok:
            return "never", where
        if kind == "after" and book.begun >= book.size:
            return "met", where
        return "wait", where
    job = state.jobs.get(dep)
    if job is not None:
        if kind == "after" and job.first_placed_at is not None:
            return "met", job.status
        return "wait", job.status
    done = state.outcomes.get(dep)
    if done is None:
        return "never", "no longer known"
    ok = done.outcome == "completed"
    if kind == "afterok":
        return ("met" if ok else "never"), done.outcome
    if kind == "afternotok":
        return ("never" if ok else "met"), done.outcome
    return "met", done.outcome


def dependency_wait(state: SchedulerState, deps: ev.Dependencies) -> tuple[str | None, str | None]:
    """What a job's dependencies hold it back for (None: every one is met), and why they can never all
    be met (None: they still may be)."""
    waiting: str | None = None
    for kind, ids in deps.kinds():
        for dep in ids:
            verdict, where = dependency_verdict(state, kind, dep)
            if verdict == "never":
                return waiting, f"dependency {kind}:{dep} can never be met ({dep}: {where})"
            if verdict == "wait" and waiting is None:
                waiting = f"{kind}:{dep} ({where})"
    return waiting, None


def _charge(state: SchedulerState, job: JobState, at: float, used: float) -> None:
    """Add GPU-seconds a job ran to its user's and its VC's decayed usage (and to their plain sum)."""
    key = user_key(job.spec.vc, job.spec.user)
    state.gpu_seconds[key] = state.gpu_seconds.get(key, 0.0) + used
    half_life = state.scheduling.half_life_s
    for key in (f"user:{job.spec.user}", f"vc:{job.spec.vc}"):
        usage = state.usage.setdefault(key, Usage(at=at))
        usage.gpu_s = usage.value(at, half_life) + used
        usage.at = max(usage.at, at)


def _count_up(counts: dict, key: object, by: int) -> None:
    left = counts.get(key, 0) + by
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)


def _count_down(counts: dict, key: object, by: int) -> None:
    _count_up(counts, key, -by)


def index_problems(state: SchedulerState) -> list[str]:
    """Where the kept indexes disagree with the state they index (tests and invariants)."""
    problems = []
    active = [state.jobs[j] for j in state.active]
    vc_used: dict[str, int] = {}
    priorities: dict[int, int] = {}
    for job in active:
        vc_used[job.spec.vc] = vc_used.get(job.spec.vc, 0) + job.held
        priorities[job.spec.priority] = priorities.get(job.spec.priority, 0) + 1
    if state.vc_used != vc_used:
        problems.append(f"the per-VC GPU count drifted: {state.vc_used} kept, {vc_used} held")
    user_gpus: dict[str, int] = {}
    user_active: dict[str, int] = {}
    array_active: dict[str, int] = {}
    for job in active:
        key = user_key(job.spec.vc, job.spec.user)
        if job.held:
            user_gpus[key] = user_gpus.get(key, 0) + job.held
        user_active[key] = user_active.get(key, 0) + 1
        if job.spec.array_of is not None:
            array_active[job.spec.array_of.array] = array_active.get(job.spec.array_of.array, 0) + 1
    if state.user_gpus != user_gpus or state.user_active != user_active:
        problems.append(f"the per-user counts drifted: {state.user_gpus}/{state.user_active} kept")
    if {a: b.active for a, b in state.arrays.items() if b.active} != array_active:
        problems.append("the arrays' counts of placed and running elements drifted")
    deadlines = {j.job: d for j in active if not j.time_limit_reached and (d := j.deadline()) is not None}
    if state.deadline_of != deadlines or state.deadlines != sorted((d, j) for j, d in deadlines.items()):
        problems.append("the running jobs' time limits drifted")
    if state.active_priorities != priorities:
        problems.append("the per-priority count of active jobs drifted")
    if not {job.job for job in active if job.rescale is not None} <= state.rescaling.keys():
        problems.append("the jobs with a rescale in flight drifted")
    active_by_vc: dict[str, set[str]] = {}
    for job in active:
        active_by_vc.setdefault(job.spec.vc, set()).add(job.job)
    if {vc: set(jobs) for vc, jobs in state.active_by_vc.items()} != active_by_vc:
        problems.append("the per-VC index of active jobs drifted")
    by_vc: dict[str, set[str]] = {}
    queued: dict[int, int] = {}
    sizes: dict[str, dict[int, int]] = {}
    for job_id in state.queue:
        spec = state.jobs[job_id].spec
        by_vc.setdefault(spec.vc, set()).add(job_id)
        queued[spec.priority] = queued.get(spec.priority, 0) + 1
        sizes.setdefault(spec.vc, {})[spec.gpus] = sizes.get(spec.vc, {}).get(spec.gpus, 0) + 1
    if {vc: set(jobs) for vc, jobs in state.queued_by_vc.items()} != by_vc or state.queued_priorities != queued:
        problems.append("the per-VC queue index drifted from the queue")
    if state.queued_sizes != sizes:
        problems.append("the per-VC sizes of waiting jobs drifted from the queue")
    started = {j.job: state.expected_end(j) for j in active if j.started_at is not None}
    if state.end_of != started or state.ends != sorted((end, j) for j, end in started.items()):
        problems.append("the running jobs' expected ends drifted")
    by_vc_ends: dict[str, list[tuple[float, str]]] = {}
    for j, end in sorted(started.items(), key=lambda item: (item[1], item[0])):
        by_vc_ends.setdefault(state.jobs[j].spec.vc, []).append((end, j))
    if state.ends_by_vc != by_vc_ends or set(state.unstarted) != {j.job for j in active} - set(started):
        problems.append("the per-VC expected ends or the placed jobs not started drifted")
    stopping: dict[str, set[str]] = {}
    for job in active:
        if job.preempt_reason is not None:
            stopping.setdefault(job.preempted_for, set()).add(job.job)
    if {k: set(v) for k, v in state.stopping_for.items()} != stopping:
        problems.append(f"the preemptors' index drifted: {state.stopping_for} kept, {stopping} stopping")
    if set(state.node_changes) != set(state.nodes) or any(
        state.node_changes[name] != node.version for name, node in state.nodes.items()
    ):
        problems.append("the node change list disagrees with the nodes' versions")
    if not set(state.queue) <= set(state.queue_changes) or not set(state.queue_changes) <= set(state.jobs):
        problems.append("the queue change list misses a waiting job, or names a job that has left")
    if list(state.queue_changes.values()) != sorted(state.queue_changes.values()):
        problems.append("the queue change list is out of order")
    return problems
