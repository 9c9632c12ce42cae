"""When elastic jobs grow and shrink: the policy, as pure functions of the cluster state.

Its rules are versioned (``ELASTIC_RULES``, recorded in ``ElasticConfigured`` and carried by every
``RescaleProposed``), so a log is audited by the rules it was decided by. Rules 2, in this order:

1. **Waiting jobs first.** For each waiting job in turn (arrival order), the free GPUs it can use
   are its; what it still lacks, running elastic jobs give back by shrinking towards their minimum,
   the ones losing the least predicted throughput per GPU given back first, one allowed size at a
   time. A shrink for a waiting job does not wait out the minimum interval (a rigid job never waits
   on an elastic job's hysteresis). The first waiting job that even every shrink cannot start ends
   the round: jobs behind it wait behind it (the scheduler reserves its start), and what it needs is
   not lent away.
2. **Only idle GPUs are lent.** GPUs no waiting job can use first give the jobs shrunk below the
   GPUs they asked for their GPUs back, then go to running elastic jobs beyond that, one allowed
   size at a time, each to the job whose predicted throughput gains most per GPU added (relative to
   its own per-GPU throughput now), while that marginal gain is at least ``grow_efficiency``. Either
   way, what a grow gains over ``min_interval_s`` must outweigh the samples lost in the rescale's
   pause (``grow_pause_s``).

Rules 3 leave a job that is stopping (cancelled, preempted, past its time limit) as it is; rules 4
also pass over a waiting job the scheduler holds back whatever GPUs are free (a dependency not met
yet, its array's ``max_running`` reached): nothing is shrunk or kept idle for it. Rules 5 do the same
for a job its VC's per-user limits hold back (``max_running_per_user``, ``max_gpus_per_user``),
unless shrinking its user's own elastic jobs in that VC lifts the hold (those shrink, no other job);
and no job is grown past its user's GPU limit (the scheduler refuses such a grow).

Rules 1 (logs decided before): only the first waiting job that is not elastic was shrunk for, and
only when nothing waited were idle GPUs lent, each job jumping to its largest size that kept
``grow_efficiency`` of its per-GPU throughput.

Hysteresis: a job grows at most once per ``min_interval_s``, and after shrinking for waiting jobs
it does not grow again for ``hold_after_shrink_s`` (so it is not grown into the GPUs that just
freed and shrunk again at once). With ``grow_after_start_s``, a job is not grown before
it has run that long (its first generation forms and trains first, so that its first grow is a
rescale of a running job, with its throughput measured, rather than a bigger start). Sizes are
only those the job may take (``Elastic.sizes()``: the global batch stays whole).

**Predicted throughput** at ``w`` workers, for a step of global batch ``G``:
``step(w) = compute_per_sample * G / w + allreduce(grad_bytes, w)``, with a ring all-reduce of
``2 (w - 1) / w * grad_bytes / bandwidth + (w - 1) * latency``. ``compute_per_sample`` comes from
the job's measured throughput at the nearest size it ran at (each ``RescaleCompleted`` carries
the throughput before the switch), else from its per-layer profile (``ProfileReported``: step
time per sample, gradient bytes), else from the scaling it declared (``JobSpec.scaling``, rules 2).
With none, throughput is taken as linear in ``w``. (The model: ``gpuherd.scaling``.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from gpuherd import events as ev
from gpuherd import scaling
from gpuherd.fold import ACTIVE, JobState
from services.elastic.state import ElasticState, JobModel, usable_model


class ElasticParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    min_interval_s: float = 60.0  # per job, between two of its rescales
    hold_after_shrink_s: float = 300.0  # no grow this soon after a shrink for waiting jobs
    grow_efficiency: float = 0.6  # per-GPU throughput at the new size / at the current size, at least
    retry_s: float = 30.0  # propose again when the scheduler did not act on a proposal
    grow_after_start_s: float = 0.0  # no grow of a job that started less than this ago
    bandwidth_bytes_per_s: float = scaling.DEFAULT_BANDWIDTH_BYTES_PER_S  # all-reduce bandwidth per worker
    latency_s: float = scaling.DEFAULT_LATENCY_S  # per ring hop
    # Training stood still in a grow (bench/bench_elastic.py: 0.03-0.05 s warm; the job keeps training
    # at its old size until the new workers are ready): a grow must gain more than this costs.
    grow_pause_s: float = 0.5

    def __post_init__(self) -> None:
        # What the throughput model divides by or adds per hop must be physical: a bandwidth of 0
        # crashed every decision on a job with gradients (and the service at each restart).
        for name in self.__struct_fields__:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be positive (bytes/s), got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be at least 0 (seconds per ring hop), got {self.latency_s}")


def params_from(values: dict[str, float]) -> ElasticParams:
    """ElasticParams from ``ElasticConfigured.params`` (or ``--params``): unknown names are refused."""
    try:
        return msgspec.convert(values, ElasticParams)
    except msgspec.ValidationError as exc:
        known = ", ".join(ElasticParams.__struct_fields__)
        raise ValueError(f"{exc}; known parameters: {known}") from None


def allreduce_s(grad_bytes: int, workers: int, params: ElasticParams) -> float:
    return scaling.allreduce_s(grad_bytes, workers, params.bandwidth_bytes_per_s, params.latency_s)


def model_of(state: ElasticState, job: JobState) -> JobModel | None:
    """What the policy knows of a job's scaling: its per-layer profile, else what it declared."""
    model = state.models.get(job.job)
    if model is None and job.spec.scaling is not None:
        declared = job.spec.scaling
        model = usable_model(declared.compute_per_sample_s, declared.grad_bytes)
    return model


def global_batch(job: JobState, workers: int) -> int:
    elastic = job.spec.elastic
    assert elastic is not None
    if elastic.global_batch is not None and elastic.lr_scaling is None:
        return elastic.global_batch
    return workers * (elastic.micro_batch or 1)  # the batch grows with the workers (an LR-scaling rule)


def predicted_throughput(
    job: JobState, workers: int, model: JobModel | None, params: ElasticParams, measured: dict[int, float]
) -> float:
    """Samples per second at ``workers`` (relative units when nothing was measured or profiled);
    ``measured``: the job's throughput at the sizes it ran at."""
    if workers in measured:
        return measured[workers]
    grad_bytes = model.grad_bytes if model is not None else 0
    per_sample = model.compute_per_sample_s if model is not None else None
    if measured:
        nearest = min(measured, key=lambda w: (abs(w - workers), w))
        batch = global_batch(job, nearest)
        compute = batch / measured[nearest] - allreduce_s(grad_bytes, nearest, params)
        per_sample = max(compute, 1e-12) * nearest / batch
    if per_sample is None:
        return float(workers)  # nothing known: linear
    batch = global_batch(job, workers)
    return batch / (per_sample * batch / workers + allreduce_s(grad_bytes, workers, params))


def _free(state: ElasticState, job: JobState) -> int:
    """Free GPUs on nodes that take work and can run the job (processes for a command)."""
    wants_processes = job.spec.command is not None
    return sum(
        len(n.free_gpus()) for n in state.nodes.values() if n.accepts_work() and n.runs_processes() == wants_processes
    )


def _may_rescale(job: JobState, now: float, params: ElasticParams) -> bool:
    return job.rescaled_at is None or now - job.rescaled_at >= params.min_interval_s


def resizable(state: ElasticState, rules: int = ev.ELASTIC_RULES) -> list[JobState]:
    """Running elastic jobs with no rescale in flight, no dead worker to recover from, and (rules 3)
    not stopping (cancelled, preempted, past its time limit: its GPUs free as it ends)."""
    jobs = state.jobs
    return [
        j
        for j in (jobs[job] for job in state.elastic_active)  # (the placed and running elastic jobs, indexed)
        if j.status == "running" and j.rescale is None and not j.lost_workers and not (rules >= 3 and j.stopping())
    ]


def next_due(state: ElasticState, params: ElasticParams, rules: int = ev.ELASTIC_RULES) -> float | None:
    """When time alone next changes what the policy may decide (None: nothing waits on time): a
    proposal the scheduler did not act on may be made again, and a job below its largest size may
    grow once its minimum interval, its hold after a shrink and its start's grace have passed (rules
    1: only while nothing waits; from rules 2 idle GPUs no waiting job can use are lent while jobs
    wait). Between these moments a decision on the same state decides the same."""
    now, due = state.now, math.inf
    for job in resizable(state, rules):
        proposal = state.proposed.get(job.job)
        if proposal is not None and proposal[0] == job.generation:
            due = min(due, proposal[1] + params.retry_s)
        if (rules < 2 and state.queue) or _size(job) >= max(job.spec.elastic.sizes()):  # type: ignore[union-attr]
            continue
        ready = max(
            job.rescaled_at + params.min_interval_s if job.rescaled_at is not None else -math.inf,
            state.shrunk_at.get(job.job, -math.inf) + params.hold_after_shrink_s,
            job.started_at + params.grow_after_start_s if job.started_at is not None else -math.inf,
        )
        if ready > now:
            due = min(due, ready)
    if due <= now:  # (a retry already due: the next decision makes it)
        return None
    return None if math.isinf(due) else due


def decide(state: ElasticState, params: ElasticParams, rules: int = ev.ELASTIC_RULES) -> list[ev.RescaleProposed]:
    """The proposals for this state (at most one per job), by the policy's ``rules``."""
    if rules < 2:
        return _decide_v1(state, params)
    now, proposed = state.now, state.proposed
    jobs = [
        j
        for j in resizable(state, rules)
        if not (proposed.get(j.job, (-1, 0.0))[0] == j.generation and now - proposed[j.job][1] < params.retry_s)
    ]
    if not jobs:
        return []
    held_back = _HeldBack(state) if rules >= 4 else None
    waiting = (  # (read until no help is left)
        job
        for job in (state.jobs[j] for j in state.queue)
        if not job.cancel_requested and not (held_back is not None and held_back(job))
    )
    sizes = {j.job: _size(j) for j in jobs}
    limits = UserLimits(state, jobs, sizes) if rules >= 5 else None
    reasons: dict[str, str] = {}
    room = _quota_room(state)
    idle = _shrink_for_waiting(state, waiting, jobs, sizes, reasons, room, params, limits)
    growable = [j for j in jobs if j.job not in reasons and _may_rescale(j, now, params)]
    expected = _lend(state, growable, idle, room, sizes, reasons, params, limits)
    return [
        _proposal(job, sizes[job.job], reasons[job.job], expected=expected.get(job.job), rules=rules)
        for job in jobs
        if job.job in reasons
    ]


def _not_ended(job: JobState) -> bool:
    return job.status == "pending" or job.status in ACTIVE


class _HeldBack:
    """Rules 4: whether the scheduler holds a waiting job back whatever GPUs are free: a dependency
    not met yet, or its array's ``max_running`` reached (it is never the scheduler's head). No shrink
    helps such a job, and no idle GPU is kept for it. The fold keeps no ended job: a dependency it no
    longer knows has ended, and the scheduler starts the job or settles it as can never be met."""

    def __init__(self, state: ElasticState) -> None:
        self.state = state
        self._arrays: dict[str, list[JobState]] | None = None  # array id -> its elements not ended

    def _elements(self, array: str) -> list[JobState]:
        if self._arrays is None:  # (built once a waiting job names an array)
            self._arrays = {}
            for job in self.state.jobs.values():
                if job.spec.array_of is not None and _not_ended(job):
                    self._arrays.setdefault(job.spec.array_of.array, []).append(job)
        return self._arrays.get(array, [])

    def _unmet(self, kind: str, dep: str) -> bool:
        """Whether dependency ``kind:dep`` is not met yet (``after``: placed once; the rest: ended)."""
        found = self.state.jobs.get(dep)
        jobs = [found] if found is not None and _not_ended(found) else self._elements(dep)
        if kind == "after":
            return any(j.first_placed_at is None for j in jobs)
        return bool(jobs)

    def __call__(self, job: JobState) -> bool:
        deps = job.spec.depends_on
        if deps is not None and any(self._unmet(kind, dep) for kind, ids in deps.kinds() for dep in ids):
            return True
        member = job.spec.array_of
        if member is None or member.max_running is None:
            return False
        active = self.state.active
        return sum(1 for j in self._elements(member.array) if j.job in active) >= member.max_running


class UserLimits:
    """Rules 5: a VC's per-user limits as the scheduler holds a waiting job back by them
    (``services/scheduler/holds.py``): a user may have at most ``max_running_per_user`` jobs placed
    or running in the VC, holding at most ``max_gpus_per_user`` GPUs. Counted from the log alone
    (the fold's placed and running jobs and the GPUs each holds), plus what this round decides: the
    sizes it gives the resizable jobs (``sizes``, shrinks and grows alike) and the waiting jobs it
    lets start (``started``), as the scheduler's pass counts its own placements."""

    def __init__(self, state: ElasticState, resizable: list[JobState], sizes: dict[str, int]) -> None:
        self.state, self.resizable, self.sizes = state, resizable, sizes
        self.limited = {
            name
            for name, vc in state.vcs.items()
            if vc.max_gpus_per_user is not None or vc.max_running_per_user is not None
        }
        # (VC, user) -> [jobs placed or running, GPUs they hold], and the resizable jobs of each:
        # counted once a limited VC's job asks (most clusters have no per-user limit: nothing is counted)
        self._counts: dict[tuple[str, str], list[int]] | None = None
        self._own: dict[tuple[str, str], list[JobState]] = {}

    def _count(self, job: JobState) -> list[int]:
        if self._counts is None:
            self._counts = {}
            for active in self.state.active_jobs():
                if active.spec.vc in self.limited:
                    count = self._counts.setdefault((active.spec.vc, active.spec.user), [0, 0])
                    count[0] += 1
                    count[1] += active.held  # (the scheduler's count: what is released counts until freed)
            for resizable in self.resizable:
                if resizable.spec.vc in self.limited:
                    self._own.setdefault((resizable.spec.vc, resizable.spec.user), []).append(resizable)
        return self._counts.setdefault((job.spec.vc, job.spec.user), [0, 0])

    def own_jobs(self, job: JobState) -> list[JobState]:
        """The resizable elastic jobs of ``job``'s user in its VC: only their shrinks give back what
        its user's GPU limit counts."""
        self._count(job)
        return self._own.get((job.spec.vc, job.spec.user), [])

    def running_limit_reached(self, job: JobState) -> bool:
        """``job``'s user already has as many jobs placed or running in its VC as it allows: no
        shrink lets it start."""
        vc = self.state.vcs.get(job.spec.vc)
        if vc is None or vc.max_running_per_user is None:
            return False
        return self._count(job)[0] >= vc.max_running_per_user

    def gpu_room(self, job: JobState) -> int | None:
        """GPUs ``job``'s user may still take in its VC after this round's resizes (None: no limit)."""
        vc = self.state.vcs.get(job.spec.vc)
        if vc is None or vc.max_gpus_per_user is None:
            return None
        resized = sum(self.sizes[j.job] - _size(j) for j in self.own_jobs(job))
        return vc.max_gpus_per_user - self._count(job)[1] - resized

    def started(self, job: JobState) -> None:
        """This round lets waiting ``job`` start: it counts against its user's limits from now on."""
        if job.spec.vc in self.limited:
            count = self._count(job)
            count[0] += 1
            count[1] += job.spec.gpus  # (what the scheduler's pass counts for a placement)


def _kind(job: JobState) -> bool:
    """The executor kind a job runs on: processes (a command) or not (a sim job)."""
    return job.spec.command is not None


def _size(job: JobState) -> int:
    """The GPUs (workers) a job holds: one worker per GPU (``len(job.workers)`` without naming them)."""
    return sum(len(a.gpus) for a in job.allocations)


def _quota_room(state: ElasticState) -> dict[str, int | None]:
    """Each VC's quota left (None: it may borrow, or has no quota)."""
    if all(vc.gpu_quota is None or vc.can_borrow for vc in state.vcs.values()):
        return {}  # (no VC is bounded: nothing to count)
    used: dict[str, int] = {}
    for job in state.active_jobs():
        used[job.spec.vc] = used.get(job.spec.vc, 0) + (job.held or len(job.allocations))
    return {
        name: (vc.gpu_quota - used.get(name, 0) if vc.gpu_quota is not None and not vc.can_borrow else None)
        for name, vc in state.vcs.items()
    }


def _rate(state: ElasticState, job: JobState, workers: int, params: ElasticParams) -> float:
    return predicted_throughput(job, workers, model_of(state, job), params, state.throughput.get(job.job, {}))


def _shrink_for_waiting(
    state: ElasticState,
    waiting: Iterable[JobState],
    jobs: list[JobState],
    sizes: dict[str, int],
    reasons: dict[str, str],
    room: dict[str, int | None],
    params: ElasticParams,
    limits: UserLimits | None = None,
) -> dict[bool, int]:
    """Rule 1: the shrinks that let waiting jobs start (into ``sizes`` and ``reasons``; the quota they
    take from ``room``; with ``limits``, rules 5, what they take of their users' limits); the free
    GPUs left idle after them, by kind."""
    free = {kind: 0 for kind in (True, False)}
    for node in state.nodes.values():
        if node.accepts_work():
            free[node.runs_processes()] += len(node.free_gpus())
    lowest = {j.job: min(j.spec.elastic.sizes()) for j in jobs}  # type: ignore[union-attr]

    def by_vc() -> dict[tuple[bool, str], int]:
        """GPUs each VC's elastic jobs of each kind can still give back."""
        out: dict[tuple[bool, str], int] = {}
        for j in jobs:
            key = (_kind(j), j.spec.vc)
            out[key] = out.get(key, 0) + sizes[j.job] - lowest[j.job]
        return out

    spare_vc = by_vc()
    spare = {kind: sum(n for (k, _), n in spare_vc.items() if k == kind) for kind in (True, False)}
    for head in waiting:
        if all(free[k] <= 0 and spare[k] <= 0 for k in spare):
            break  # nothing free and nothing left to shrink: no later job can be helped (a long queue is not read)
        kind = _kind(head)
        need = head.spec.elastic.min if head.spec.elastic is not None else head.spec.gpus
        vc_room = room.get(head.spec.vc)
        if limits is not None and head.spec.vc in limits.limited:
            if limits.running_limit_reached(head):
                continue  # its user runs all the jobs the VC allows: no shrink lets it start, none is kept
            user_room = limits.gpu_room(head)
            if user_room is not None and user_room < head.spec.gpus:
                # Its user's GPU limit stops it: only that user's own elastic jobs in its VC give back
                # what the limit counts (another user's shrink only leaves GPUs idle).
                own = [j for j in limits.own_jobs(head) if _kind(j) == kind]
                own_spare = sum(sizes[j.job] - lowest[j.job] for j in own)
                quota_stops = vc_room is not None and vc_room + spare_vc.get((kind, head.spec.vc), 0) < need
                if quota_stops or user_room + own_spare < head.spec.gpus:
                    continue  # it waits for its user's (or its VC's) jobs to end: nothing shrinks or is kept
                taken = _give_back(state, own, sizes, reasons, head.spec.gpus - user_room, head, params)
                free[kind] += taken
                spare[kind] -= taken
                spare_vc[kind, head.spec.vc] -= taken
                if vc_room is not None:
                    vc_room += taken  # (they give its VC's quota back too)
        if vc_room is not None and vc_room < need:
            # Its VC's quota stops it: only its own VC's elastic jobs give back quota with their GPUs.
            if vc_room + spare_vc.get((kind, head.spec.vc), 0) < need:
                continue  # even then its quota stops it: it waits for its VC's own jobs to end
            peers = [j for j in jobs if _kind(j) == kind and j.spec.vc == head.spec.vc]
            quota_need = need - vc_room
            taken = _give_back(state, peers, sizes, reasons, quota_need, head, params)
            room[head.spec.vc] = vc_room + taken - need
            free[kind] += taken
            spare[kind] -= taken
            spare_vc[kind, head.spec.vc] -= taken
        elif vc_room is not None:
            room[head.spec.vc] = vc_room - need
        lacking = need - free[kind]
        if lacking > 0:
            if spare[kind] < lacking:
                # It waits for more than shrinks can give now, gathering the GPUs that free up (the
                # scheduler's reservation): what is free now is kept for it, not lent away.
                free[kind] = 0
                continue
            peers = [j for j in jobs if _kind(j) == kind]
            given = _give_back(state, peers, sizes, reasons, lacking, head, params)
            free[kind] += given
            spare[kind] -= given
            spare_vc = by_vc()  # (its shrinks may be of any VC's jobs)
        free[kind] -= need
        if limits is not None:
            limits.started(head)  # (a later job of its user counts it, as the scheduler's pass does)
    return free


def _give_back(
    state: ElasticState,
    jobs: list[JobState],
    sizes: dict[str, int],
    reasons: dict[str, str],
    need: int,
    head: JobState,
    params: ElasticParams,
) -> int:
    """Shrink ``jobs``, one allowed size at a time, the least throughput lost per GPU first, until
    ``need`` GPUs are given back (or none can give more); the GPUs given back."""
    given = 0
    while given < need:
        best = None
        for job in jobs:
            size = sizes[job.job]
            smaller = [s for s in job.spec.elastic.sizes() if s < size]  # type: ignore[union-attr]
            if not smaller:
                continue
            target = max(smaller)
            now_rate = _rate(state, job, size, params)
            lost = (now_rate - _rate(state, job, target, params)) / (size - target) / max(now_rate / size, 1e-12)
            key = (lost, job.job)
            if best is None or key < best[0]:
                best = (key, job, target)
        if best is None:
            break
        _, job, target = best
        before = _size(job)
        given += sizes[job.job] - target
        sizes[job.job] = target
        reasons[job.job] = f"shrink {before} -> {target} GPUs: {head.job} waits for {head.spec.gpus}"
    return given


def _lend(
    state: ElasticState,
    jobs: list[JobState],
    idle: dict[bool, int],
    room: dict[str, int | None],
    sizes: dict[str, int],
    reasons: dict[str, str],
    params: ElasticParams,
    limits: UserLimits | None = None,
) -> dict[str, float]:
    """Rule 2: idle GPUs first give jobs shrunk below the GPUs they asked for their GPUs back (what
    they gain most per GPU first, whatever the efficiency: those GPUs are theirs), then go to the
    jobs that gain most per GPU beyond it, one allowed size at a time (into ``sizes`` and
    ``reasons``), within their VC's quota and (``limits``, rules 5) their user's GPU limit; the
    predicted throughput of each job grown."""
    now = state.now
    candidates = [
        j
        for j in jobs
        if now - state.shrunk_at.get(j.job, -1e18) >= params.hold_after_shrink_s
        and (j.started_at is None or now - j.started_at >= params.grow_after_start_s)
    ]
    expected: dict[str, float] = {}
    while True:
        best = None
        for job in candidates:
            size = sizes[job.job]
            quota = room.get(job.spec.vc)
            spare = idle[_kind(job)] if quota is None else min(idle[_kind(job)], quota)  # (within its VC's quota)
            user_room = limits.gpu_room(job) if limits is not None else None
            if user_room is not None:
                spare = min(spare, user_room)  # (the scheduler refuses a grow past its user's GPU limit)
            larger = [s for s in job.spec.elastic.sizes() if size < s <= size + spare]  # type: ignore[union-attr]
            if not larger:
                continue
            target = min(larger)
            now_rate = _rate(state, job, size, params)
            rate = _rate(state, job, target, params)
            gain = (rate - now_rate) / (target - size) / max(now_rate / size, 1e-12)
            owed = target <= job.spec.gpus  # back towards what it asked for
            worth = (rate - now_rate) * params.min_interval_s > now_rate * params.grow_pause_s
            if worth and ((owed and gain > 0) or gain >= params.grow_efficiency):
                key = (not owed, -gain, job.job)
                if best is None or key < best[0]:
                    best = (key, job, target, rate)
        if best is None:
            break
        _, job, target, rate = best
        idle[_kind(job)] -= target - sizes[job.job]
        if room.get(job.spec.vc) is not None:
            room[job.spec.vc] -= target - sizes[job.job]  # type: ignore[operator]
        sizes[job.job] = target
        expected[job.job] = rate
        why = "back towards the GPUs it asked for" if target <= job.spec.gpus else "into idle GPUs"
        reasons[job.job] = f"grow {_size(job)} -> {target} GPUs {why} (predicted {rate:.0f} samples/s)"
    return expected


# -- rules 1 ------------------------------------------------------------------------------------------


def _decide_v1(state: ElasticState, params: ElasticParams) -> list[ev.RescaleProposed]:
    now, proposed = state.now, state.proposed
    jobs = [
        j
        for j in resizable(state, rules=1)
        if _may_rescale(j, now, params)
        and not (proposed.get(j.job, (-1, 0.0))[0] == j.generation and now - proposed[j.job][1] < params.retry_s)
    ]
    if not jobs:
        return []
    waiting = [
        state.jobs[j] for j in state.queue if state.jobs[j].spec.elastic is None and not state.jobs[j].cancel_requested
    ]
    if waiting:
        return _shrink_for(state, waiting[0], jobs, params)
    return _grow_into_idle(state, jobs, params)


def _shrink_for(
    state: ElasticState, head: JobState, jobs: list[JobState], params: ElasticParams
) -> list[ev.RescaleProposed]:
    wants_processes = head.spec.command is not None
    need = head.spec.gpus - _free(state, head)
    if need <= 0:
        return []  # it waits for something a shrink cannot give (quota, shape, a reservation)
    vc = state.vcs.get(head.spec.vc)
    quota_bound = vc is not None and vc.gpu_quota is not None and not vc.can_borrow
    options = []
    for job in jobs:
        if (job.spec.command is not None) != wants_processes or (quota_bound and job.spec.vc != head.spec.vc):
            continue
        size = _size(job)
        smaller = [s for s in job.spec.elastic.sizes() if s < size]  # type: ignore[union-attr]
        if not smaller:
            continue
        enough = [s for s in smaller if s <= size - need]
        target = max(enough) if enough else min(smaller)  # all it can give, if it cannot give all that is needed
        model, measured = state.models.get(job.job), state.throughput.get(job.job, {})
        rate_now = predicted_throughput(job, size, model, params, measured)
        lost = rate_now - predicted_throughput(job, target, model, params, measured)
        per_gpu_now = rate_now / size
        options.append((lost / (size - target) / max(per_gpu_now, 1e-12), job.job, job, target))
    out = []
    for _, _, job, target in sorted(options):
        if need <= 0:
            break
        size = _size(job)
        out.append(
            _proposal(job, target, f"shrink {size} -> {target} GPUs: {head.job} waits for {head.spec.gpus}", rules=1)
        )
        need -= size - target
    return out


def _grow_into_idle(state: ElasticState, jobs: list[JobState], params: ElasticParams) -> list[ev.RescaleProposed]:
    options = []
    for job in jobs:
        if state.now - state.shrunk_at.get(job.job, -1e18) < params.hold_after_shrink_s:
            continue
        if job.started_at is not None and state.now - job.started_at < params.grow_after_start_s:
            continue
        size = _size(job)
        free = _free(state, job)
        larger = [s for s in job.spec.elastic.sizes() if size < s <= size + free]  # type: ignore[union-attr]
        model, measured = state.models.get(job.job), state.throughput.get(job.job, {})
        now_rate = predicted_throughput(job, size, model, params, measured)
        best = None
        for target in sorted(larger, reverse=True):
            rate = predicted_throughput(job, target, model, params, measured)
            if rate / target >= params.grow_efficiency * now_rate / size and rate > now_rate:
                best = (target, rate)
                break
        if best is not None:
            target, rate = best
            gain_per_gpu = (rate - now_rate) / (target - size) / max(now_rate / size, 1e-12)
            options.append((-gain_per_gpu, job.job, job, target, rate))
    out = []
    taken = 0
    for _, _, job, target, rate in sorted(options):
        size = _size(job)
        if target - size > _free(state, job) - taken:
            continue
        taken += target - size
        reason = f"grow {size} -> {target} GPUs into idle GPUs (predicted {rate:.0f} samples/s)"
        out.append(_proposal(job, target, reason, expected=rate, rules=1))
    return out


def _proposal(
    job: JobState, gpus: int, reason: str, *, expected: float | None = None, rules: int
) -> ev.RescaleProposed:
    return ev.RescaleProposed(
        job=job.job,
        attempt=job.attempt,
        generation=job.generation,
        gpus=gpus,
        reason=reason,
        expected_samples_per_s=expected,
        rules=rules,
    )
