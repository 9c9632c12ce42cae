"""Resizing running elastic jobs: the scheduler commits every change of their GPUs.

The elastic service only proposes (``RescaleProposed``); the scheduler, sole owner of GPUs,
turns a proposal that still holds into a new generation (``JobResized``). It also commits the
generations nobody proposed: a *rollback* after a failed switch (the workers of the last
completed generation, less any that died or whose GPUs the job gave back since), also of a switch
not reported done within the policy's ``rescale_timeout_s`` (rules 12), and a *recovery* after a
worker died outside a rescale (the survivors, while they are at least the job's minimum).

Rules of a generation, which the runtime relies on:
- workers keep their order (a node's new GPUs follow its old ones, new nodes come last), so
  rank 0 (the host of the generation's store) is an old worker whenever one survives;
- ``state_from`` is the first worker of the last completed generation that is still there: it
  holds the committed state the others take;
- a grow takes free GPUs on the nodes the job already runs on first (NVLink, no network),
  then on the nodes with the most free GPUs, within the VC's quota unless the VC may borrow, and
  within the VC's per-user GPU limit; from rules 12, not when a job waiting for the victims it
  preempted would then no longer fit (its preemption counted on the free GPUs too);
- a shrink lets the newest workers go; their GPUs stay the job's until the rescale ends.
"""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.fold import JobState, NodeState
from services.scheduler.placement import NodeView, can_run, place
from services.scheduler.schedule import choose_rendezvous, ports_in_use
from services.scheduler.state import SchedulerState, user_key


def on_proposal(state: SchedulerState, proposal: ev.RescaleProposed) -> list[ev.Event]:
    """Commit the proposal if it still holds: the job runs that generation, is not stopping (rules 8),
    no rescale is in flight, the size is one the job may take, and (to grow) the GPUs are free and
    no job waiting for the victims it preempted needs them (rules 12)."""
    job = state.jobs.get(proposal.job)
    if job is None or job.status != "running" or job.spec.elastic is None:
        return []
    if job.attempt != proposal.attempt or job.generation != proposal.generation or job.rescale is not None:
        return []
    if job.lost_workers or proposal.gpus not in job.spec.elastic.sizes():
        return []
    if job.stopping() and state.scheduling.rules >= 8:
        return []  # (cancelled or preempted since it was proposed: its GPUs free as it ends)
    size = len(job.workers)
    if proposal.gpus > size:
        if _over_user_limit(state, job, proposal.gpus - size):
            return []
        grown = _grow(state, job, proposal.gpus - size)
        if grown is None:
            return []
        allocations, borrowed = grown
        if state.scheduling.rules >= 12 and _leaves_a_preemptor_short(state, _new_gpus(job, allocations)):
            return []
        return [_resized(state, job, allocations, "grow", proposal.reason, borrowed=borrowed)]
    if proposal.gpus < size:
        keep = job.workers[: proposal.gpus]  # the newest workers go
        allocations = _only(job.allocations, set(keep))
        leaving = _only(job.allocations, set(job.workers) - set(keep))
        borrowed = max(0, job.borrowed - (size - proposal.gpus))
        return [_resized(state, job, allocations, "shrink", proposal.reason, releasing=leaving, borrowed=borrowed)]
    return []


def _over_user_limit(state: SchedulerState, job: JobState, more: int) -> bool:
    """Growing by ``more`` GPUs would take the job's user past its VC's per-user GPU limit."""
    vc = state.vcs.get(job.spec.vc)
    if vc is None or vc.max_gpus_per_user is None:
        return False
    return state.user_gpus.get(user_key(job.spec.vc, job.spec.user), 0) + more > vc.max_gpus_per_user


def _new_gpus(job: JobState, allocations: tuple[ev.Allocation, ...]) -> dict[str, set[int]]:
    """The GPUs of ``allocations`` the job does not hold yet, by node."""
    held = {(a.node, g) for a in (*job.allocations, *job.releasing) for g in a.gpus}
    out: dict[str, set[int]] = {}
    for alloc in allocations:
        for gpu in alloc.gpus:
            if (alloc.node, gpu) not in held:
                out.setdefault(alloc.node, set()).add(gpu)
    return out


def _leaves_a_preemptor_short(state: SchedulerState, taken: dict[str, set[int]]) -> bool:
    """Rules 12: with ``taken`` gone, some job waiting for the victims it preempted no longer fits
    on their GPUs and the free ones. Its preemption counted on free GPUs too (a stale grow
    proposal must not take them: the victims would stop for nothing, and it would wait on)."""
    for preemptor_id, victims in state.stopping_for.items():
        preemptor = state.jobs.get(preemptor_id)
        if preemptor is None or preemptor.status != "pending":
            continue  # placed since, or gone (an unhealthy GPU's job stops for no one: "")
        usable = {
            name: {i for i in node.free_gpus() if i not in taken.get(name, ())}
            for name, node in sorted(state.nodes.items())
            if node.accepts_work()
        }
        for victim_id in victims:
            victim = state.jobs.get(victim_id)
            for alloc in (*victim.allocations, *victim.releasing) if victim is not None else ():
                if alloc.node in usable:
                    gpus = state.nodes[alloc.node].gpus
                    usable[alloc.node].update(i for i in alloc.gpus if gpus[i].healthy)
        if place(preemptor.spec, {name: _view(state.nodes[name], gpus) for name, gpus in usable.items()}) is None:
            return True
    return False


def _view(node: NodeState, usable: set[int]) -> NodeView:
    islands = (tuple(i for i in island if i in usable) for island in node.islands)
    return NodeView(node.node, node.rack, tuple(t for t in islands if t), node.runs_processes())


def on_failed(state: SchedulerState, failed: ev.RescaleFailed) -> list[ev.Event]:
    """Roll back to the last completed generation's workers that are still alive (their state is
    what was committed); new workers of the failed generation leave."""
    job = state.jobs.get(failed.job)
    if job is None or job.spec.elastic is None or job.status not in ("placed", "running"):
        return []
    if failed.attempt != job.attempt or failed.generation != job.generation or not job.rescale_failed:
        return []
    reason = f"rescale to generation {failed.generation} failed on {failed.node}: {failed.reason}"
    rollback = _rollback(state, job, reason)
    # (too few hold the state: the workers give up and the attempt fails, and is retried)
    return [rollback] if rollback is not None else []


def _rollback(state: SchedulerState, job: JobState, reason: str) -> ev.JobResized | None:
    """The generation of the committed workers that can still take part, the new workers of the
    generation in flight leaving; None when they are fewer than the job's minimum."""
    assert job.spec.elastic is not None
    alive = _rollback_workers(state, job)
    if len(alive) < job.spec.elastic.min:
        return None
    allocations = _only(job.committed, set(alive))
    joined = set(job.workers) - set(ev.workers_of(job.committed)) - set(job.lost_workers)
    return _resized(state, job, allocations, "rollback", reason, releasing=_only(job.allocations, joined), borrowed=0)


def _rollback_workers(state: SchedulerState, job: JobState) -> list[str]:
    """The last completed generation's workers that are alive and, from rules 12, still the job's:
    a recover since gave a dead worker's GPU back (the fold then forgets that worker was lost),
    and another job may hold it now."""
    committed = ev.workers_of(job.committed)
    if state.scheduling.rules < 12:
        return [w for w in committed if w not in job.lost_workers]
    held = {*ev.workers_of(job.allocations), *ev.workers_of(job.releasing)}
    return [w for w in committed if w in held and w not in job.lost_workers]


def on_worker_lost(state: SchedulerState, lost: ev.WorkerLost) -> list[ev.Event]:
    """Go on with the survivors while they are at least the job's minimum."""
    job = state.jobs.get(lost.job)
    if job is None or job.spec.elastic is None or job.status not in ("placed", "running"):
        return []
    if lost.attempt != job.attempt or ev.worker_id(lost.node, lost.gpu) not in job.lost_workers:
        return []
    survivors = [w for w in job.workers if w not in job.lost_workers]
    if len(survivors) < job.spec.elastic.min or not _has_state(job, survivors):
        return []
    allocations = _only(job.allocations, set(survivors))
    why = lost.reason or (f"exit code {lost.exit_code}" if lost.exit_code is not None else "died")
    reason = f"worker {lost.node}/{lost.gpu} lost ({why}); {len(survivors)} go on"
    return [_resized(state, job, allocations, "recover", reason, borrowed=min(job.borrowed, len(survivors)))]


def overdue_rescales(state: SchedulerState, tick: ev.ClockTicked) -> list[ev.Event]:
    """Rules 12: a rescale in flight for longer than ``rescale_timeout_s`` at the tick's time (the
    new rank 0's report of it is one datagram, and can be lost) is taken as failed, as a
    ``RescaleFailed`` would be: rolled back. Where too few committed workers are left for that,
    the attempt is stopped (preempted, for no one) and requeued, rather than hold its GPUs forever.
    The time is the log's (the tick's and the resize's), so a replay decides the same."""
    if state.scheduling.rules < 12:
        return []
    timeout = state.scheduling.param("rescale_timeout_s")
    out: list[ev.Event] = []
    for job_id in state.rescaling:
        job = state.jobs.get(job_id)
        if job is None or job_id not in state.active or job.rescale is None or job.rescaled_at is None:
            continue  # (the index may hold a job whose rescale a node's loss ended)
        if job.spec.elastic is None or job.stopping():
            continue  # (a job that is stopping frees its GPUs as it ends)
        if tick.at - job.rescaled_at <= timeout:
            continue
        late = f"{job.rescale} to generation {job.generation} not reported done within {timeout:g}s"
        rollback = _rollback(state, job, late)
        if rollback is not None:
            out.append(rollback)
            continue
        grace = state.scheduling.param("preemption_grace_s")
        why = f"{late}, and too few of its committed workers are left to roll back to"
        out.append(ev.JobPreempted(job=job.job, attempt=job.attempt, reason=why, grace_s=grace))
    return out


def _has_state(job: JobState, workers: list[str]) -> bool:
    committed = set(ev.workers_of(job.committed))
    return any(w in committed for w in workers)


def _resized(
    state: SchedulerState,
    job: JobState,
    allocations: tuple[ev.Allocation, ...],
    kind: ev.RescaleKind,
    reason: str,
    *,
    releasing: tuple[ev.Allocation, ...] = (),
    borrowed: int = 0,
) -> ev.JobResized:
    workers = ev.workers_of(allocations)
    committed = ev.workers_of(job.committed)
    source = next(w for w in committed if w in workers) if any(w in workers for w in committed) else workers[0]
    generation = job.generation + 1
    leader = allocations[0].node
    return ev.JobResized(
        job=job.job,
        attempt=job.attempt,
        generation=generation,
        allocations=allocations,
        rendezvous=choose_rendezvous(state, job, leader, ports_in_use(state), generation=generation),
        state_from=source,
        joiners=tuple(w for w in workers if w not in job.workers),
        releasing=releasing,
        kind=kind,
        reason=reason or f"{kind} to {len(workers)} GPUs",
        borrowed=borrowed,
    )


def _only(allocations: tuple[ev.Allocation, ...], keep: set[str]) -> tuple[ev.Allocation, ...]:
    """The allocations restricted to the workers in ``keep``, in their order."""
    out = []
    for alloc in allocations:
        gpus = tuple(g for g in alloc.gpus if ev.worker_id(alloc.node, g) in keep)
        if gpus:
            out.append(ev.Allocation(alloc.node, gpus))
    return tuple(out)


def _grow(state: SchedulerState, job: JobState, extra: int) -> tuple[tuple[ev.Allocation, ...], int] | None:
    """``extra`` free GPUs for the job, and how many GPUs it then borrows beyond its VC's quota;
    None if they are not there or the quota stops it."""
    vc = state.vcs.get(job.spec.vc)
    borrowed = job.borrowed
    if vc is not None and vc.gpu_quota is not None:
        over = state.vc_used.get(vc.vc, 0) + extra - vc.gpu_quota
        if over > 0:
            if not vc.can_borrow:
                return None
            borrowed += min(over, extra)
    current = [a.node for a in job.allocations]

    def preference(node: NodeState) -> tuple:
        mine = node.node in current
        return (not mine, current.index(node.node) if mine else 0, -len(node.free_gpus()), node.node)

    usable = [n for n in state.nodes.values() if n.accepts_work() and can_run(job.spec, n.runs_processes())]
    taken: dict[str, list[int]] = {}
    need = extra
    for node in sorted(usable, key=preference):
        if need == 0:
            break
        free = node.free_gpus()[:need]
        if free:
            taken[node.node] = free
            need -= len(free)
    if need:
        return None
    allocations = [ev.Allocation(a.node, a.gpus + tuple(taken.pop(a.node, ()))) for a in job.allocations]
    allocations += [ev.Allocation(node, tuple(gpus)) for node, gpus in taken.items()]
    return tuple(allocations), borrowed
