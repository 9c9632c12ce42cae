"""The core fold: ``apply(state, seq, event)`` is the only way a ``ClusterState`` changes.

It reads nothing but its arguments, so folding the same log always gives the same state: live,
after a crash, in an audit, or in a simulation. Events it has no handler for change nothing but
``seq`` and ``now``; a service folds those into its own part of the state (``services/*/state.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from gpuherd import events as ev
from gpuherd.fold.state import (
    ACTIVE,
    TERMINAL,
    ClusterState,
    GpuSlot,
    JobState,
    NodeState,
    NodeStatus,
    PartEnd,
    PowerState,
    VcState,
    islands_of,
)


def apply(state: ClusterState, seq: int, event: ev.Event) -> ClusterState:
    """Fold one event into ``state`` (in place) and return it."""
    if state.touched:
        state.touched = []
    if state.accounted:
        state.accounted = []
    handler = HANDLERS.get(type(event))
    if handler is not None:
        handler(state, seq, event)
    state.seq = seq
    if event.at > state.now:
        state.now = event.at
    return state


def fold(records: Iterable[tuple[int, ev.Event]], state: ClusterState | None = None) -> ClusterState:
    state = state if state is not None else ClusterState()
    for seq, event in records:
        apply(state, seq, event)
    return state


def vc_problem(e: ev.VcConfigured) -> str | None:
    """Why a VC configuration cannot be applied (None: it can)."""
    if e.gpu_quota is not None and e.gpu_quota < 0:
        return f"a GPU quota cannot be negative, got {e.gpu_quota}"
    if not e.weight > 0:
        return f"a fair-share weight must be positive, got {e.weight}"
    for name, limit in (("default time limit", e.default_time_limit_s), ("maximum time limit", e.max_time_limit_s)):
        if limit is not None and not 0 < limit < float("inf"):
            return f"a {name} must be a positive number of seconds, got {limit}"
    default, most = e.default_time_limit_s, e.max_time_limit_s
    if default is not None and most is not None and default > most:
        return (
            f"the default time limit ({default:g}s) is above the maximum ({most:g}s): "
            "every job without a limit would be refused"
        )
    for name, count in (("GPUs per user", e.max_gpus_per_user), ("running jobs per user", e.max_running_per_user)):
        if count is not None and count < 1:
            return f"a limit of {name} must be at least 1, got {count}"
    for name, count in (
        ("GPU quota", e.gpu_quota),
        ("limit of GPUs per user", e.max_gpus_per_user),
        ("limit of running jobs per user", e.max_running_per_user),
    ):
        if count is not None and count >= 2**64:  # (snapshots are msgpack: 64-bit integers, as intake checks)
            return f"a {name} of {count} is out of range: at most 2**64-1"
    return None


# -- bookkeeping -------------------------------------------------------------------------------------


def _account(state: ClusterState, job: JobState, at: float) -> None:
    """Add the GPU time since ``service_from`` (or the start) to the job's attained service, and say
    so in ``accounted`` (the scheduler charges it to the user's and the VC's fair-share usage)."""
    if job.status != "running" or job.started_at is None:
        return
    used = job.held * max(0.0, at - (job.service_from or job.started_at))
    job.service_gpu_s += used
    job.service_from = at
    state.accounted.append((job.job, at, used))


def _touch(state: ClusterState, node: NodeState) -> None:
    """Record that the fold changed ``node``."""
    state.node_clock += 1
    node.version = state.node_clock
    state.touched.append(node.node)


def _activate(state: ClusterState, job: JobState) -> None:
    state.active[job.job] = None
    job.held = sum(len(a.gpus) for a in job.allocations)


def _deactivate(state: ClusterState, job: JobState) -> None:
    state.active.pop(job.job, None)
    job.held = 0


def _release(state: ClusterState, job: JobState) -> None:
    _free(state, job, (*job.allocations, *job.releasing))
    job.allocations = ()
    job.releasing = ()


def _free(state: ClusterState, job: JobState, allocations: Iterable[ev.Allocation]) -> None:
    """Give back the GPUs of ``allocations`` that ``job`` holds."""
    for alloc in allocations:
        node = state.nodes.get(alloc.node)
        if node is None:
            continue
        for index in alloc.gpus:
            if index < len(node.gpus) and node.gpus[index].job == job.job:
                node.gpus[index].job = None
        _touch(state, node)


def _enqueue(state: ClusterState, job: JobState) -> None:
    bisect.insort(state.queue, job.job, key=lambda j: state.jobs[j].order)


def _dequeue(state: ClusterState, job_id: str) -> None:
    """Take a job out of the queue (kept in arrival order): found by bisection, not by a scan."""
    job = state.jobs.get(job_id)
    if job is None:
        return
    queue, jobs = state.queue, state.jobs
    at = bisect.bisect_left(queue, job.order, key=lambda j: jobs[j].order)
    if at < len(queue) and queue[at] == job_id:
        del queue[at]


def _exists(state: ClusterState, allocations: tuple[ev.Allocation, ...]) -> bool:
    """Every GPU named exists (a node this fold does not keep is taken as it is)."""
    for alloc in allocations:
        node = state.nodes.get(alloc.node)
        if node is None:
            if not state.partial:
                return False
            continue
        count = len(node.gpus)
        for index in alloc.gpus:  # (a loop, not all() over a generator: every placement is checked)
            if not 0 <= index < count:
                return False
    return True


def jobs_on(state: ClusterState, node_name: str) -> list[str]:
    """The active jobs holding GPUs of ``node_name``, sorted."""
    node = state.nodes.get(node_name)
    if node is not None:
        return sorted({slot.job for slot in node.gpus if slot.job is not None})
    held = (
        j
        for j in state.active_jobs()
        if any(a.node == node_name for a in j.allocations) or any(a.node == node_name for a in j.releasing)
    )
    return sorted(j.job for j in held)


# -- nodes -------------------------------------------------------------------------------------------


def _node_registered(state: ClusterState, seq: int, e: ev.NodeRegistered) -> None:
    if [g.index for g in e.gpus] != list(range(len(e.gpus))):
        return  # agents number GPUs 0..n-1 and everything indexes them so: not a registration to apply
    old = state.nodes.get(e.node)
    slots = [GpuSlot(info=g) for g in e.gpus]
    if old is not None:
        # A re-registering agent must not wipe allocations the log still holds.
        for slot in slots:
            if slot.info.index < len(old.gpus):
                slot.job = old.gpus[slot.info.index].job
                slot.healthy = old.gpus[slot.info.index].healthy
    status: NodeStatus = "drained" if old is not None and old.status == "drained" else "up"
    state.nodes[e.node] = NodeState(
        node=e.node,
        rack=e.rack,
        executor=e.executor,
        gpus=slots,
        status=status,
        reason=old.reason if status == "drained" and old is not None else "",
        boot_id=e.boot_id,
        registered_at=e.at,
        registered_seq=seq,
        address=e.address,
        port_range=e.port_range,
        islands=islands_of(e.gpus),
        host_memory_mb=e.host_memory_mb,
        power="on" if old is None or old.power == "booting" else old.power,  # a booting node is up once it registers
        power_changed_at=old.power_changed_at if old is not None else e.at,
    )
    state.registrations += 1
    _touch(state, state.nodes[e.node])


def _node_drained(state: ClusterState, seq: int, e: ev.NodeDrained) -> None:
    node = state.nodes.get(e.node)
    if node is not None and node.status != "lost":
        node.status = "drained"
        node.reason = e.reason
        _touch(state, node)


def _node_undrained(state: ClusterState, seq: int, e: ev.NodeUndrained) -> None:
    node = state.nodes.get(e.node)
    if node is None:
        return
    if node.status == "drained":
        node.status = "up"
        node.reason = ""
    _touch(state, node)
    for slot in node.gpus:  # an operator vouches for the node: its GPUs are back in service
        slot.healthy = True
        slot.health_reason = ""


def _node_lost(state: ClusterState, seq: int, e: ev.NodeLost) -> None:
    # Whatever ran there is gone (the agent fences its processes before the loss is declared).
    for job_id in jobs_on(state, e.node):
        job = state.jobs.get(job_id)
        if job is not None and job.status in ACTIVE and e.node not in job.parts_ended:
            job.parts_ended[e.node] = PartEnd(outcome="lost", reason=f"node {e.node} lost: {e.reason}")
    node = state.nodes.get(e.node)
    if node is not None:
        node.status = "lost"
        node.reason = e.reason
        _touch(state, node)


def _gpu_health_changed(state: ClusterState, seq: int, e: ev.GpuHealthChanged) -> None:
    node = state.nodes.get(e.node)
    if node is not None and 0 <= e.index < len(node.gpus):
        node.gpus[e.index].healthy = e.healthy
        node.gpus[e.index].health_reason = "" if e.healthy else e.reason
        _touch(state, node)


def _set_power(state: ClusterState, node_name: str, at: float, moves: dict[str, PowerState]) -> None:
    node = state.nodes.get(node_name)
    if node is not None and node.power in moves:
        node.power = moves[node.power]
        node.power_changed_at = at
        _touch(state, node)


def _node_power_down_requested(state: ClusterState, seq: int, e: ev.NodePowerDownRequested) -> None:
    _set_power(state, e.node, e.at, {"on": "draining"})


def _node_power_up_requested(state: ClusterState, seq: int, e: ev.NodePowerUpRequested | ev.NodeWakeRequested) -> None:
    _set_power(state, e.node, e.at, {"draining": "on", "off": "booting"})


def _node_powered_down(state: ClusterState, seq: int, e: ev.NodePoweredDown) -> None:
    _set_power(state, e.node, e.at, {"draining": "off", "on": "off"})


def _node_powered_up(state: ClusterState, seq: int, e: ev.NodePoweredUp) -> None:
    _set_power(state, e.node, e.at, {"booting": "on", "off": "on", "draining": "on"})


def _vc_configured(state: ClusterState, seq: int, e: ev.VcConfigured) -> None:
    if e.unchecked or vc_problem(e) is None:  # else refused by the scheduler (CommandRefused): no change
        state.vcs[e.vc] = VcState(
            vc=e.vc,
            gpu_quota=e.gpu_quota,
            can_borrow=e.can_borrow,
            weight=e.weight,
            default_time_limit_s=e.default_time_limit_s,
            max_time_limit_s=e.max_time_limit_s,
            max_gpus_per_user=e.max_gpus_per_user,
            max_running_per_user=e.max_running_per_user,
        )


# -- jobs --------------------------------------------------------------------------------------------


def _job_submitted(state: ClusterState, seq: int, e: ev.JobSubmitted) -> None:
    if e.job in state.jobs or e.spec.gpus < 1 or (e.spec.nodes is not None and e.spec.nodes < 1):
        return  # the second submission of an id, or a spec intake would have refused (written by hand)
    job = JobState(job=e.job, spec=e.spec, order=seq, submitted_at=e.at, waiting_since=e.at)
    state.jobs[e.job] = job
    state.queue.append(e.job)  # seq only grows, so appending keeps queue order


def _job_placed(state: ClusterState, seq: int, e: ev.JobPlaced) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status != "pending" or e.attempt != job.attempt:
        return
    if not _exists(state, e.allocations):
        return  # names GPUs that do not exist: never applied (invariants.violations reports it)
    for alloc in e.allocations:
        node = state.nodes.get(alloc.node)
        if node is None:
            continue
        _touch(state, node)
        for index in alloc.gpus:
            node.gpus[index].job = e.job
    job.allocations = e.allocations
    job.status = "placed"
    _activate(state, job)
    job.placed_at = e.at
    job.placement_reason = e.reason
    job.locality = e.locality
    job.rendezvous = e.rendezvous
    job.last_nodes = [a.node for a in e.allocations]
    job.parts_ended = {}
    job.reports = []
    job.borrowed = e.borrowed
    job.generation = 0
    job.committed = e.allocations
    # (The first of ``ev.workers_of``, not all of them: one string, not one per GPU.)
    job.state_from = (
        ev.worker_id(e.allocations[0].node, e.allocations[0].gpus[0]) if e.allocations and e.allocations[0].gpus else ""
    )
    job.joiners = ()
    job.releasing = ()
    job.rescale = None
    job.rescale_failed = False
    job.lost_workers = []
    job.service_from = None
    if job.first_placed_at is None:
        job.first_placed_at = e.at
    _dequeue(state, e.job)


def _reported_before(job: JobState, report: ev.JobStarted | ev.TaskEnded) -> bool:
    """Whether this report of an elastic job's part was folded already in this attempt (its second
    copy: the same id from the same node, which another node's agent cannot write). A job whose
    parts never leave needs no record: the first word on each part stands."""
    if job.spec.elastic is None:
        return False
    key = f"{report.node} {report.id}"
    if key in job.reports:
        return True
    job.reports.append(key)
    return False


def _job_started(state: ClusterState, seq: int, e: ev.JobStarted) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt or _reported_before(job, e):
        return
    if e.node not in job.nodes:
        return  # a part that left the job already (an elastic shrink): its start changes nothing
    if e.node not in job.started_nodes:
        job.started_nodes.append(e.node)
    if job.status == "placed":
        job.status = "running"
        job.started_at = e.at


def _job_finished(state: ClusterState, seq: int, e: ev.JobFinished) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status in TERMINAL or e.attempt != job.attempt:
        return  # a stale attempt's report: that attempt was already requeued
    _account(state, job, e.at)
    _release(state, job)
    if job.status == "pending":  # (the queue holds the pending jobs alone: an end of a placed one skips its search)
        _dequeue(state, e.job)
    _deactivate(state, job)
    job.status = e.outcome
    job.finished_at = e.at
    job.reason = e.reason
    job.final_metrics = e.metrics
    job.parts_ended = {}  # the outcome above sums them up; finished jobs stay small in snapshots
    job.reports = []
    state.ended[e.outcome] = state.ended.get(e.outcome, 0) + 1
    if not state.retain_finished:
        del state.jobs[e.job]


def _task_ended(state: ClusterState, seq: int, e: ev.TaskEnded) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt or _reported_before(job, e):
        return
    if e.node not in job.nodes:
        return
    if e.node in job.parts_ended:
        return  # the first word on a part stands (a lost node's late report changes nothing)
    if e.outcome == "failed" and recovers_from_lost_workers(job, e.node):
        return  # its workers died one by one (WorkerLost): the job shrinks to the survivors instead
    job.parts_ended[e.node] = PartEnd(
        outcome=e.outcome, exit_code=e.exit_code, reason=e.reason, output_tail=e.output_tail, metrics=e.metrics
    )


def _job_preempted(state: ClusterState, seq: int, e: ev.JobPreempted) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt or job.preempt_reason is not None:
        return
    job.preempt_reason = e.reason
    job.preempted_for = e.by
    job.preempt_grace_s = e.grace_s


def _job_time_limit_reached(state: ClusterState, seq: int, e: ev.JobTimeLimitReached) -> None:
    job = state.jobs.get(e.job)
    if job is not None and job.status in ACTIVE and e.attempt == job.attempt:
        job.time_limit_reached = True


def _job_cancel_requested(state: ClusterState, seq: int, e: ev.JobCancelRequested) -> None:
    job = state.jobs.get(e.job)
    if job is not None and job.status not in TERMINAL:
        job.cancel_requested = True


def _job_requeued(state: ClusterState, seq: int, e: ev.JobRequeued) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt:
        return
    _account(state, job, e.at)
    _release(state, job)
    _deactivate(state, job)
    if any(p.outcome == "failed" for p in job.parts_ended.values()):
        job.failures += 1
    job.status = "pending"
    job.attempt += 1
    job.placed_at = None
    job.started_at = None
    job.started_nodes = []
    job.parts_ended = {}
    job.reports = []
    job.rendezvous = None
    job.reason = e.reason
    job.preempt_reason = None
    job.preempted_for = ""
    job.time_limit_reached = False
    job.borrowed = 0
    job.waiting_since = e.at
    _enqueue(state, job)


# -- elastic jobs -------------------------------------------------------------------------------------


def recovers_from_lost_workers(job: JobState, node: str | None = None) -> bool:
    """An elastic job whose lost workers (all of ``node``'s, if given) leave enough survivors
    (at least its minimum) goes on with them rather than failing its attempt."""
    if job.spec.elastic is None or not job.lost_workers:
        return False
    if node is not None:
        mine = [w for w in job.workers if w.rpartition("/")[0] == node]
        if not all(w in job.lost_workers for w in mine):
            return False
    return job.survivors() >= job.spec.elastic.min


def _gpus_of(allocations: Iterable[ev.Allocation]) -> set[tuple[str, int]]:
    return {(a.node, g) for a in allocations for g in a.gpus}


def _job_resized(state: ClusterState, seq: int, e: ev.JobResized) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt or e.generation != job.generation + 1:
        return
    if not _exists(state, e.allocations):
        return  # names GPUs that do not exist: never applied (invariants.violations reports it)
    new = _gpus_of(e.allocations)
    held_before = _gpus_of(job.allocations) | _gpus_of(job.releasing)
    if _held_by_another(state, e.job, new - held_before):
        return  # takes a GPU another job holds: never applied (invariants.violations reports it)
    releasing = (_gpus_of(job.releasing) | _gpus_of(e.releasing)) - new
    for node_name, index in sorted((held_before - new - releasing) | (new - held_before)):
        node = state.nodes.get(node_name)
        if node is None or index >= len(node.gpus):
            continue
        slot = node.gpus[index]
        if (node_name, index) in new:
            slot.job = e.job
        elif slot.job == e.job:
            slot.job = None
        _touch(state, node)
    _account(state, job, e.at)
    job.allocations = e.allocations
    job.releasing = _as_allocations(releasing)
    job.held = len(new) + len(releasing)
    job.generation = e.generation
    job.state_from = e.state_from
    job.joiners = e.joiners
    job.rendezvous = e.rendezvous
    job.rescale = e.kind
    job.rescale_failed = False
    job.rescaled_at = e.at
    job.borrowed = e.borrowed
    job.last_nodes = job.nodes
    workers = set(job.workers)
    job.lost_workers = [w for w in job.lost_workers if w in workers]
    job.parts_ended = {n: p for n, p in job.parts_ended.items() if n in job.nodes}
    job.started_nodes = [n for n in job.started_nodes if n in job.nodes]


def _held_by_another(state: ClusterState, job_id: str, gpus: set[tuple[str, int]]) -> bool:
    for node_name, index in gpus:
        node = state.nodes.get(node_name)
        holder = node.gpus[index].job if node is not None and index < len(node.gpus) else None
        if holder not in (None, job_id):
            return True
    return False


def _as_allocations(gpus: set[tuple[str, int]]) -> tuple[ev.Allocation, ...]:
    by_node: dict[str, list[int]] = {}
    for node, index in sorted(gpus):
        by_node.setdefault(node, []).append(index)
    return tuple(ev.Allocation(node, tuple(indices)) for node, indices in by_node.items())


def _rescale_completed(state: ClusterState, seq: int, e: ev.RescaleCompleted) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt:
        return
    if e.generation != job.generation or job.rescale is None:
        return
    _free(state, job, job.releasing)
    _account(state, job, e.at)
    job.releasing = ()
    job.held = sum(len(a.gpus) for a in job.allocations)
    job.committed = job.allocations
    job.rescale = None
    job.rescale_failed = False


def _rescale_failed(state: ClusterState, seq: int, e: ev.RescaleFailed) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt:
        return
    if e.generation == job.generation and job.rescale is not None:
        job.rescale_failed = True


def _worker_lost(state: ClusterState, seq: int, e: ev.WorkerLost) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt:
        return
    worker = ev.worker_id(e.node, e.gpu)
    if worker in job.workers and worker not in job.lost_workers:
        job.lost_workers.append(worker)


HANDLERS: dict[type, Callable[[ClusterState, int, ev.Event], None]] = {
    ev.NodeRegistered: _node_registered,
    ev.NodeDrained: _node_drained,
    ev.NodeUndrained: _node_undrained,
    ev.NodeLost: _node_lost,
    ev.NodePowerDownRequested: _node_power_down_requested,
    ev.NodePowerUpRequested: _node_power_up_requested,
    ev.NodeWakeRequested: _node_power_up_requested,
    ev.NodePoweredDown: _node_powered_down,
    ev.NodePoweredUp: _node_powered_up,
    ev.GpuHealthChanged: _gpu_health_changed,
    ev.VcConfigured: _vc_configured,
    ev.JobSubmitted: _job_submitted,
    ev.JobPlaced: _job_placed,
    ev.JobStarted: _job_started,
    ev.JobFinished: _job_finished,
    ev.TaskEnded: _task_ended,
    ev.JobCancelRequested: _job_cancel_requested,
    ev.JobRequeued: _job_requeued,
    ev.JobPreempted: _job_preempted,
    ev.JobTimeLimitReached: _job_time_limit_reached,
    ev.JobResized: _job_resized,
    ev.RescaleCompleted: _rescale_completed,
    ev.RescaleFailed: _rescale_failed,
    ev.WorkerLost: _worker_lost,
}  # type: ignore[dict-item]
