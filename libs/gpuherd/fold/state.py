"""What every reader of the log knows: nodes, their GPUs and who holds them, and each job's life cycle.

The state is a tree of msgspec Structs, so a snapshot is one msgpack encode, and can always be
rebuilt from the log. Services extend it (a subclass with what only they need: the scheduler's
queue indexes, the memory broker's leases, ...) and fold their part after the core's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal, TypeVar

import msgspec

from gpuherd import events as ev
from gpuherd import jobenv

NodeStatus = Literal["up", "drained", "lost"]
PowerState = Literal["on", "draining", "off", "booting"]  # cluster energy saving (CES)
JobStatus = Literal["pending", "placed", "running", "completed", "failed", "cancelled", "timeout"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled", "timeout"})
ACTIVE: frozenset[str] = frozenset({"placed", "running"})


class GpuSlot(msgspec.Struct, kw_only=True, gc=False):
    info: ev.GpuInfo
    job: str | None = None  # the job holding this GPU, if any
    healthy: bool = True
    health_reason: str = ""  # why it is unhealthy (the agent's words)


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
    # lets a reader keep per-node views between passes and recompute only the nodes that changed.
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


K = TypeVar("K")
V = TypeVar("V")


def oldest_first(entries: dict[K, V]) -> OrderedDict[K, V]:
    """``entries`` (a state's map kept in arrival order, whose oldest entries are dropped as new ones
    come) as an OrderedDict. A dict popped from the front keeps the holes before its first entry
    until it resizes, and finding that entry scans them: tens of microseconds per drop at 50,000
    entries, where an OrderedDict finds it at once. A snapshot decodes such a field as a dict: a
    state's ``__post_init__`` makes it ordered again with this."""
    return entries if type(entries) is OrderedDict else OrderedDict(entries)


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
    service_gpu_s: float = 0.0  # attained service of ended attempts and past sizes: GPUs x seconds run
    service_from: float | None = None  # attained service is counted at ``held`` GPUs from here
    waiting_since: float = 0.0  # when it last became pending (submitted or requeued)
    preempt_reason: str | None = None  # set while the current attempt is being preempted
    preempted_for: str = ""  # the job its GPUs go to
    preempt_grace_s: float = 0.0  # how long its processes have to checkpoint after SIGUSR1
    time_limit_reached: bool = False  # the current attempt ran past its time limit: it is stopping
    borrowed: int = 0  # GPUs of the current attempt beyond its VC's quota
    last_nodes: list[str] = msgspec.field(default_factory=list)  # where the latest attempt was placed
    final_metrics: dict[str, float] | None = None  # what rank 0 last reported, once finished
    # Elastic jobs: the generation of the current attempt (0 at placement, +1 per JobResized),
    # GPUs of workers leaving at the rescale in flight (held until it ends), and the allocations of
    # the last generation that completed (a failed rescale rolls back to them).
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
    # Elastic jobs: "<node> <id>" of the current attempt's starts and ends of parts folded so far. A part
    # may leave a node and come back within an attempt, and a report stored twice (a relay's page
    # and its agent's own append, ``gpuherd.log.relay``) must not speak for the part that came back.
    reports: list[str] = msgspec.field(default_factory=list)

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
            or self.time_limit_reached
            or (bool(self.parts_ended) and any(p.outcome != "completed" for p in self.parts_ended.values()))
        )  # (a pass asks this of every running job: no generator while no part has ended)

    def deadline(self) -> float | None:
        """When the running attempt reaches its time limit (None: no limit, or not started)."""
        if self.spec.time_limit_s is None or self.started_at is None or self.status != "running":
            return None
        return self.started_at + self.spec.time_limit_s

    def running_gpu_s(self, now: float) -> float:
        """GPU-seconds of the current attempt so far (at its current size since its last resize)."""
        if self.status != "running" or self.started_at is None:
            return 0.0
        return self.held * max(0.0, now - (self.service_from or self.started_at))

    def attained_s(self, now: float) -> float:
        """Seconds of work done, all attempts and sizes (GPU-seconds over the GPUs it asked for)."""
        return (self.service_gpu_s + self.running_gpu_s(now)) / self.spec.gpus

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
    default_time_limit_s: float | None = None
    max_time_limit_s: float | None = None
    max_gpus_per_user: int | None = None
    max_running_per_user: int | None = None

    def borrowing(self, in_use: int) -> int:
        """GPUs the VC borrows while it holds ``in_use``: its use beyond its quota (as Kueue counts
        it), whatever its jobs borrowed when they were placed (their older jobs may have ended)."""
        return 0 if self.gpu_quota is None else max(0, in_use - self.gpu_quota)


def _default_vcs() -> dict[str, VcState]:
    return {"default": VcState(vc="default")}


class ClusterState(msgspec.Struct, kw_only=True, gc=False):
    """The core fold. ``retain_finished`` False drops a job once it ended (a service's hot state is
    then bounded by live jobs; ``ended`` keeps the counts). ``partial`` marks a fold that keeps some
    nodes only (a node agent keeps its own): events naming other nodes are taken as they are."""

    seq: int = 0  # last stream sequence folded
    now: float = 0.0  # event time of the newest event folded
    nodes: dict[str, NodeState] = msgspec.field(default_factory=dict)
    jobs: dict[str, JobState] = msgspec.field(default_factory=dict)
    queue: list[str] = msgspec.field(default_factory=list)  # pending job ids, in submission order
    vcs: dict[str, VcState] = msgspec.field(default_factory=_default_vcs)
    # Placed and running jobs, in placement order: a reader looks at the jobs holding GPUs, not at
    # every job the cluster ever ran.
    active: dict[str, None] = msgspec.field(default_factory=dict)
    ended: dict[str, int] = msgspec.field(default_factory=dict)  # jobs ended, by outcome
    node_clock: int = 0  # ticks at every change of a node; the node keeps the tick of its last change
    registrations: int = 0  # NodeRegistered applied: what nodes there are changed
    touched: list[str] = msgspec.field(default_factory=list)  # nodes the last event folded changed
    accounted: list[tuple[str, float, float]] = msgspec.field(default_factory=list)  # (job, at, GPU-s) it ran
    retain_finished: bool = True
    partial: bool = False

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

    def waiting(self) -> list[JobState]:
        """Pending jobs in submission order (cancelled ones included until they are settled)."""
        return [self.jobs[j] for j in self.queue]
