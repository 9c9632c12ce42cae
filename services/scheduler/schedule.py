"""One scheduling pass: which waiting jobs start now, which running jobs are preempted for
them, and why every other waiting job waits.

The pass is a pure function of the state and the policy. The decider turns
its placements and preemptions into events, and ``gpuherd why`` prints its
pending reasons: both come from this one computation, so the reason shown
is the reason the scheduler acted on.

It runs in numbered phases, one function each (the shape of Kueue's scheduling cycle):

1. **candidates**: the waiting jobs in the policy's order (a deep queue is pruned of jobs whose
   VC's quota is used up, unless every reason is wanted); a job its dependencies, its array's
   ``max_running`` or its VC's per-user limits hold back takes no part in the pass (``holds.py``);
2. **quota**: its VC's GPUs in use plus its own must stay within the VC's quota, unless the VC
   may borrow idle GPUs (the borrowed count is recorded in ``JobPlaced.borrowed``; what is
   reclaimable is the VC's usage beyond its quota now, held by its newest placements:
   ``SchedulerState.borrowing``). A job that must borrow is considered after the jobs that fit
   within their VC's quota (``consider_borrowers``): lent GPUs go back to their owner's jobs
   first. The first job of a VC that its quota stops is that VC's *quota head*, protected as the
   gang head is: its start is reserved at the earliest time enough of the VC's quota frees up by
   the expected ends of the VC's running jobs, and a later job of that VC starts only if it ends
   before then, or uses quota the quota head will not need then. When an end it depends on is
   unknown, or backfill is off, nothing of its VC overtakes it;
3. **placement**: its whole gang must fit (``placement.py``); the first job that does not fit
   becomes the *head*, and its start is reserved (EASY backfill) at the earliest time enough GPUs
   free up by the expected ends of running jobs;
4. **reservation**: a job behind the head may start now only if it ends before the head's
   reserved start, or uses GPUs the head will not need then. For a gang split over nodes, its start
   is when enough nodes each have its per-node share free, and what it needs then is nodes: a job
   that runs past its start must leave it enough of them, and is placed off the nodes kept for it
   when its best placement would not (``NodeHold``). When any duration involved is unknown there
   is no reservation time, and nothing overtakes the head (conservative). With backfill off,
   nothing overtakes the head either;
5. **commit**: the placement takes its GPUs from the pass's views, gets a rendezvous, and is
   recorded as ``JobPlaced``;
6. **preemption**: the first waiting job that does not fit (the head) may take GPUs of running
   jobs it outranks: a lower priority, a job the policy says it outranks (SRTF, LAS), or, while
   the waiting job's VC is within its quota, a job that borrows now (of a VC over its quota).
   Before it, the first job of each VC that its quota stops may take GPUs of its own VC's jobs it
   outranks, which frees the quota too (a VC run as a partition still preempts within itself).
   Victims: lowest priority first, then least work lost (shortest time since start), then the
   youngest; only as many as the gang needs; a job is preempted at most
   ``max_preemptions_per_hour`` times in an hour, and gets ``preemption_grace_s`` to checkpoint
   (both cluster parameters of ``PolicyConfigured``; see
   ``services/scheduler/state.py:CLUSTER_PARAMS``).

A pass that ``explains`` gives every waiting job its reason (``gpuherd why``). The decider's own
passes do not: they decide the same, but stop early once nothing more can start (``_done``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from gpuherd import events as ev
from gpuherd.fold import JobState, NodeState
from services.scheduler.holds import Holds
from services.scheduler.placement import (
    IslandIndex,
    NodeView,
    Placement,
    ViewCache,
    can_run,
    fits_by_count,
    pass_views,
    place,
)
from services.scheduler.policy import Policy
from services.scheduler.ranks import KeptOrder, RankIndex
from services.scheduler.state import SchedulerState

MAX_VICTIMS = 64  # a gang that needs more victims than this waits instead

PendingKind = Literal[
    "quota",
    "gang",
    "powered-down",
    "drained",
    "no-node",
    "order",
    "reserved",
    "depth",
    "preempting",
    "cancelling",
    "dependency",
    "array limit",
    "user limit",
]

# How many waiting jobs behind the head (the first that does not fit) a pass looks at for
# backfill; the rest wait for a later pass, when the queue has moved (Slurm's bf_max_job_test).
# It bounds a pass over a deep queue: without it every freed GPU costs a walk of the whole queue.
BACKFILL_DEPTH = 1000


class Pending(msgspec.Struct, frozen=True):
    """Why a job waits, and where it stands in the policy's order (1 = next)."""

    kind: PendingKind
    detail: str
    position: int


class Plan(msgspec.Struct, kw_only=True):
    placed: list[ev.JobPlaced] = msgspec.field(default_factory=list)
    preempted: list[ev.JobPreempted] = msgspec.field(default_factory=list)
    pending: dict[str, Pending] = msgspec.field(default_factory=dict)
    head: str | None = None  # the job whose start is reserved
    reserved_at: float | None = None


@dataclass
class QuotaHold:
    """A VC's quota head and its reservation: when enough of the VC's ``quota`` frees up for it (None:
    an end it depends on is unknown), and how much quota it will not need then. Reserved when a
    later job of its VC first asks (most passes meet no such job)."""

    job: JobState
    quota: int
    reserved: bool = False
    reserved_at: float | None = None
    spare: int = 0


@dataclass
class NodeHold:
    """The head's reservation for a gang split over nodes (rules 14): GPUs free at its reserved start
    on each node that can run it (``free_at``), and how many of those hold its per-node share. A job
    behind it that runs past that start may use any GPUs that leave ``wanted`` such nodes."""

    per_node: int
    wanted: int  # nodes the head needs
    free_at: dict[str, int]
    qualifying: int  # nodes of ``free_at`` with at least ``per_node``
    kept: frozenset[str]  # ``wanted`` of those, where a backfill job goes only if nowhere else

    def shortens(self, placement: Placement) -> bool:
        """Whether taking ``placement``'s GPUs until after the start leaves too few nodes for the head."""
        return self.qualifying - self._lost(placement) < self.wanted

    def take(self, placement: Placement) -> None:
        self.qualifying -= self._lost(placement)
        for alloc in placement.allocations:
            if alloc.node in self.free_at:
                self.free_at[alloc.node] -= len(alloc.gpus)

    def _lost(self, placement: Placement) -> int:
        """Nodes that would fall below the per-node share at the start."""
        lost = 0
        for alloc in placement.allocations:
            before = self.free_at.get(alloc.node)
            if before is not None and before >= self.per_node > before - len(alloc.gpus):
                lost += 1
        return lost


@dataclass
class Pass:
    """What one pass works with, and what it has decided so far."""

    state: SchedulerState
    policy: Policy
    backfill: bool
    skip: frozenset[str] | set[str]
    explain: bool
    free: dict[str, NodeView]  # the views; copied at the first placement, which shrinks them
    free_total: dict[bool, int]  # free GPUs by executor kind (runs processes or not)
    index: IslandIndex
    vc_used: dict[str, int]
    holds: Holds
    ranks: RankIndex | None = None  # the order kept between passes (static or timed ranks), or None: sort
    victimless: VictimMemo | None = None  # quota heads that outranked no job of their VC, kept between passes
    reading: KeptOrder | None = None  # the pass's reading of the kept order (it may set VCs aside)
    smallest: dict[str, int] = field(default_factory=dict)  # VC -> the fewest GPUs a waiting job of it asks
    out: Plan = field(default_factory=Plan)
    extra: int = 0  # GPUs the head will not need at its reserved start (for a ``node_hold``, at most that many)
    node_hold: NodeHold | None = None  # the head's nodes at its reserved start, for a gang split over nodes
    failed_beside: set[tuple] = field(default_factory=set)  # shapes no placement off the head's nodes lets start
    ports: dict[str, set[int]] | None = None  # rendezvous ports in use, once a placement needs one
    # Free GPUs only shrink during a pass, so a gang shape that did not fit will not fit later in
    # it, and why it does not fit (no node, drained) depends on the shape alone: both are memoized.
    failed: set[tuple] = field(default_factory=set)
    # Shapes that fit the free GPUs as they are now (forgotten at each placement, which takes GPUs):
    # a job behind the head that would delay it needs no placement computed to be told so.
    fits: set[tuple] = field(default_factory=set)
    why_not: dict[tuple, tuple[PendingKind, str]] = field(default_factory=dict)
    quota_heads: dict[str, tuple[int, JobState]] = field(default_factory=dict)  # VC -> first job its quota stops
    quota_holds: dict[str, QuotaHold] = field(default_factory=dict)  # VC -> its quota head's reservation
    placed_by_vc: dict[str, list[JobState]] = field(default_factory=dict)  # this pass's placements
    behind_head: int = 0
    # Nothing behind the head can start (backfill off) and nothing reads why those jobs wait (no
    # explanations, and no node asleep for ``wake_up`` to count their demand): the pass ends at the head,
    # and passes over a VC's jobs behind its quota head (``_behind_quota_head``).
    ends_at_head: bool = False
    replaced: dict[str, NodeView] = field(default_factory=dict)  # views the pass replaced: put back after it
    borrowers: list[tuple[int, JobState]] = field(default_factory=list)  # (position, job): must borrow

    @property
    def any_free(self) -> bool:
        return any(self.free_total.values())

    def wait(self, job: JobState, kind: PendingKind, detail: str, position: int) -> None:
        self.out.pending[job.job] = Pending(kind, detail, position)


def plan(
    state: SchedulerState,
    policy: Policy,
    *,
    backfill: bool = True,
    skip: frozenset[str] | set[str] = frozenset(),
    cache: ViewCache | None = None,
    ranks: RankIndex | None = None,
    victimless: VictimMemo | None = None,
    explain: bool = True,
) -> Plan:
    """The pass. ``explain=False`` (the decider's own passes) decides the same, faster: it does not
    look at jobs of VCs whose quota is used up, and stops looking once nothing more can start and
    the head is known; those jobs get no pending reason. ``cache``, ``ranks`` and ``victimless``,
    kept by a decider between its passes, spare it the node views, the queue's order and the
    preemption scans that did not change."""
    if not state.queue:
        return Plan()
    free, free_total, index = cache.refresh(state) if cache is not None else pass_views(state)
    work = Pass(state, policy, backfill, skip, explain, free, free_total, index, state.vc_usage(), Holds(state))
    # (Under FIFO too, although its queue is its order: with quotas, most of the queue may wait in
    # VCs whose quota is used up or holds them back. A pass reading the queue read those one by one,
    # about a fifth of a FIFO simulation of philly; one reading the kept per-VC orders leaves them out.)
    if ranks is not None and ranks.refresh(state, policy):
        work.ranks = ranks
    if victimless is not None and victimless.holds_for(state, policy):
        work.victimless = victimless
    work.ends_at_head = not (backfill or explain or cache is None or cache.asleep)
    out, skip = work.out, work.skip
    index.begin_pass(work.replaced)
    try:
        for position, job in enumerate(candidates(work), 1):
            if out.head is not None:
                step = _beyond_head(work, job, position)
                if step == "stop":
                    break
                if step == "skip":
                    continue
            if job.job in skip:
                continue
            if not work.explain and job.spec.vc in work.quota_holds:
                step = _behind_quota_head(work, job)
                if step == "stop":
                    break
                if step == "skip":
                    continue
            if job.cancel_requested:
                work.wait(job, "cancelling", "cancel requested", position)
                continue
            held = work.holds.check(job)
            if held is not None:
                if work.explain:
                    work.wait(job, *held, position)
                continue
            borrowed = check_quota(work, job, position)
            if borrowed and work.state.scheduling.rules >= 8:
                work.borrowers.append((position, job))  # (considered once the jobs within their quota were)
            elif borrowed is not None:
                consider(work, job, position, borrowed)
        consider_borrowers(work)
        preempt(work)
        return work.out
    finally:
        free.update(work.replaced)  # the views as the pass found them (the cache's)
        index.end_pass()


def consider_borrowers(work: Pass) -> None:
    """Phase 2's end: the jobs that must borrow GPUs beyond their VC's quota, in the policy's order,
    once the jobs that fit within theirs were considered: GPUs lent are given back to their owner's
    waiting jobs first (as Kueue admits workloads that borrow after those that do not). Otherwise a
    job preempted to give a VC its quota back ranks again ahead of the job it was preempted for, and
    borrows the same GPUs again at once."""
    for position, job in work.borrowers:
        # (As behind the head in the pass's loop: where nothing more can start, the rest is not looked
        # at. Until the head is known, a borrower that does not fit may be it, and preempt.)
        if work.out.head is not None and (work.ends_at_head or not (work.explain or work.any_free)):
            break
        borrowed = check_quota(work, job, position)  # (again: its VC's jobs within quota may have started)
        if borrowed is not None:
            consider(work, job, position, borrowed)


def consider(work: Pass, job: JobState, position: int, borrowed: int) -> None:
    """Phases 3 to 5 for a waiting job its quota lets start: placement, reservation, commit."""
    shape = _shape(job)
    if shape in work.fits and work.out.head is not None and not _may_backfill(work, job):
        _delays_head(work, job, position)
        return
    placement = find_placement(work, job, shape, position)
    if placement is not None:
        placement = check_reservation(work, job, placement, shape, position)
    if placement is not None:
        commit(work, job, placement, borrowed)


# -- phase 1: candidates ------------------------------------------------------------------------------


def candidates(work: Pass) -> Iterable[JobState]:
    """The waiting jobs in the policy's order. Without explanations, the jobs of VCs whose quota has
    no room for even their smallest waiting job are left out (none of them can start), but each such
    VC's first job stays, as it may preempt within its VC (or by priority)."""
    state, policy, ranks = work.state, work.policy, work.ranks
    full = set() if work.explain else _full_vcs(state, work.vc_used)
    out = work.out

    def head_found() -> bool:
        return out.head is not None

    if not full:
        if ranks is None:
            return policy.order(state)
        work.reading = ranks.order(state, resume=head_found)
        return work.reading
    preempts = policy.preemptive or max(state.queued_priorities) > min(state.active_priorities, default=0)
    # Rules 11: a job held back (dependency, array or user limit) takes no part in the pass, so it may
    # not stand for its VC: the VC's first job is the first that is not held (before, a held first job
    # kept every job of its VC from preempting).
    unheld = work.state.scheduling.rules >= 11
    if ranks is not None:
        skip, holds = work.skip, work.holds

        def able(job: JobState) -> bool:
            return (
                job.job not in skip
                and not job.cancel_requested
                and not (unheld and holds.check(job) is not None)
                and not _beyond_quota(state, job)
            )

        firsts = [first for vc in full if (first := ranks.first(state, vc, able)) is not None] if preempts else []
        work.reading = ranks.order(state, without=full, keep=firsts, resume=head_found)
        return work.reading
    first_ids: list[str] = []
    if preempts:
        policy.prepare(state)
        jobs = state.jobs
        for vc in full:
            ids = [
                j
                for j in state.queued_by_vc[vc]
                if j not in work.skip and not jobs[j].cancel_requested and not _beyond_quota(state, jobs[j])
            ]
            if ids:
                first_ids.extend(
                    _first_unheld(work, ids) if unheld else [min(ids, key=lambda j: policy.rank(jobs[j], state))]
                )
    return policy.order_without(state, full, first_ids)


def _first_unheld(work: Pass, ids: list[str]) -> list[str]:
    """Of a VC's waiting ``ids``, the first in the policy's order that nothing holds back (none: no
    job). The first by rank is asked first: sorting them all is for a VC whose first is held."""
    state, policy, jobs = work.state, work.policy, work.state.jobs
    first = min(ids, key=lambda j: policy.rank(jobs[j], state))
    if work.holds.check(jobs[first]) is None:
        return [first]
    ranked = sorted(ids, key=lambda j: policy.rank(jobs[j], state))
    return next(([j] for j in ranked if work.holds.check(jobs[j]) is None), [])


def _beyond_head(work: Pass, job: JobState, position: int) -> Literal["consider", "skip", "stop"]:
    """Behind the head, whether ``job`` is looked at. Without explanations the pass stops once nothing
    can start (the head, the one to preempt for, is known) or once backfill has looked
    ``BACKFILL_DEPTH`` deep (without backfill, at the head); with them, the jobs beyond that depth are
    told why they wait."""
    out = work.out
    if work.ends_at_head or not (work.explain or work.any_free):
        return "stop"
    work.behind_head += 1
    if work.behind_head <= BACKFILL_DEPTH:
        return "consider"
    if not work.explain:
        return "stop"
    detail = f"more than {BACKFILL_DEPTH} jobs wait between it and {out.head}; later passes reach it"
    work.wait(job, "depth", detail, position)
    return "skip"


# -- phase 2: quota -------------------------------------------------------------------------------------


def _behind_quota_head(work: Pass, job: JobState) -> Literal["consider", "skip", "stop"]:
    """Without explanations, whether a job of a VC whose quota holds its first job back is looked at.
    Not if it cannot start whatever it would be told: backfill is off (nothing of the VC starts
    behind its quota head, and once every VC with waiting jobs is held so, the pass stops), or its
    VC's quota has no room left for it and the VC may not borrow. Nothing else reads such a job in
    a pass: it is not the quota head (already chosen), nor the gang head (it never reaches placement).
    Where none of the VC's later jobs can start either (its room only shrinks as the pass goes), the
    pass sets the VC aside until it finds its head (``KeptOrder``): until then a job passed over
    changes nothing but the positions the pass counts, which only order its candidates."""
    if work.ends_at_head:
        if len(work.quota_holds) == len(work.state.queued_by_vc):
            return "stop"
        if work.reading is not None:
            work.reading.set_aside(job.spec.vc)
        return "skip"
    vc = work.state.vcs[job.spec.vc]
    room = vc.gpu_quota - work.vc_used.get(vc.vc, 0)  # type: ignore[operator]  # (a held VC has a quota)
    if job.spec.gpus <= room or vc.can_borrow:
        return "consider"
    if work.reading is not None and work.out.head is None:
        smallest = work.smallest.get(vc.vc)
        if smallest is None:
            smallest = work.smallest[vc.vc] = min(work.state.queued_sizes[vc.vc])
        if smallest > room:
            work.reading.set_aside(vc.vc)
    return "skip"


def check_quota(work: Pass, job: JobState, position: int) -> int | None:
    """GPUs the job would borrow beyond its VC's quota, or None (with its reason) if the quota stops it:
    its VC's quota has no room for it, or the room it has is reserved for the VC's quota head."""
    spec = job.spec
    vc = work.state.vcs.get(spec.vc)
    if vc is None or vc.gpu_quota is None:
        return 0
    hold = work.quota_holds.get(vc.vc)
    if hold is not None and not _may_overtake(work, job, hold):
        _delays_quota_head(work, job, hold, position)
        return None
    over = work.vc_used.get(vc.vc, 0) + spec.gpus - vc.gpu_quota
    if over <= 0:
        return 0
    borrowed = min(over, spec.gpus) if vc.can_borrow else None
    if borrowed is None:
        if work.out.head is None and not _beyond_quota(work.state, job):
            work.quota_heads.setdefault(job.spec.vc, (position, job))
        # (A job larger than the whole quota, accepted before intake refused such jobs or left so by a
        # smaller quota, never starts: it holds nothing back.)
        if hold is None and work.state.scheduling.rules >= 2 and spec.gpus <= vc.gpu_quota:
            work.quota_holds[vc.vc] = QuotaHold(job, vc.gpu_quota)
        if work.explain:
            work.wait(job, "quota", _quota_detail(work.state, job, work.vc_used), position)
    return borrowed


# -- phase 3: placement ----------------------------------------------------------------------------------


def find_placement(work: Pass, job: JobState, shape: tuple, position: int) -> Placement | None:
    """Where the whole gang fits now, or None: then it waits with its reason, and the first job that
    does not fit becomes the head, its start reserved."""
    available = sum(n for flag, n in work.free_total.items() if can_run(job.spec, flag))
    placement = None
    if shape not in work.failed and _could_fit(job, work.free, available):
        placement = place(job.spec, work.free, work.index)
    if placement is not None:
        work.fits.add(shape)
        return placement
    if job.spec.elastic is not None and work.state.scheduling.rules >= 6:
        smaller = _smaller_placement(work, job, available)
        if smaller is not None:
            return smaller  # (its shape stays failed at the size it asked for)
    work.failed.add(shape)
    if shape not in work.why_not:
        work.why_not[shape] = _no_fit(work.state, job)
    kind, detail = work.why_not[shape]
    if kind == "gang":
        detail = _gang_detail(job, available)
    work.wait(job, kind, detail, position)
    out = work.out
    if kind == "gang" and out.head is None:
        out.head = job.job
        out.reserved_at, work.extra, work.node_hold = _reservation(work, job)
    return None


def _smaller_placement(work: Pass, job: JobState, available: int) -> Placement | None:
    """An elastic job that does not fit at the GPUs it asked for starts now at the largest of its
    sizes that fits (at least its minimum), rather than wait; the elastic service gives it the rest
    as GPUs free up."""
    spec = job.spec
    assert spec.elastic is not None
    for size in sorted((s for s in spec.elastic.sizes() if s < spec.gpus and s <= available), reverse=True):
        placement = place(msgspec.structs.replace(spec, gpus=size), work.free, work.index)
        if placement is not None:
            why = f"{placement.reason}; started on {size} of the {spec.gpus} GPUs it asked for (elastic)"
            return Placement(placement.allocations, placement.locality, why)
    return None


# -- phase 4: reservation ------------------------------------------------------------------------------


def check_reservation(work: Pass, job: JobState, placement: Placement, shape: tuple, position: int) -> Placement | None:
    """Behind the head, a job that fits starts only if it does not delay the head's reserved start:
    where it would (None), it waits. For a gang head split over nodes, a job that runs past that
    start must leave the head enough nodes then; if its best placement does not, it is placed
    beside the head's nodes."""
    if work.out.head is None:
        return placement
    if not _may_backfill(work, job):
        _delays_head(work, job, position)
        return None
    if _ends_in_time(work, job):
        return placement
    hold = work.node_hold
    if hold is not None and hold.shortens(placement):
        beside = _placement_beside(work, job, hold, shape)
        if beside is None or hold.shortens(beside):
            work.failed_beside.add(shape)  # (refusing is safe: each retry of a gang shape scans every node)
            _delays_head(work, job, position)
            return None
        placement = beside
    if hold is not None:
        hold.take(placement)
        work.extra -= sum(len(a.gpus) for a in placement.allocations)
    else:
        work.extra -= job.spec.gpus  # it takes GPUs the head will not need: fewer are spare now
    return placement


def _placement_beside(work: Pass, job: JobState, hold: NodeHold, shape: tuple) -> Placement | None:
    """The job's best placement off the nodes kept for the head, or None. (Free GPUs only shrink
    during a pass, and the kept nodes stay the same: a shape refused so is not placed again.)"""
    if shape in work.failed_beside:
        return None
    return place(job.spec, work.free, work.index, avoid=hold.kept)


# -- phase 5: commit -----------------------------------------------------------------------------------


def commit(work: Pass, job: JobState, placement: Placement, borrowed: int) -> None:
    """Take the placement's GPUs from the pass's views and record the job's ``JobPlaced``."""
    state = work.state
    work.fits.clear()
    for alloc in placement.allocations:
        used = set(alloc.gpus)
        view = work.free[alloc.node]
        work.replaced.setdefault(alloc.node, view)
        islands = tuple(t for t in (tuple(i for i in isl if i not in used) for isl in view.islands) if t)
        work.free[alloc.node] = NodeView(view.name, view.rack, islands, view.runs_processes)
        work.index.add(work.free[alloc.node])
        work.free_total[view.runs_processes] -= len(alloc.gpus)
    leader = placement.allocations[0].node
    if work.ports is None and state.nodes[leader].port_range is not None:
        work.ports = ports_in_use(state)  # only real nodes take a rendezvous port
    gpus = sum(len(a.gpus) for a in placement.allocations)  # (an elastic job may start smaller)
    work.vc_used[job.spec.vc] = work.vc_used.get(job.spec.vc, 0) + gpus
    work.placed_by_vc.setdefault(job.spec.vc, []).append(job)
    work.holds.placed(job)
    hold = work.quota_holds.get(job.spec.vc)
    if hold is not None and not _ends_before(work, job, hold.reserved_at):
        hold.spare -= gpus  # it holds quota past the quota head's start
    work.out.placed.append(
        ev.JobPlaced(
            job=job.job,
            attempt=job.attempt,
            allocations=placement.allocations,
            reason=placement.reason,
            locality=placement.locality,
            rendezvous=choose_rendezvous(state, job, leader, work.ports if work.ports is not None else {}),
            borrowed=borrowed,
        )
    )


# -- phase 6: preemption --------------------------------------------------------------------------------


def preempt(work: Pass) -> None:
    """Candidates, in policy order up to the head: each VC's first job its quota stops (it may take
    GPUs of its own VC's jobs it outranks, to free quota), then the head (GPUs of any job it
    outranks). The first candidate that can preempt does; one preemptor at a time."""
    state, policy, out = work.state, work.policy, work.out
    candidates = {job.job: position for position, job in work.quota_heads.values()}
    if out.head is not None:
        candidates[out.head] = out.pending[out.head].position
    if not candidates:
        return
    stopping_for = state.stopping_for
    lowest = min(state.active_priorities, default=0)
    lenders = any(vc.can_borrow for vc in state.vcs.values())
    for job in sorted((state.jobs[j] for j in candidates), key=lambda j: candidates[j.job]):
        position = candidates[job.job]
        is_head = job.job == out.head
        if job.job in stopping_for:
            out.pending[job.job] = Pending("preempting", "waits for the jobs it preempted to stop", position)
            return  # its victims' GPUs (and quota) are its reservation
        if not (policy.preemptive or job.spec.priority > lowest or (is_head and lenders)):
            if is_head:
                return
            continue  # nothing it could take: no lower priority, no policy ranking, no lent GPUs
        vc_used = work.vc_used
        over = 0 if is_head else vc_used.get(job.spec.vc, 0) + job.spec.gpus - state.vcs[job.spec.vc].gpu_quota
        victims = _victims(state, policy, job, vc_used, same_vc=not is_head, memo=work.victimless)
        chosen = _fewest_victims(job, victims, work.free, state, quota_over=over)
        if chosen:
            _record_preemption(state, policy, job, chosen, out, position, "its gang" if is_head else "its VC quota")
            return
        if is_head:
            return  # nothing ranked after the head may preempt: its start is the one reserved


# -- quotas -----------------------------------------------------------------------------------------


def _full_vcs(state: SchedulerState, vc_used: dict[str, int]) -> set[str]:
    """VCs with waiting jobs that may not borrow and have too little quota left for the smallest of
    them: none of their waiting jobs can start."""
    vcs = state.vcs
    # (A comprehension, not set.add per VC: this runs at every pass.)
    return {
        name
        for name, sizes in state.queued_sizes.items()
        if (vc := vcs.get(name)) is not None
        and vc.gpu_quota is not None
        and not vc.can_borrow
        and vc.gpu_quota - vc_used.get(name, 0) < min(sizes)
    }


# From these rules, a waiting job larger than its VC's whole quota (accepted before the quota was
# lowered) is not its VC's quota head: it can never start, and no preemption within its VC can make
# room for it. Before, it took the place of the VC's first job its quota can admit, which then never
# preempted within its VC (a job of a higher priority waited for as long as the VC's jobs ran).
OVERSIZED_NOT_QUOTA_HEAD_RULES = 12


def _beyond_quota(state: SchedulerState, job: JobState) -> bool:
    """The job asks for more GPUs than its VC's whole quota (which may not be borrowed beyond), and
    the rules in force know it cannot stand for its VC (``OVERSIZED_NOT_QUOTA_HEAD_RULES``)."""
    if state.scheduling.rules < OVERSIZED_NOT_QUOTA_HEAD_RULES:
        return False
    vc = state.vcs.get(job.spec.vc)
    return vc is not None and vc.gpu_quota is not None and not vc.can_borrow and job.spec.gpus > vc.gpu_quota


# From these rules, a quota head's reservation counts a job the same pass placed at the GPUs it was
# placed on. Before, at the GPUs it asked for: an elastic job started smaller gave back more quota at
# its end than it held, so the head's start looked nearer and its spare quota larger than they were,
# and a job let start on that spare held quota the head then needed.
PASS_PLACEMENT_SIZES_QUOTA_RULES = 13


def _reserve_quota(work: Pass, hold: QuotaHold) -> None:
    """When enough of its VC's quota frees up for the quota head (from the expected ends of the VC's
    running jobs and of those placed, by this pass or before, that have not started), and how much
    of the quota is spare then."""
    state, head = work.state, hold.job
    vc = head.spec.vc
    starting = [j for j in state.unstarted if state.jobs[j].spec.vc == vc]
    starting += [job.job for job in work.placed_by_vc.get(vc, ())]
    # (Placed by this pass, a job holds nothing yet in the state: what it was placed on.)
    sizes: dict[str, int] = {}
    if state.scheduling.rules >= PASS_PLACEMENT_SIZES_QUOTA_RULES:
        sizes = {p.job: sum(len(a.gpus) for a in p.allocations) for p in work.out.placed}
    room = hold.quota - work.vc_used.get(vc, 0)
    hold.reserved = True
    for end, job in _by_end(state, state.ends_by_vc.get(vc, ()), starting, _victims_stopping(state, head, vc)):
        if math.isinf(end):
            return  # an end it depends on is unknown: no reservation
        room += job.held or sizes.get(job.job, job.spec.gpus)
        if room >= head.spec.gpus:
            hold.reserved_at, hold.spare = max(end, state.now), room - head.spec.gpus
            return


def _may_overtake(work: Pass, job: JobState, hold: QuotaHold) -> bool:
    """Behind its VC's quota head, a job starts only if it ends before the quota head's reserved start
    or uses quota the quota head will not need then."""
    if not hold.reserved:
        _reserve_quota(work, hold)
    if hold.reserved_at is None or not work.backfill:
        return False  # (every job behind it in its VC: a deep queue asks this for each)
    return job.spec.gpus <= hold.spare or _ends_before(work, job, hold.reserved_at)


def _delays_quota_head(work: Pass, job: JobState, hold: QuotaHold, position: int) -> None:
    if not work.explain:
        return
    head = hold.job
    when = _reserved_when(work.state.now, hold.reserved_at)
    kind: PendingKind = "reserved" if work.backfill else "order"
    detail = f"would delay {head.job}, the first job of VC {head.spec.vc} its quota holds back{when}"
    work.wait(job, kind, detail, position)


def _quota_detail(state: SchedulerState, job: JobState, vc_used: dict[str, int]) -> str:
    vc = state.vcs[job.spec.vc]
    if vc.gpu_quota is not None and job.spec.gpus > vc.gpu_quota:
        return (
            f"this job needs {job.spec.gpus} GPUs, more than VC {vc.vc}'s whole quota of {vc.gpu_quota}, and the "
            "VC may not borrow: it cannot start unless the quota is raised"
        )
    return (
        f"VC {vc.vc} uses {vc_used.get(vc.vc, 0)} of its {vc.gpu_quota} GPUs; this job needs {job.spec.gpus} "
        "more and the VC may not borrow"
    )


# -- why a gang does not fit ------------------------------------------------------------------------


def _could_fit(job: JobState, free: dict[str, NodeView], available: int) -> bool:
    """The cheap test before ``place``: enough free GPUs (and, for an even split, enough nodes)."""
    if available < job.spec.gpus:
        return False
    sizes = (v.free for v in free.values() if can_run(job.spec, v.runs_processes))
    return job.spec.nodes is None or fits_by_count(job.spec, sizes)


def _ends_in_time(work: Pass, job: JobState) -> bool:
    """Backfill: the job is expected to end before the head's reserved start."""
    return _ends_before(work, job, work.out.reserved_at)


def _ends_before(work: Pass, job: JobState, reserved_at: float | None) -> bool:
    """Backfill: started now, the job is expected to end by ``reserved_at``."""
    if not work.backfill or reserved_at is None:
        return False
    duration = work.state.duration_bound(job)  # (its time limit bounds it)
    return duration is not None and work.state.now + duration <= reserved_at


def _may_backfill(work: Pass, job: JobState) -> bool:
    """Behind the head, a job starts only if it ends in time or takes GPUs the head will not need."""
    spare = work.backfill and work.out.reserved_at is not None and job.spec.gpus <= work.extra
    return spare or _ends_in_time(work, job)


def _delays_head(work: Pass, job: JobState, position: int) -> None:
    """Record why ``job`` waits behind the head. Only explaining passes keep it: the decider's own
    passes read nothing but the jobs that wait for GPUs (``power_up``), and a deep queue has many."""
    if not work.explain:
        return
    out = work.out
    assert out.head is not None
    head = work.state.jobs[out.head]
    when = _reserved_when(work.state.now, out.reserved_at)
    kind: PendingKind = "reserved" if work.backfill else "order"
    shape = f" on {head.spec.nodes} nodes" if head.spec.nodes and head.spec.nodes > 1 else ""
    work.wait(job, kind, f"would delay {head.job}, which waits for {head.spec.gpus} GPUs{shape}{when}", position)


def _reserved_when(now: float, reserved_at: float | None) -> str:
    """When a head's start is reserved, as a person reads it: how long from now, and the clock
    time (a raw epoch "t=1506761235" said neither)."""
    if reserved_at is None:
        return ""
    return f" (its start is reserved in {_span(reserved_at - now)}, at t={reserved_at:.0f})"


def _span(seconds: float) -> str:
    """A duration in its two largest units: 45s, 12m 5s, 3h 20m, 2d 4h."""
    total = max(0, round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    first = next((i for i, (n, _) in enumerate(parts) if n), len(parts) - 1)
    return " ".join(f"{n}{unit}" for n, unit in parts[first : first + 2] if n or unit == parts[first][1])


def _shape(job: JobState) -> tuple:
    spec = job.spec
    return (spec.gpus, spec.nodes, spec.command is not None, spec.duration_s is not None)


def _gang_detail(job: JobState, available: int) -> str:
    if available < job.spec.gpus:
        return f"needs {job.spec.gpus} GPUs at once; {available} are free for it"
    return f"needs {job.spec.gpus} GPUs at once; {available} are free, but not in a shape its gang fits"


def _no_fit(state: SchedulerState, job: JobState) -> tuple[PendingKind, str]:
    runnable = [n for n in state.nodes.values() if can_run(job.spec, n.runs_processes())]
    if not runnable:
        return "no-node", "no registered node's executor can run it"
    healthy_up = [sum(1 for g in n.gpus if g.healthy) for n in runnable if n.accepts_work()]
    if not fits_by_count(job.spec, healthy_up):
        powered_down = [sum(1 for g in n.gpus if g.healthy) for n in runnable if n.status == "up"]
        if fits_by_count(job.spec, powered_down):
            off = sorted(n.node for n in runnable if n.status == "up" and not n.accepts_work())
            return "powered-down", f"fits only with nodes powered down to save energy ({', '.join(off[:8])})"
        if fits_by_count(job.spec, (len(n.gpus) for n in runnable)):
            down = sorted({n.node for n in runnable if n.status != "up" or any(not g.healthy for g in n.gpus)})
            return "drained", f"fits only with drained, lost or unhealthy GPUs ({', '.join(down)})"
        return "no-node", "larger than the nodes that can run it, even when empty"
    return "gang", ""


def _view(node: NodeState, usable: set[int]) -> NodeView:
    islands = (tuple(i for i in island if i in usable) for island in node.islands)
    return NodeView(node.node, node.rack, tuple(t for t in islands if t), node.runs_processes())


# -- backfill reservation ----------------------------------------------------------------------------


# From these rules, the head's reservation counts the jobs the same pass placed before it: they end
# (and give their GPUs back) as any placed job does. Before, their GPUs counted as held for ever, so
# the head's start was reserved too late, and a job let overtake it for that start delayed it.
PASS_PLACEMENTS_RESERVE_RULES = 12


# From these rules, a gang split over nodes reserves the nodes it needs at its reserved start
# (``NodeHold``): a job behind it that runs past that start may use GPUs that leave it enough nodes
# with its per-node share, and is placed off the nodes kept for it where its best placement would
# not. Rules 11 to 13 counted no GPU spare for such a head, so only jobs that end before its start
# overtook it, even on nodes it can never use.
NODE_HOLD_RULES = 14


def _reservation(work: Pass, head: JobState) -> tuple[float | None, int, NodeHold | None]:
    """When enough GPUs free up for the head (from the expected ends of running jobs, and of placed
    ones, by this pass or before), and how many GPUs are spare then (for a gang split over nodes, at
    most how many: its ``NodeHold`` tells which). None when an end it depends on is unknown. Rules
    11 count only the GPUs the head can use: of nodes whose executor can run it, and for a gang
    split over nodes, per node."""
    state, free = work.state, work.free
    placed: dict[str, tuple[ev.Allocation, ...]] = {}
    if state.scheduling.rules >= PASS_PLACEMENTS_RESERVE_RULES:
        placed = {p.job: p.allocations for p in work.out.placed}
    if state.scheduling.rules < 11:
        return (
            *_reservation_by_count(state, head, free, sum(v.free for v in free.values()), (True, False), placed),
            None,
        )
    kinds = tuple(flag for flag in (True, False) if can_run(head.spec, flag))
    if head.spec.nodes is not None:
        reserved_at, free_at = _reservation_by_node(state, head, free, kinds, placed)
        if reserved_at is None or state.scheduling.rules < NODE_HOLD_RULES:
            # (Rules 11 to 13: spare GPUs were not told apart by node, so none were spare.)
            return reserved_at, 0, None
        hold = _node_hold(head, free_at, free)
        return reserved_at, _spare_beside(work, hold), hold
    available = sum(n for flag, n in work.free_total.items() if flag in kinds)
    return (*_reservation_by_count(state, head, free, available, kinds, placed), None)


def _node_hold(head: JobState, free_at: dict[str, int], free: dict[str, NodeView]) -> NodeHold:
    """The head's nodes at its reserved start. Kept for it: as many of the nodes with its per-node
    share then as it needs, those with the fewest GPUs free now first (the fewest kept from backfill)."""
    spec = head.spec
    assert spec.nodes is not None
    per_node = spec.gpus // spec.nodes
    enough = [name for name, gpus in free_at.items() if gpus >= per_node]
    kept = heapq.nsmallest(spec.nodes, enough, key=lambda name: (free[name].free, name))
    return NodeHold(per_node, spec.nodes, free_at, len(enough), frozenset(kept))


def _spare_beside(work: Pass, hold: NodeHold) -> int:
    """At most how many GPUs free now a job running past the head's start may take: all of them if
    more nodes than the head needs have its share then, else all but those of its nodes' shares."""
    spare = sum(work.free_total.values())
    if hold.qualifying > hold.wanted:
        return spare
    for name, at_start in hold.free_at.items():
        if at_start >= hold.per_node:
            now = work.free[name].free
            spare -= now - min(now, at_start - hold.per_node)
    return spare


def _reservation_by_count(
    state: SchedulerState,
    head: JobState,
    free: dict[str, NodeView],
    available: int,
    kinds: tuple[bool, ...],
    placed: dict[str, tuple[ev.Allocation, ...]],
) -> tuple[float | None, int]:
    """The reservation by GPU count: ``available`` free GPUs now, and those of ending jobs on nodes of
    the executor ``kinds`` that can run the head (``placed``: the pass's placements, by job)."""
    if available >= head.spec.gpus:
        return state.now, available - head.spec.gpus  # by count it fits now; the shape is what waits
    # In order of (end, healthy GPUs), as the reservation always counted; the healthy GPUs of a job
    # are counted only when its end is reached (the head usually needs the first few ends, of thousands).
    starting = [*state.unstarted, *placed]
    ends = _by_end(state, state.ends, starting, _victims_stopping(state, head))
    for end, group in itertools.groupby(ends, key=lambda e: e[0]):
        if math.isinf(end):
            return None, 0
        for gpus in sorted(_healthy_gpus(state, job, free, kinds, placed) for _, job in group):
            available += gpus
            if available >= head.spec.gpus:
                return max(end, state.now), available - head.spec.gpus
    return None, 0


def _reservation_by_node(
    state: SchedulerState,
    head: JobState,
    free: dict[str, NodeView],
    kinds: tuple[bool, ...],
    placed: dict[str, tuple[ev.Allocation, ...]],
) -> tuple[float | None, dict[str, int]]:
    """Rules 11, for a gang split over ``head.spec.nodes`` nodes: the first end by which enough nodes
    (of the executor ``kinds`` that can run it) each have its per-node share free, and the GPUs free
    on each of those nodes then. By count, GPUs freeing up on nodes too small for that share made a
    start that never came, and what was let overtake it for that start delayed it."""
    spec = head.spec
    free_by_node = {name: view.free for name, view in free.items() if view.runs_processes in kinds}
    if fits_by_count(spec, free_by_node.values()):
        return state.now, free_by_node  # it fits now; the shape is what waits
    per_node = spec.gpus // spec.nodes  # type: ignore[operator]  # (nodes is set)
    starting = [*state.unstarted, *placed]
    ends = _by_end(state, state.ends, starting, _victims_stopping(state, head))
    for end, group in itertools.groupby(ends, key=lambda e: e[0]):
        if math.isinf(end):
            return None, free_by_node
        reached = False  # (the fit changes only when a node reaches the per-node share)
        for _, job in group:
            for node_name, gpus in _healthy_gpus_by_node(state, job, placed):
                if node_name not in free_by_node:
                    continue  # (a node that does not accept work, or cannot run the head)
                before = free_by_node[node_name]
                free_by_node[node_name] = before + gpus
                reached |= before < per_node <= before + gpus
        if reached and fits_by_count(spec, free_by_node.values()):
            return max(end, state.now), free_by_node
    return None, free_by_node


def _by_end(
    state: SchedulerState,
    running: Iterable[tuple[float, str]],
    starting: list[str],
    stopping: dict[str, None] | None = None,
) -> Iterator[tuple[float, JobState]]:
    """Jobs by expected end: the running ones (kept sorted by the state) and ``starting``, placed
    but not started (expected to end their duration from now); ``stopping`` (a preemptor's victims)
    end now, whatever they would have run."""
    jobs = state.jobs
    if stopping:
        running = (entry for entry in running if entry[1] not in stopping)
        starting = [j for j in starting if j not in stopping]
    soon = sorted((state.expected_end(jobs[j], starting=True), j) for j in starting)
    if stopping:
        soon = sorted([*soon, *((state.now, j) for j in stopping)])
    for end, job_id in heapq.merge(running, soon) if soon else running:
        yield end, jobs[job_id]


# From these rules, a head (or quota head) waiting for the victims it preempted counts their GPUs (or
# quota) as free from now in its reservation: they stop within their grace. Before, they counted at
# the victims' expected ends, so a job behind it that ends before those was let take the GPUs (or
# quota) its preemption counted on, and was then preempted for it in turn once the victims stopped.
VICTIMS_END_NOW_RULES = 12


def _victims_stopping(state: SchedulerState, head: JobState, vc: str | None = None) -> dict[str, None]:
    """The placed or running jobs (of VC ``vc``, if given) still stopping for ``head``, by the rules
    in force (``VICTIMS_END_NOW_RULES``)."""
    victims = state.stopping_for.get(head.job)
    if not victims or state.scheduling.rules < VICTIMS_END_NOW_RULES:
        return {}
    jobs, active = state.jobs, state.active
    return {j: None for j in victims if j in active and (vc is None or jobs[j].spec.vc == vc)}


def _healthy_gpus(
    state: SchedulerState,
    job: JobState,
    free: dict[str, NodeView],
    kinds: tuple[bool, ...],
    placed: dict[str, tuple[ev.Allocation, ...]],
) -> int:
    """The healthy GPUs ``job`` frees on nodes that accept work, of the executor ``kinds`` counted."""
    return sum(
        gpus
        for node, gpus in _healthy_gpus_by_node(state, job, placed)
        if (view := free.get(node)) is not None and view.runs_processes in kinds
    )


def _healthy_gpus_by_node(
    state: SchedulerState, job: JobState, placed: dict[str, tuple[ev.Allocation, ...]]
) -> Iterator[tuple[str, int]]:
    """(node, healthy GPUs) that ``job`` frees, of each of its allocations (of a job the pass placed,
    ``placed``'s: the state does not hold them yet)."""
    for alloc in placed.get(job.job, job.allocations):
        node = state.nodes.get(alloc.node)
        if node is not None:
            yield alloc.node, sum(1 for i in alloc.gpus if node.gpus[i].healthy)


# -- preemption ----------------------------------------------------------------------------------------


def _record_preemption(
    state: SchedulerState, policy: Policy, job: JobState, chosen: list[JobState], out: Plan, position: int, what: str
) -> None:
    grace_s = state.scheduling.param("preemption_grace_s")
    for victim in chosen:
        out.preempted.append(
            ev.JobPreempted(
                job=victim.job,
                attempt=victim.attempt,
                reason=f"preempted for {job.job} ({_why_outranked(state, policy, job, victim)})",
                by=job.job,
                grace_s=grace_s,
            )
        )
    names = ", ".join(v.job for v in chosen)
    out.pending[job.job] = Pending("preempting", f"preempting {names} to fit {what}", position)


def _why_outranked(state: SchedulerState, policy: Policy, job: JobState, victim: JobState) -> str:
    if job.spec.priority > victim.spec.priority:
        return f"priority {job.spec.priority} > {victim.spec.priority}"
    if victim.spec.vc != job.spec.vc and _borrows(state, victim, {}):
        return f"reclaiming GPUs {victim.spec.vc} borrowed from {job.spec.vc}'s quota"
    return f"{policy.name} ranks it higher"


def _borrows(state: SchedulerState, job: JobState, borrowing: dict[str, set[str]]) -> bool:
    """Whether a placed or running job holds GPUs beyond its VC's quota, which a VC within its quota
    may reclaim: by its VC's usage now (rules 9; ``borrowing`` keeps each VC's borrowers worked out
    so far in the pass), or by the rules before, by what it borrowed when it was placed."""
    if state.scheduling.rules < 9:
        return job.borrowed > 0
    vc = job.spec.vc
    if vc not in borrowing:
        borrowing[vc] = state.borrowing(vc)
    return job.job in borrowing[vc]


class VictimMemo:
    """What each VC's quota head outranked of its own VC's placed and running jobs, kept by a
    decider between its passes under a policy whose outranking only fades with time
    (``outranking_fades``, or none but by priority). Until an event names one of the VC's active
    jobs (``SchedulerState.active_changes``) or the head's claim changes, the jobs the head
    outranks at a later pass are some of those it outranked before: time only wears a running
    job's claim down. A later pass asks only those (none: it skips the scan), instead of every job
    of the VC. Kept only where each job outranked was also one the head could take: a job held back
    by the hourly cap may be taken later with no event naming it. (SRTF on philly's first 30,000
    jobs: half a million scans, 25 jobs each, most of them finding jobs too few to fit the head.)"""

    def __init__(self) -> None:
        self._of: tuple[SchedulerState, Policy, object] | None = None  # what the entries hold for
        # VC -> (head, its claim, the VC's change seq, the jobs it outranked, in the order to take them)
        self._seen: dict[str, tuple[str, object, int, tuple[str, ...]]] = {}

    def holds_for(self, state: SchedulerState, policy: Policy) -> bool:
        """Whether this policy allows the memo; forgets it all for another state, policy or scheduling."""
        if policy.preemptive and not policy.outranking_fades:
            return False
        of = self._of
        if of is None or of[0] is not state or of[1] is not policy or of[2] is not state.scheduling:
            self._of, self._seen = (state, policy, state.scheduling), {}
        return True

    def outranked_before(self, state: SchedulerState, job: JobState, claim: object) -> tuple[str, ...] | None:
        """The only jobs of its VC ``job`` can outrank now (None: not known, scan them all)."""
        seen = self._seen.get(job.spec.vc)
        if seen is None or seen[:3] != (job.job, claim, state.active_changes.get(job.spec.vc, 0)):
            return None
        return seen[3]

    def found(self, state: SchedulerState, job: JobState, claim: object, outranked: tuple[str, ...]) -> None:
        """``job`` outranks exactly ``outranked`` of its VC now, and may take every one of them."""
        self._seen[job.spec.vc] = (job.job, claim, state.active_changes.get(job.spec.vc, 0), outranked)


def _victims(
    state: SchedulerState,
    policy: Policy,
    job: JobState,
    vc_used: dict[str, int],
    *,
    same_vc: bool = False,
    memo: VictimMemo | None = None,
) -> list[JobState]:
    """Running jobs ``job`` outranks (``same_vc``: of its own VC only), in the order to take them."""
    claim: object = None
    jobs = state.jobs
    before: tuple[str, ...] | None = None  # the only jobs it can outrank, where the memo knows them
    if same_vc and memo is not None:
        # What ``job`` claims by: its priority, and the policy's measure of it (SRTF: its remaining time).
        claim = (job.spec.priority, policy.outranking_claim(job, state) if policy.preemptive else None)
        before = memo.outranked_before(state, job, claim)
        if before == ():
            return []
    pool: Iterable[JobState]
    if before is not None:
        pool = (jobs[j] for j in before)
    elif same_vc:
        pool = (jobs[j] for j in state.active_by_vc.get(job.spec.vc, {}))
    else:
        pool = state.active_jobs()
    vc = state.vcs.get(job.spec.vc)
    within_quota = vc is not None and vc.gpu_quota is not None and vc_used.get(vc.vc, 0) + job.spec.gpus <= vc.gpu_quota
    out = []
    cap = state.scheduling.param("max_preemptions_per_hour")
    priority = job.spec.priority
    ranks_above = policy.outranked_by(job, state) if policy.preemptive else None
    borrowing: dict[str, set[str]] = {}  # VC -> its jobs that borrow now, once a job of it is asked about
    held_back = False  # an outranked job it may not take now (stopping, or preempted too often)
    for running in pool:
        theirs = running.spec.priority
        outranked = (
            priority > theirs
            or (ranks_above is not None and priority == theirs and ranks_above(running))
            or (within_quota and running.spec.vc != job.spec.vc and _borrows(state, running, borrowing))
        )
        if not outranked:
            continue
        # (Whether it is stopping already, asked of the few it outranks: most passes outrank few.)
        if (
            running.preempt_reason is None
            and not running.stopping()
            and state.preemptions_within(running.job, 3600.0) < cap
        ):
            out.append(running)
        else:
            held_back = True
    # Lowest priority first, then the least work lost, then the youngest.
    out.sort(
        key=lambda j: (
            j.spec.priority,
            state.now - (j.started_at if j.started_at is not None else state.now),
            -j.order,
        )
    )
    if same_vc and memo is not None and not held_back:
        memo.found(state, job, claim, tuple(j.job for j in out))
    return out


def _fewest_victims(
    job: JobState, victims: list[JobState], free: dict[str, NodeView], state: SchedulerState, *, quota_over: int = 0
) -> list[JobState]:
    """The shortest prefix of ``victims`` whose GPUs, with the free ones, fit the gang, and that
    gives back at least ``quota_over`` GPUs of quota."""
    if not victims:
        return []  # (most heads at most passes: the free GPUs are not summed for them)
    freed: dict[str, set[int]] = {}
    available = sum(v.free for v in free.values())
    released = 0
    for count, victim in enumerate(victims[:MAX_VICTIMS], 1):
        for alloc in victim.allocations:
            freed.setdefault(alloc.node, set()).update(alloc.gpus)
        available += victim.held
        released += victim.held
        if available < job.spec.gpus or released < quota_over:
            continue  # not enough GPUs (or quota) yet, whatever their shape
        trial = dict(free)
        for name, gpus in freed.items():
            if name in free:
                node = state.nodes[name]
                usable = {i for island in free[name].islands for i in island} | {
                    i for i in gpus if node.gpus[i].healthy
                }
                trial[name] = _view(node, usable)
        placement = place(job.spec, trial)
        if placement is not None:
            if state.scheduling.rules < 7:
                return victims[:count]
            return _needed(victims[:count], placement, quota_over)
    return []


def _needed(chosen: list[JobState], placement: Placement, quota_over: int) -> list[JobState]:
    """Of ``chosen``, the victims whose GPUs the placement takes, and of the others the cheapest
    the quota still needs: a cheaper victim ahead of the one that made the gang fit may hold GPUs
    the gang would not use, and stopping that job would gain nothing."""
    used = {(a.node, i) for a in placement.allocations for i in a.gpus}
    spare = sum(v.held for v in chosen) - quota_over  # GPUs of quota the victims free beyond the need
    dropped: set[str] = set()
    for victim in reversed(chosen):
        if victim.held <= spare and not any((a.node, i) in used for a in victim.allocations for i in a.gpus):
            dropped.add(victim.job)
            spare -= victim.held
    return [v for v in chosen if v.job not in dropped]


# -- rendezvous ------------------------------------------------------------------------------------


def ports_in_use(state: SchedulerState) -> dict[str, set[int]]:
    used: dict[str, set[int]] = {}
    for job in state.active_jobs():
        if job.rendezvous is not None and job.allocations:
            used.setdefault(job.allocations[0].node, set()).add(job.rendezvous.port)
    return used


def choose_rendezvous(
    state: SchedulerState, job: JobState, leader: str, in_use: dict[str, set[int]], *, generation: int = 0
) -> ev.Rendezvous | None:
    """MASTER_ADDR/PORT of an attempt (or of an elastic job's generation): the leader node's
    address and a port of its declared range that no running job there holds. The first port tried
    depends on (job, attempt, generation), so a retry or a rescale does not reuse the port before
    it (it may linger in TIME_WAIT)."""
    node = state.nodes[leader]
    if node.port_range is None or not node.address:
        return None  # a node without processes (sim) needs no rendezvous
    first, last = node.port_range
    size = last - first + 1
    taken = in_use.setdefault(leader, set())
    salt = (str(generation),) if generation else ()
    start = int(ev.stable_id(job.job, str(job.attempt), *salt, length=8), 16) % size
    for offset in range(size):
        port = first + (start + offset) % size
        if port not in taken:
            taken.add(port)
            return ev.Rendezvous(addr=node.address, port=port)
    return None
