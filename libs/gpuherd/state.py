"""Pure folds: events -> ClusterState.

``apply(state, seq, event)`` is the only way state changes. It reads nothing
but its arguments, so folding the same log always gives the same state: live,
after a crash, in an audit, or in a simulation. The state is a tree of msgspec
Structs so a snapshot is one ``msgpack`` encode, and can always be rebuilt
from the log.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import msgspec

from gpuherd import events as ev
from gpuherd import jobenv

NodeStatus = Literal["up", "drained", "lost"]
PowerState = Literal["on", "draining", "off", "booting"]  # cluster energy saving (CES)
JobStatus = Literal["pending", "placed", "running", "completed", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
ACTIVE: frozenset[str] = frozenset({"placed", "running"})


class GpuSlot(msgspec.Struct, kw_only=True, gc=False):
    info: ev.GpuInfo
    job: str | None = None  # the job holding this GPU, if any
    healthy: bool = True
    health_reason: str = ""  # why it is unhealthy (the agent's words)
    used_mb: int | None = None  # memory in use, as its agent last reported it (GpuMemoryReported)


class NodeState(msgspec.Struct, kw_only=True, gc=False):
    node: str
    rack: str
    executor: str
    gpus: list[GpuSlot]
    status: NodeStatus = "up"
    reason: str = ""
    boot_id: str = ""
    registered_at: float = 0.0
    registered_seq: int = 0
    address: str = ""
    port_range: tuple[int, int] | None = None
    islands: list[list[int]] = msgspec.field(default_factory=list)  # NVLink islands, from the inventory
    host_memory_mb: int = 0  # RAM (0: the agent did not say)
    power: PowerState = "on"
    power_changed_at: float = 0.0
    # The cluster's node clock at the fold that last changed this node's GPUs, status or power:
    # lets a decider keep per-node views between passes and recompute only the nodes that changed.
    version: int = 0

    def accepts_work(self) -> bool:
        """Up, and neither powering down nor off."""
        return self.status == "up" and self.power == "on"

    def busy(self) -> bool:
        return any(g.job is not None for g in self.gpus)

    def free_gpus(self) -> list[int]:
        return [g.info.index for g in self.gpus if g.job is None and g.healthy]

    def runs_processes(self) -> bool:
        """Whether this node's executor runs real processes (a job with a ``command`` needs one)."""
        return self.executor != "sim"


def islands_of(gpus: Sequence[ev.GpuInfo]) -> list[list[int]]:
    """Group a node's GPU indices into NVLink islands: connected components of the peer graph.

    A GPU without NVLink peers is an island of its own (PCIe only)."""
    parent = {g.index: g.index for g in gpus}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for g in gpus:
        for peer in g.nvlink_peers:
            if peer in parent:
                parent[root(peer)] = root(g.index)
    groups: dict[int, list[int]] = {}
    for index in sorted(parent):
        groups.setdefault(root(index), []).append(index)
    return sorted(groups.values())


class PartEnd(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """How one node's part of the current attempt ended."""

    outcome: ev.PartOutcome
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""
    metrics: dict[str, float] | None = None


class JobState(msgspec.Struct, kw_only=True, gc=False):
    job: str
    spec: ev.JobSpec
    status: JobStatus = "pending"
    order: int = 0  # queue position key: the sequence of its JobSubmitted
    submitted_at: float = 0.0
    attempt: int = 0
    allocations: tuple[ev.Allocation, ...] = ()
    placed_at: float | None = None
    first_placed_at: float | None = None
    started_at: float | None = None
    started_nodes: list[str] = msgspec.field(default_factory=list)
    finished_at: float | None = None
    reason: str = ""  # why it is where it is: last requeue / finish reason
    cancel_requested: bool = False
    placement_reason: str = ""
    locality: ev.Locality | None = None
    rendezvous: ev.Rendezvous | None = None
    parts_ended: dict[str, PartEnd] = msgspec.field(default_factory=dict)  # node -> end, current attempt
    failures: int = 0  # failed attempts so far; a failure is retried while fewer than spec.max_retries were
    predicted_s: float | None = None  # the latest JobDurationPredicted
    service_gpu_s: float = 0.0  # attained service of ended attempts: GPUs x seconds run
    waiting_since: float = 0.0  # when it last became pending (submitted or requeued)
    preempt_reason: str | None = None  # set while the current attempt is being preempted
    preempted_for: str = ""  # the job its GPUs go to
    preempt_grace_s: float = 0.0  # how long its processes have to checkpoint after SIGUSR1
    preempted_at: list[float] = msgspec.field(default_factory=list)  # when its attempts were preempted
    borrowed: int = 0  # GPUs of the current attempt beyond its VC's quota
    last_nodes: list[str] = msgspec.field(default_factory=list)  # where the latest attempt was placed
    final_metrics: dict[str, float] | None = None  # what rank 0 last reported, once finished
    # Elastic jobs: the generation of the current attempt (0 at placement, +1 per JobResized),
    # GPUs of workers leaving at the rescale in flight (held until it ends), the allocations of
    # the last generation that completed (a failed rescale rolls back to them), and what the
    # job's rescales measured: samples/s per world size.
    held: int = 0  # GPUs the job holds now: its allocations and the ones it is releasing
    generation: int = 0
    releasing: tuple[ev.Allocation, ...] = ()
    committed: tuple[ev.Allocation, ...] = ()
    rescale: ev.RescaleKind | None = None  # the kind of the rescale in flight
    rescale_failed: bool = False  # the rescale in flight failed: a rollback is due
    rescaled_at: float | None = None
    state_from: str = ""  # the worker whose state the current generation took
    joiners: tuple[str, ...] = ()  # the workers new in the current generation
    lost_workers: list[str] = msgspec.field(default_factory=list)
    throughput: dict[int, float] = msgspec.field(default_factory=dict)
    service_from: float | None = None  # attained service is counted at ``held`` GPUs from here
    # The most memory one of its GPUs held for the job itself (leases lent out of it not counted),
    # over every report while it ran: the memory broker's forecast of what the job needs.
    memory_peak_mb: int = 0

    @property
    def gpus(self) -> int:
        return self.spec.gpus

    @property
    def nodes(self) -> list[str]:
        return [a.node for a in self.allocations]

    def stopping(self) -> bool:
        """The current attempt must end on every node: a part failed, stopped or was lost, a
        cancel was asked for, or it is preempted. Agents stop their parts; the scheduler settles
        once all ended."""
        if self.status not in ACTIVE:
            return False
        return (
            self.cancel_requested
            or self.preempt_reason is not None
            or any(p.outcome != "completed" for p in self.parts_ended.values())
        )

    def running_gpu_s(self, now: float) -> float:
        """GPU-seconds of the current attempt so far (at its current size since its last resize)."""
        if self.status != "running" or self.started_at is None:
            return 0.0
        return self.held * max(0.0, now - (self.service_from or self.started_at))

    @property
    def workers(self) -> tuple[str, ...]:
        """An elastic job's workers in rank order (``<node>/<gpu>``)."""
        return ev.workers_of(self.allocations)

    def plan(self) -> jobenv.ElasticPlan | None:
        """What an elastic job's workers need of the current generation (the agent writes it to them)."""
        if self.spec.elastic is None or self.rendezvous is None or not self.allocations:
            return None
        return jobenv.ElasticPlan(
            generation=self.generation,
            workers=self.workers,
            addr=self.rendezvous.addr,
            port=self.rendezvous.port,
            source=self.state_from,
            joiners=self.joiners,
            decided_at=(self.rescaled_at if self.generation else self.placed_at) or 0.0,
            attempt=self.attempt,
        )

    def survivors(self) -> int:
        """Workers of the current generation that have not died."""
        return sum(1 for w in self.workers if w not in self.lost_workers)

    def all_parts_ended(self) -> bool:
        return bool(self.allocations) and all(a.node in self.parts_ended for a in self.allocations)


class VcState(msgspec.Struct, kw_only=True, gc=False):
    vc: str
    gpu_quota: int | None = None
    can_borrow: bool = True
    weight: float = 1.0


LeaseStatus = Literal["pending", "active"]


class LeaseState(msgspec.Struct, kw_only=True, gc=False):
    """A memory lease of one worker (the job's attempt on GPU ``gpu`` of ``node``): what it asked
    for, the shares granted and not yet released, and the revocations it must answer."""

    lease: str
    job: str
    attempt: int
    node: str
    gpu: int
    mb: int
    min_mb: int = 0
    tiers: tuple[ev.MemoryTier, ...] = ev.MEMORY_TIERS
    requested_at: float = 0.0
    status: LeaseStatus = "pending"
    shares: list[ev.MemoryShare] = msgspec.field(default_factory=list)
    expires_at: float = 0.0
    term_s: float = 0.0
    revoking: dict[int, float] = msgspec.field(default_factory=dict)  # lender GPU -> deadline
    ending_by: float | None = None  # the whole lease was revoked: the deadline to release it all

    @property
    def granted_mb(self) -> int:
        return sum(s.mb for s in self.shares)

    def lenders(self) -> list[int]:
        return [s.gpu for s in self.shares if s.gpu is not None]


def _default_vcs() -> dict[str, VcState]:
    return {"default": VcState(vc="default")}


DEFAULT_HALF_LIFE_S = 12 * 3600.0  # how fast past GPU use stops counting under fair share
# Cluster-wide scheduling parameters (PolicyConfigured.params), whatever the policy, and their defaults.
CLUSTER_PARAMS: dict[str, float] = {
    "half_life_s": DEFAULT_HALF_LIFE_S,
    "preemption_grace_s": 30.0,  # SIGUSR1 to SIGTERM: time for a preempted job to checkpoint
    "max_preemptions_per_hour": 2.0,  # per job
}


class SchedulingConfig(msgspec.Struct, kw_only=True, gc=False):
    """The policy in force, from the latest PolicyConfigured (None: the scheduler's default)."""

    policy: str | None = None
    backfill: bool = True
    params: dict[str, float] = msgspec.field(default_factory=dict)

    def param(self, name: str) -> float:
        return self.params.get(name, CLUSTER_PARAMS[name])

    @property
    def half_life_s(self) -> float:
        return self.param("half_life_s")


class Usage(msgspec.Struct, kw_only=True, gc=False):
    """Decayed GPU-seconds of a user or VC, as of ``at`` (halves every ``half_life_s``)."""

    gpu_s: float = 0.0
    at: float = 0.0

    def value(self, now: float, half_life_s: float) -> float:
        return self.gpu_s * 0.5 ** (max(0.0, now - self.at) / half_life_s)


class ClusterState(msgspec.Struct, kw_only=True, gc=False):
    seq: int = 0  # last stream sequence folded
    now: float = 0.0  # event time of the newest event folded
    nodes: dict[str, NodeState] = msgspec.field(default_factory=dict)
    jobs: dict[str, JobState] = msgspec.field(default_factory=dict)
    queue: list[str] = msgspec.field(default_factory=list)  # pending job ids, in queue order
    vcs: dict[str, VcState] = msgspec.field(default_factory=_default_vcs)
    intake_index: dict[str, str] = msgspec.field(default_factory=dict)  # "source/intake_id" -> job id
    rejected: int = 0
    scheduling: SchedulingConfig = msgspec.field(default_factory=SchedulingConfig)
    usage: dict[str, Usage] = msgspec.field(default_factory=dict)  # "user:<name>" / "vc:<name>" -> past use
    # Placed and running jobs, in placement order: kept by the fold (like ``queue``) so a pass
    # looks at the jobs holding GPUs, not at every job the cluster ever ran.
    active: dict[str, None] = msgspec.field(default_factory=dict)
    vc_used: dict[str, int] = msgspec.field(default_factory=dict)  # GPUs the active jobs hold, per VC
    # The queue by VC (unordered: a pass sorts by policy) and how many wait at each priority: a
    # pass skips a VC whose quota is used up without looking at each of its waiting jobs.
    queued_by_vc: dict[str, dict[str, None]] = msgspec.field(default_factory=dict)
    queued_priorities: dict[int, int] = msgspec.field(default_factory=dict)
    active_priorities: dict[int, int] = msgspec.field(default_factory=dict)  # placed/running jobs per priority
    # Every change to a node ticks the clock; ``node_changes`` lists nodes by their last change,
    # oldest first, so a pass finds the nodes changed since the one before without a scan.
    node_clock: int = 0
    node_changes: dict[str, int] = msgspec.field(default_factory=dict)
    leases: dict[str, LeaseState] = msgspec.field(default_factory=dict)  # memory leases not ended

    # -- derived views (never stored separately, so they cannot drift) --------------

    def capacity_gpus(self) -> int:
        """GPUs of every node ever registered: the most a job could ever get."""
        return sum(len(n.gpus) for n in self.nodes.values())

    def max_gpus_per_node(self) -> int:
        return max((len(n.gpus) for n in self.nodes.values()), default=0)

    def free_gpus(self) -> int:
        return sum(len(n.free_gpus()) for n in self.nodes.values() if n.status == "up")

    def active_jobs(self) -> list[JobState]:
        """Placed and running jobs."""
        return [self.jobs[j] for j in self.active]

    def vc_usage(self) -> dict[str, int]:
        """GPUs held per VC by placed and running jobs (a copy: a pass adds its own placements)."""
        return dict(self.vc_used)

    def changed_since(self, clock: int) -> list[str]:
        """Nodes changed after node clock ``clock``, most recent first."""
        out = []
        for name, at in reversed(self.node_changes.items()):
            if at <= clock:
                break
            out.append(name)
        return out

    def lent_mb(self, node: str) -> dict[int, int]:
        """MiB lent out of each GPU of ``node`` by the leases that hold shares on it."""
        out: dict[int, int] = {}
        for lease in self.leases.values():
            if lease.node != node:
                continue
            for share in lease.shares:
                if share.gpu is not None:
                    out[share.gpu] = out.get(share.gpu, 0) + share.mb
        return out

    def host_lent_mb(self, node: str) -> int:
        return sum(s.mb for lease in self.leases.values() if lease.node == node for s in lease.shares if s.gpu is None)

    def past_usage(self, key: str) -> float:
        """Decayed GPU-seconds of ``user:<name>`` or ``vc:<name>`` as of the newest event."""
        usage = self.usage.get(key)
        return 0.0 if usage is None else usage.value(self.now, self.scheduling.half_life_s)


def intake_key(source: str, intake_id: str) -> str:
    return f"{source}/{intake_id}"


# ---------------------------------------------------------------------------
# the fold


def apply(state: ClusterState, seq: int, event: ev.Event) -> ClusterState:
    """Fold one event into ``state`` (in place) and return it."""
    handler = _HANDLERS.get(type(event))
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


def _account(state: ClusterState, job: JobState, at: float) -> None:
    """Add the ending attempt's GPU time to the job's attained service and its user's and VC's usage."""
    if job.status != "running" or job.started_at is None:
        return
    used = job.held * max(0.0, at - (job.service_from or job.started_at))
    job.service_from = at
    job.service_gpu_s += used
    half_life = state.scheduling.half_life_s
    for key in (f"user:{job.spec.user}", f"vc:{job.spec.vc}"):
        usage = state.usage.setdefault(key, Usage(at=at))
        usage.gpu_s = usage.value(at, half_life) + used
        usage.at = max(usage.at, at)


def _touch(state: ClusterState, node: NodeState) -> None:
    """Record that the fold changed ``node``."""
    state.node_clock += 1
    node.version = state.node_clock
    state.node_changes.pop(node.node, None)
    state.node_changes[node.node] = state.node_clock


def _activate(state: ClusterState, job: JobState) -> None:
    state.active[job.job] = None
    job.held = sum(len(a.gpus) for a in job.allocations)
    state.vc_used[job.spec.vc] = state.vc_used.get(job.spec.vc, 0) + job.held
    state.active_priorities[job.spec.priority] = state.active_priorities.get(job.spec.priority, 0) + 1


def _deactivate(state: ClusterState, job: JobState) -> None:
    if state.active.pop(job.job, False) is None:
        _count_down(state.vc_used, job.spec.vc, job.held)
        _count_down(state.active_priorities, job.spec.priority, 1)
    job.held = 0


def _count_down(counts: dict, key: object, by: int) -> None:
    left = counts[key] - by
    if left:
        counts[key] = left
    else:
        del counts[key]


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
    _index_queued(state, job)


def _index_queued(state: ClusterState, job: JobState) -> None:
    state.queued_by_vc.setdefault(job.spec.vc, {})[job.job] = None
    priority = job.spec.priority
    state.queued_priorities[priority] = state.queued_priorities.get(priority, 0) + 1


def _dequeue(state: ClusterState, job_id: str) -> None:
    try:
        state.queue.remove(job_id)
    except ValueError:
        return
    job = state.jobs[job_id]
    queued = state.queued_by_vc[job.spec.vc]
    del queued[job_id]
    if not queued:
        del state.queued_by_vc[job.spec.vc]
    _count_down(state.queued_priorities, job.spec.priority, 1)


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
    _touch(state, state.nodes[e.node])


def _node_drained(state: ClusterState, seq: int, e: ev.NodeDrained) -> None:
    node = state.nodes.get(e.node)
    if node is not None and node.status != "lost":
        node.status = "drained"
        node.reason = e.reason
        _touch(state, node)


def _node_undrained(state: ClusterState, seq: int, e: ev.NodeUndrained) -> None:
    node = state.nodes.get(e.node)
    if node is not None and node.status == "drained":
        node.status = "up"
        node.reason = ""
    if node is not None:
        _touch(state, node)
        for slot in node.gpus:  # an operator vouches for the node: its GPUs are back in service
            slot.healthy = True
            slot.health_reason = ""


def _node_lost(state: ClusterState, seq: int, e: ev.NodeLost) -> None:
    node = state.nodes.get(e.node)
    if node is None:
        return
    node.status = "lost"
    node.reason = e.reason
    _touch(state, node)
    # Whatever ran there is gone (the agent fences its processes before the loss is declared).
    for job_id in {slot.job for slot in node.gpus if slot.job is not None}:
        job = state.jobs.get(job_id)
        if job is not None and job.status in ACTIVE and e.node not in job.parts_ended:
            job.parts_ended[e.node] = PartEnd(outcome="lost", reason=f"node {e.node} lost: {e.reason}")


def _set_power(state: ClusterState, node_name: str, at: float, moves: dict[str, PowerState]) -> None:
    node = state.nodes.get(node_name)
    if node is not None and node.power in moves:
        node.power = moves[node.power]
        node.power_changed_at = at
        _touch(state, node)


def _node_power_down_requested(state: ClusterState, seq: int, e: ev.NodePowerDownRequested) -> None:
    _set_power(state, e.node, e.at, {"on": "draining"})


def _node_power_up_requested(state: ClusterState, seq: int, e: ev.NodePowerUpRequested) -> None:
    _set_power(state, e.node, e.at, {"draining": "on", "off": "booting"})


def _node_powered_down(state: ClusterState, seq: int, e: ev.NodePoweredDown) -> None:
    _set_power(state, e.node, e.at, {"draining": "off", "on": "off"})


def _node_powered_up(state: ClusterState, seq: int, e: ev.NodePoweredUp) -> None:
    _set_power(state, e.node, e.at, {"booting": "on", "off": "on", "draining": "on"})


def _vc_configured(state: ClusterState, seq: int, e: ev.VcConfigured) -> None:
    state.vcs[e.vc] = VcState(vc=e.vc, gpu_quota=e.gpu_quota, can_borrow=e.can_borrow, weight=e.weight)


def _job_submitted(state: ClusterState, seq: int, e: ev.JobSubmitted) -> None:
    if e.job in state.jobs or e.spec.gpus < 1 or (e.spec.nodes is not None and e.spec.nodes < 1):
        return  # the second submission of an id, or a spec intake would have refused (written by hand)
    job = JobState(job=e.job, spec=e.spec, order=seq, submitted_at=e.at, waiting_since=e.at)
    state.jobs[e.job] = job
    if e.spec.intake_id is not None:
        state.intake_index[intake_key(e.intake_source, e.spec.intake_id)] = e.job
    state.queue.append(e.job)  # seq only grows, so appending keeps queue order
    _index_queued(state, job)


def _job_rejected(state: ClusterState, seq: int, e: ev.JobRejected) -> None:
    state.rejected += 1


def _job_placed(state: ClusterState, seq: int, e: ev.JobPlaced) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status != "pending" or e.attempt != job.attempt:
        return
    if not all(
        alloc.node in state.nodes and all(0 <= i < len(state.nodes[alloc.node].gpus) for i in alloc.gpus)
        for alloc in e.allocations
    ):
        return  # names GPUs that do not exist: never applied (invariants.violations reports it)
    for alloc in e.allocations:
        node = state.nodes[alloc.node]
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
    job.borrowed = e.borrowed
    job.generation = 0
    job.committed = e.allocations
    job.state_from = ev.workers_of(e.allocations)[0] if e.allocations and e.allocations[0].gpus else ""
    job.joiners = ()
    job.releasing = ()
    job.rescale = None
    job.rescale_failed = False
    job.lost_workers = []
    job.service_from = None
    if job.first_placed_at is None:
        job.first_placed_at = e.at
    _dequeue(state, e.job)


def _job_started(state: ClusterState, seq: int, e: ev.JobStarted) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt:
        return
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
    _dequeue(state, e.job)
    _deactivate(state, job)
    job.status = e.outcome
    job.finished_at = e.at
    job.reason = e.reason
    job.final_metrics = e.metrics
    job.parts_ended = {}  # the outcome above sums them up; finished jobs stay small in snapshots


def _task_ended(state: ClusterState, seq: int, e: ev.TaskEnded) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt or e.node not in job.nodes:
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
    job.preempted_at.append(e.at)


def _job_duration_predicted(state: ClusterState, seq: int, e: ev.JobDurationPredicted) -> None:
    job = state.jobs.get(e.job)
    if job is not None:
        job.predicted_s = e.seconds


def _policy_configured(state: ClusterState, seq: int, e: ev.PolicyConfigured) -> None:
    state.scheduling = SchedulingConfig(policy=e.policy, backfill=e.backfill, params=dict(e.params))


def _gpu_health_changed(state: ClusterState, seq: int, e: ev.GpuHealthChanged) -> None:
    node = state.nodes.get(e.node)
    if node is not None and 0 <= e.index < len(node.gpus):
        node.gpus[e.index].healthy = e.healthy
        node.gpus[e.index].health_reason = "" if e.healthy else e.reason
        _touch(state, node)


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
    job.rendezvous = None
    job.reason = e.reason
    job.preempt_reason = None
    job.preempted_for = ""
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
    if not all(
        alloc.node in state.nodes and all(0 <= i < len(state.nodes[alloc.node].gpus) for i in alloc.gpus)
        for alloc in e.allocations
    ):
        return  # names GPUs that do not exist: never applied (invariants.violations reports it)
    new = _gpus_of(e.allocations)
    releasing = (_gpus_of(job.releasing) | _gpus_of(e.releasing)) - new
    held_before = _gpus_of(job.allocations) | _gpus_of(job.releasing)
    for node_name, index in (held_before - new - releasing) | (new - held_before):
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
    _hold(state, job, len(new) + len(releasing))
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


def _as_allocations(gpus: set[tuple[str, int]]) -> tuple[ev.Allocation, ...]:
    by_node: dict[str, list[int]] = {}
    for node, index in sorted(gpus):
        by_node.setdefault(node, []).append(index)
    return tuple(ev.Allocation(node, tuple(indices)) for node, indices in by_node.items())


def _hold(state: ClusterState, job: JobState, held: int) -> None:
    """The job now holds ``held`` GPUs: keep its VC's use in step."""
    if job.job in state.active and held != job.held:
        state.vc_used[job.spec.vc] = state.vc_used.get(job.spec.vc, 0) + held - job.held
        if not state.vc_used[job.spec.vc]:
            del state.vc_used[job.spec.vc]
    job.held = held


def _rescale_completed(state: ClusterState, seq: int, e: ev.RescaleCompleted) -> None:
    job = state.jobs.get(e.job)
    if job is None or job.status not in ACTIVE or e.attempt != job.attempt:
        return
    if e.samples_per_s_before is not None and e.world_before > 0:
        job.throughput[e.world_before] = e.samples_per_s_before
    if e.generation != job.generation or job.rescale is None:
        return
    _free(state, job, job.releasing)
    _account(state, job, e.at)
    job.releasing = ()
    _hold(state, job, sum(len(a.gpus) for a in job.allocations))
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


def _gpu_memory_reported(state: ClusterState, seq: int, e: ev.GpuMemoryReported) -> None:
    node = state.nodes.get(e.node)
    if node is None:
        return
    lent = state.lent_mb(e.node)
    for slot, used in zip(node.gpus, e.used_mb, strict=False):
        slot.used_mb = used
        job = state.jobs.get(slot.job) if slot.job is not None else None
        if job is not None and job.status == "running":
            job.memory_peak_mb = max(job.memory_peak_mb, used - lent.get(slot.info.index, 0))


def _memory_lease_requested(state: ClusterState, seq: int, e: ev.MemoryLeaseRequested) -> None:
    if e.lease in state.leases:
        return  # asked again (an agent restart): the lease stands as it is
    state.leases[e.lease] = LeaseState(
        lease=e.lease,
        job=e.job,
        attempt=e.attempt,
        node=e.node,
        gpu=e.gpu,
        mb=e.mb,
        min_mb=e.min_mb,
        tiers=e.tiers,
        requested_at=e.at,
    )


def _memory_lease_granted(state: ClusterState, seq: int, e: ev.MemoryLeaseGranted) -> None:
    lease = state.leases.get(e.lease)
    if lease is None:
        return
    lease.shares.extend(e.shares)
    lease.status = "active"
    lease.term_s = max(0.0, e.expires_at - e.at)
    lease.expires_at = e.expires_at


def _memory_lease_renewed(state: ClusterState, seq: int, e: ev.MemoryLeaseRenewed) -> None:
    lease = state.leases.get(e.lease)
    if lease is not None and lease.status == "active" and lease.ending_by is None:
        lease.expires_at = max(lease.expires_at, e.at + lease.term_s)


def _memory_lease_revoked(state: ClusterState, seq: int, e: ev.MemoryLeaseRevoked) -> None:
    lease = state.leases.get(e.lease)
    if lease is None:
        return
    if not e.gpus:
        lease.ending_by = e.deadline if lease.ending_by is None else min(lease.ending_by, e.deadline)
    for gpu in e.gpus or lease.lenders():
        lease.revoking[gpu] = min(lease.revoking.get(gpu, e.deadline), e.deadline)


def _memory_lease_released(state: ClusterState, seq: int, e: ev.MemoryLeaseReleased) -> None:
    lease = state.leases.get(e.lease)
    if lease is None:
        return
    if not e.gpus:
        del state.leases[e.lease]
        return
    lease.shares = [s for s in lease.shares if s.gpu not in e.gpus]
    for gpu in e.gpus:
        lease.revoking.pop(gpu, None)


def _memory_lease_ended(state: ClusterState, seq: int, e: ev.MemoryLeaseDenied | ev.MemoryLeaseReclaimed) -> None:
    state.leases.pop(e.lease, None)


_HANDLERS: dict[type, Callable[[ClusterState, int, ev.Event], None]] = {
    ev.NodeRegistered: _node_registered,
    ev.NodeDrained: _node_drained,
    ev.NodeUndrained: _node_undrained,
    ev.NodeLost: _node_lost,
    ev.NodePowerDownRequested: _node_power_down_requested,
    ev.NodePowerUpRequested: _node_power_up_requested,
    ev.NodePoweredDown: _node_powered_down,
    ev.NodePoweredUp: _node_powered_up,
    ev.VcConfigured: _vc_configured,
    ev.JobSubmitted: _job_submitted,
    ev.JobRejected: _job_rejected,
    ev.JobPlaced: _job_placed,
    ev.JobStarted: _job_started,
    ev.JobFinished: _job_finished,
    ev.TaskEnded: _task_ended,
    ev.JobCancelRequested: _job_cancel_requested,
    ev.JobRequeued: _job_requeued,
    ev.JobPreempted: _job_preempted,
    ev.JobDurationPredicted: _job_duration_predicted,
    ev.PolicyConfigured: _policy_configured,
    ev.GpuHealthChanged: _gpu_health_changed,
    ev.JobResized: _job_resized,
    ev.RescaleCompleted: _rescale_completed,
    ev.RescaleFailed: _rescale_failed,
    ev.WorkerLost: _worker_lost,
    ev.GpuMemoryReported: _gpu_memory_reported,
    ev.MemoryLeaseRequested: _memory_lease_requested,
    ev.MemoryLeaseGranted: _memory_lease_granted,
    ev.MemoryLeaseRenewed: _memory_lease_renewed,
    ev.MemoryLeaseRevoked: _memory_lease_revoked,
    ev.MemoryLeaseReleased: _memory_lease_released,
    ev.MemoryLeaseDenied: _memory_lease_ended,
    ev.MemoryLeaseReclaimed: _memory_lease_ended,
}  # type: ignore[dict-item]

# Bumped whenever the state's layout or an index kept by the fold changes meaning: a snapshot of
# another format is not read (its indexes could be missing or stale) and the state is rebuilt
# from the log, which is always possible.
STATE_FORMAT = 6


class _Stored(msgspec.Struct, array_like=True):
    format: int
    state: msgspec.Raw


_snapshot_encoder = msgspec.msgpack.Encoder()
_stored_decoder = msgspec.msgpack.Decoder(_Stored)
_state_decoder = msgspec.msgpack.Decoder(ClusterState)


def encode_state(state: ClusterState) -> bytes:
    return _snapshot_encoder.encode(_Stored(STATE_FORMAT, msgspec.Raw(_snapshot_encoder.encode(state))))


def decode_state(data: bytes) -> ClusterState:
    """The state of a snapshot; ``msgspec.DecodeError`` if it is of another format (rebuild it)."""
    stored = _stored_decoder.decode(data)
    if stored.format != STATE_FORMAT:
        raise msgspec.DecodeError(f"state snapshot of format {stored.format}; this build reads {STATE_FORMAT}")
    return _state_decoder.decode(stored.state)
