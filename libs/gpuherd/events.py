"""The event catalogue: every fact gpuherd records, as small msgspec Structs.

All events live in one tagged union (the JSON field ``type`` names the class),
so a single typed decoder reads the whole log. Each class carries its schema
version in ``v``; when a class changes shape its version goes up and an
*upcaster* turns the stored old shape into the current one on read, so the log
is never rewritten (the `eventsourcing` library's approach).

Every event has ``id`` (also the JetStream ``Nats-Msg-Id``, so appends are
idempotent), ``at`` (event time, Unix seconds), ``source`` (who wrote it) and
``v``. Decisions, events a service writes in reaction to the log, also carry
``based_on`` (the last stream sequence the decider had folded) and ``cause``
(the id of the event that triggered them); an audit re-runs the decider on the
state at ``based_on`` and checks it would decide the same again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import msgspec

from gpuherd.errors import EventDecodeError
from gpuherd.jobenv import worker_id as worker_id

# ---------------------------------------------------------------------------
# base classes


class Event(msgspec.Struct, kw_only=True, frozen=True, tag_field="type", tag=True, gc=False):
    """Base of every event. ``VERSION`` is the current schema version of the class."""

    VERSION: ClassVar[int] = 1

    id: str = ""
    at: float = 0.0
    source: str = ""
    v: int = 1

    def subject(self) -> str:
        """The subject of the aggregate this event belongs to (one per job, node, ...)."""
        raise NotImplementedError


class Decision(Event, kw_only=True, frozen=True):
    """An event a service decided on, from the log it had folded up to ``based_on``."""

    based_on: int = 0
    cause: str = ""


def reported_by(aggregate: str, node: str) -> str:
    """The subject of an event a node's agent writes: its aggregate's subject tagged with the node
    (``herd.job.<id>.by.<node>``), so NATS permissions can hold each agent to its own node."""
    return f"{aggregate}.by.{node}" if node else aggregate


# ---------------------------------------------------------------------------
# value types


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One GPU of a node, as its agent saw it at registration."""

    index: int
    uuid: str
    model: str
    memory_mb: int
    nvlink_peers: tuple[int, ...] = ()  # indices of GPUs on the same node linked by NVLink


def declared_gpus(node: str, count: int, *, island: int, model: str, memory_mb: int) -> list[GpuInfo]:
    """GPUs an operator declares (``sim`` and ``cpu`` agents, simulated clusters): ``count`` of
    them in NVLink islands of ``island`` GPUs each (0: the whole node is one island)."""
    size = island or count
    out = []
    for i in range(count):
        first = (i // size) * size
        peers = tuple(j for j in range(first, min(first + size, count)) if j != i)
        out.append(GpuInfo(index=i, uuid=f"{model}-{node}-{i}", model=model, memory_mb=memory_mb, nvlink_peers=peers))
    return out


LrScaling = Literal["linear"]
MemoryTier = Literal["nvlink", "pcie", "host"]  # fastest first: a neighbor over NVLink, over PCIe, pinned host RAM
MEMORY_TIERS: tuple[MemoryTier, ...] = ("nvlink", "pcie", "host")


class MemoryNeeds(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Memory each of a job's workers wants beyond its own GPU: ``extra_mb`` MiB, leased from
    neighbor GPUs of the same node (NVLink peers first, up to 3 of them) and pinned host memory.
    A grant below ``min_mb`` is not made (the request waits); ``tiers`` are the kinds it accepts."""

    extra_mb: int
    min_mb: int = 0
    tiers: tuple[MemoryTier, ...] = MEMORY_TIERS


class Elastic(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An elastic job runs on ``min`` to ``max`` GPUs (one worker process each) and is resized
    while it runs. ``global_batch`` samples a step at every size (``micro_batch`` per forward):
    each world size it may take must divide ``global_batch`` by ``world x micro_batch``, unless the
    job declares ``lr_scaling`` (then a step is ``world x micro_batch`` samples and the learning
    rate follows the rule), in which case only the sizes that keep the global batch are exact."""

    min: int
    max: int
    global_batch: int | None = None
    micro_batch: int | None = None
    lr_scaling: LrScaling | None = None

    def sizes(self) -> list[int]:
        """The world sizes the job may run at: all of min..max, or those that keep the global batch."""
        every = list(range(self.min, self.max + 1))
        if self.global_batch is None or self.micro_batch is None or self.lr_scaling is not None:
            return every
        return [w for w in every if self.global_batch % (w * self.micro_batch) == 0]


class JobSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """What a submitter asks for. See ``services/scheduler/intake.py`` for validation rules."""

    name: str
    user: str
    gpus: int
    vc: str = "default"
    nodes: int | None = None  # when set, gpus are split evenly over exactly this many nodes
    command: tuple[str, ...] | None = None
    duration_s: float | None = None  # how long a `sim` job runs
    priority: int = 0
    elastic: Elastic | None = None
    intake_id: str | None = None
    max_retries: int = 0  # how often a failed attempt is retried before the job fails
    procs_per_node: int | None = None  # processes per node; default: one per GPU given on that node
    env: dict[str, str] | None = None  # extra environment of the job's processes
    workdir: str | None = None  # working directory of the job's processes (default: the agent's)
    memory: MemoryNeeds | None = None  # lease memory beyond the job's GPUs (the memory broker's tiers)


class Allocation(msgspec.Struct, frozen=True, gc=False):
    node: str
    gpus: tuple[int, ...]


class Rendezvous(msgspec.Struct, frozen=True, gc=False):
    """Where a job's processes meet (torch.distributed MASTER_ADDR/MASTER_PORT), chosen by the scheduler."""

    addr: str
    port: int


Locality = Literal["island", "node", "rack", "cluster"]
PartOutcome = Literal["completed", "failed", "stopped", "lost"]


Outcome = Literal["completed", "failed", "cancelled"]

# ---------------------------------------------------------------------------
# nodes


class NodeRegistered(Event, kw_only=True, frozen=True):
    """An agent announced its node and inventory (again after every agent start).

    v1 described a homogeneous node (``gpu_count``, ``gpu_model``,
    ``gpu_memory_mb``); v2 lists every GPU with its UUID and NVLink peers.
    """

    VERSION: ClassVar[int] = 2
    v: int = 2
    node: str
    gpus: tuple[GpuInfo, ...]
    rack: str = ""
    executor: str = "sim"
    boot_id: str = ""
    address: str = ""  # where peers reach this node (a job's rendezvous, when it leads the gang)
    port_range: tuple[int, int] | None = None  # [first, last] ports the scheduler may give to rendezvous here
    host_memory_mb: int = 0  # the node's RAM (0: not said); the memory broker lends part of it as pinned host tier

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodeDrained(Event, kw_only=True, frozen=True):
    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodeUndrained(Event, kw_only=True, frozen=True):
    node: str

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodeLost(Decision, kw_only=True, frozen=True):
    """The scheduler decided the node is gone (its heartbeats stopped); its jobs are requeued."""

    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class ClockTicked(Event, kw_only=True, frozen=True):
    """A service's timer, recorded so that time-driven decisions replay exactly.

    ``last_heard`` is when the ticking service last heard from each node (a
    heartbeat, or its own reconnect: an outage of the observer is no evidence
    against a node). The scheduler declares a node lost when a tick shows it
    silent for longer than ``lost_after_s``.
    """

    last_heard: dict[str, float]
    lost_after_s: float

    def subject(self) -> str:
        return f"herd.clock.{self.source or 'anon'}"


# ---------------------------------------------------------------------------
# virtual clusters


class NodePowerDownRequested(Decision, kw_only=True, frozen=True):
    """Cluster energy saving: forecast demand does not need this node for a while. Its agent
    drains it (no new work; running parts end on their own), then powers it down."""

    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodePowerUpRequested(Decision, kw_only=True, frozen=True):
    """Demand is back (forecast, or jobs wait for GPUs only powered-down nodes have): the agent
    stops draining the node, or powers it on."""

    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodePoweredDown(Event, kw_only=True, frozen=True):
    """The agent drained its node and ran its power-down hook: the node is off."""

    node: str
    cause: str = ""  # the request it carried out

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodePoweredUp(Event, kw_only=True, frozen=True):
    """The node is on and serving again (its power-up hook succeeded)."""

    node: str
    cause: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


# A ClockTicked with this timeout (and no nodes heard) only marks time: no node can have been
# silent that long, so it declares no loss. Simulations and the analytics timer tick this way.
TICK_ONLY_TIMEOUT_S = 1e15


class VcConfigured(Event, kw_only=True, frozen=True):
    """A virtual cluster: a team's share of the cluster.

    ``gpu_quota`` GPUs are its own (None: no quota, it may use any free GPU).
    With ``can_borrow`` its jobs may also run on idle GPUs beyond its quota;
    those borrowed GPUs are given back (by preemption) when a VC whose quota
    they fall under has jobs waiting. ``weight`` is its share under fair share.
    """

    vc: str
    gpu_quota: int | None = None
    can_borrow: bool = True
    weight: float = 1.0

    def subject(self) -> str:
        return f"herd.vc.{self.vc}"


class PolicyConfigured(Event, kw_only=True, frozen=True):
    """The cluster's scheduling policy from now on (see ``services/scheduler/policy.py``).

    ``params`` tune it (e.g. ``half_life_s`` for fair share, ``thresholds_gpu_s`` for LAS);
    unknown names are rejected by the CLI before they get here."""

    policy: str
    backfill: bool = True
    params: dict[str, float] = msgspec.field(default_factory=dict)

    def subject(self) -> str:
        return "herd.cluster.policy"


class GpuHealthChanged(Event, kw_only=True, frozen=True):
    """An agent saw a GPU turn unhealthy (XID error, uncorrected ECC, fell off the bus) or recover."""

    node: str
    index: int
    healthy: bool
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


# ---------------------------------------------------------------------------
# jobs


class JobSubmitted(Decision, kw_only=True, frozen=True):
    """A valid submission from intake; the job exists from here on."""

    job: str
    spec: JobSpec
    intake_source: str
    intake_seq: int = 0

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobRejected(Decision, kw_only=True, frozen=True):
    """An invalid submission, kept with its reason so nothing is dropped silently."""

    intake_source: str
    intake_seq: int
    intake_id: str | None = None
    reason: str
    payload_excerpt: str = ""  # the first bytes of the submission, for the submitter to see

    def subject(self) -> str:
        return f"herd.rejected.{self.intake_source}"


class JobPlaced(Decision, kw_only=True, frozen=True):
    """The scheduler gave GPUs to a job attempt (all of its gang at once)."""

    job: str
    attempt: int
    allocations: tuple[Allocation, ...]  # the first allocation's node leads the gang (rank 0)
    reason: str = ""
    locality: Locality | None = None  # the tightest level the whole gang fits in
    rendezvous: Rendezvous | None = None
    borrowed: int = 0  # GPUs beyond its VC's quota, taken from idle capacity (reclaimable)

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobStarted(Decision, kw_only=True, frozen=True):
    """An agent started its part of a job attempt."""

    job: str
    attempt: int
    node: str

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


class JobFinished(Decision, kw_only=True, frozen=True):
    """A job reached a terminal state. A finished job never runs again."""

    job: str
    attempt: int
    outcome: Outcome
    node: str = ""
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""  # the last lines of the deciding process's output
    metrics: dict[str, float] | None = None  # the last metrics rank 0 reported (loss, steps, ...)

    def subject(self) -> str:
        return f"herd.job.{self.job}"


MAX_OUTPUT_TAIL = 2048  # bytes of output kept in an event; the rest is in the agent's log files


class TaskEnded(Event, kw_only=True, frozen=True):
    """One node's part (task) of a job attempt ended. The scheduler settles the attempt once
    every part has ended: completed, failed (retry or not), or requeued."""

    job: str
    attempt: int
    node: str
    outcome: PartOutcome
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""
    metrics: dict[str, float] | None = None

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


class JobCancelRequested(Event, kw_only=True, frozen=True):
    job: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobDurationPredicted(Decision, kw_only=True, frozen=True):
    """A duration model's estimate of how long a job runs (QSSF, SJF and backfill use it).
    ``basis`` says what history it came from (e.g. ``vc+gpus: 40 jobs``)."""

    job: str
    seconds: float
    model: str = ""
    basis: str = ""

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobPreempted(Decision, kw_only=True, frozen=True):
    """The scheduler takes a running attempt's GPUs back. Agents send the checkpoint signal
    (SIGUSR1), wait ``grace_s``, then stop the task; the attempt is then requeued."""

    job: str
    attempt: int
    reason: str
    by: str = ""  # the job the GPUs go to, if one
    grace_s: float = 30.0

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobRequeued(Decision, kw_only=True, frozen=True):
    """A placed or running attempt ended without finishing the job; it waits again."""

    job: str
    attempt: int  # the attempt that ended; the next one is attempt + 1
    reason: str

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class ProfileRequested(Event, kw_only=True, frozen=True):
    """Someone asks a running job for a per-layer profile of ``steps`` of its own training steps
    (``gpuherd profile --job``). The agents running it pass the request to the job's leader rank."""

    job: str
    steps: int = 5

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class ProfileReported(Event, kw_only=True, frozen=True):
    """A rank's per-layer profile of its own steps (``gpuherd.train.profile.StepProfile.to_dict()``:
    per layer forward/backward time, FLOPs, bytes, memory; the device's measured roofs)."""

    job: str
    attempt: int
    node: str
    rank: int
    request: str = ""  # the ProfileRequested id it answers
    profile: dict[str, Any] = msgspec.field(default_factory=dict)

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


# ---------------------------------------------------------------------------
# elastic jobs: grow and shrink while running


RescaleKind = Literal["grow", "shrink", "recover", "rollback"]


class RescaleProposed(Decision, kw_only=True, frozen=True):
    """The elastic service would run an elastic job at ``gpus`` GPUs: grow into GPUs that would
    stay idle, or shrink so that waiting jobs start. The scheduler, sole owner of GPUs, commits it
    (``JobResized``) if it still holds when it decides; a stale proposal changes nothing."""

    job: str
    attempt: int
    generation: int  # the generation it was based on
    gpus: int
    reason: str = ""
    expected_samples_per_s: float | None = None  # the policy's prediction at the new size

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobResized(Decision, kw_only=True, frozen=True):
    """A new generation of a running elastic job. Its workers, in rank order, are the GPUs of
    ``allocations`` (a worker is ``<node>/<gpu>``); they meet at ``rendezvous`` (a new store for
    every generation) and take the state of ``state_from``, the oldest surviving worker. ``joiners``
    are started now; GPUs in ``releasing`` stay the job's until the rescale ends (their workers
    take part in the switch, then leave)."""

    job: str
    attempt: int
    generation: int
    allocations: tuple[Allocation, ...]
    rendezvous: Rendezvous | None = None
    state_from: str = ""
    joiners: tuple[str, ...] = ()
    releasing: tuple[Allocation, ...] = ()
    kind: RescaleKind = "grow"
    reason: str = ""
    borrowed: int = 0  # GPUs beyond the VC's quota after the resize

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class RescaleCompleted(Event, kw_only=True, frozen=True):
    """The job's new rank 0 finished its first step at the new size. ``times`` are wall-clock
    (event-time) stamps of each phase: decided, noticed, quiesced, reformed, restored, first_step."""

    job: str
    attempt: int
    generation: int
    node: str
    world: int
    world_before: int
    times: dict[str, float] = msgspec.field(default_factory=dict)
    samples_per_s_before: float | None = None  # measured throughput at the old size

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)

    def durations(self) -> dict[str, float]:
        t = self.times
        pairs = {
            "notice_s": ("decided", "noticed"),
            "wait_s": ("noticed", "quiesced"),
            "reform_s": ("quiesced", "reformed"),
            "restore_s": ("reformed", "restored"),
            "first_step_s": ("restored", "first_step"),
            "pause_s": ("quiesced", "first_step"),
            "total_s": ("decided", "first_step"),
        }
        return {name: t[b] - t[a] for name, (a, b) in pairs.items() if a in t and b in t}


class RescaleFailed(Event, kw_only=True, frozen=True):
    """A switch to ``generation`` failed on a worker (it rolled back to the state committed at the
    old size). The scheduler commits a rollback generation of the workers that still hold state."""

    job: str
    attempt: int
    generation: int
    node: str
    reason: str
    step: int = 0  # the step the job rolled back to

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


class ElasticConfigured(Event, kw_only=True, frozen=True):
    """The elastic service's parameters from now on (``services/elastic/policy.py:ElasticParams``;
    names not given keep their defaults). Recorded so that a replay audits with the parameters each
    decision was made with."""

    params: dict[str, float] = msgspec.field(default_factory=dict)

    def subject(self) -> str:
        return "herd.cluster.elastic"


class WorkerLost(Event, kw_only=True, frozen=True):
    """A worker of a running elastic job died outside a planned rescale. The job shrinks to the
    survivors while they are at least its minimum."""

    job: str
    attempt: int
    node: str
    gpu: int
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


# ---------------------------------------------------------------------------
# memory leases: spare memory of neighbor GPUs and pinned host memory (services/memory)


class GpuMemoryReported(Event, kw_only=True, frozen=True):
    """A node's GPUs' memory in use (MiB, by GPU index), written by its agent when a GPU's use moved
    by more than its reporting step. Folded into the view of spare memory the broker lends from:
    a state change worth recording, unlike the telemetry stream's every sample."""

    node: str
    used_mb: tuple[int, ...]

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class MemoryShare(msgspec.Struct, frozen=True, gc=False):
    """Part of a lease: ``mb`` MiB on lender GPU ``gpu`` (same node as the borrower), or of pinned
    host memory (``tier`` "host", ``gpu`` None)."""

    tier: MemoryTier
    mb: int
    gpu: int | None = None


class MemoryLeaseRequested(Event, kw_only=True, frozen=True):
    """The agent running a worker on GPU ``gpu`` of ``node`` asks for ``mb`` MiB beyond it (the job's
    ``MemoryNeeds``). One lease per (job attempt, node, GPU); ``lease`` is derived from them."""

    lease: str
    job: str
    attempt: int
    node: str
    gpu: int
    mb: int
    min_mb: int = 0
    tiers: tuple[MemoryTier, ...] = MEMORY_TIERS

    def subject(self) -> str:
        return reported_by(f"herd.lease.{self.lease}", self.node)


class MemoryLeaseGranted(Decision, kw_only=True, frozen=True):
    """The broker adds ``shares`` to the lease (a first grant, or a top-up after a revocation).
    The lease holds until ``expires_at`` unless its agent renews it; the runtime must never use
    more of a lender than its share."""

    lease: str
    job: str
    attempt: int
    node: str
    gpu: int
    shares: tuple[MemoryShare, ...]
    expires_at: float
    reason: str = ""

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


class MemoryLeaseDenied(Decision, kw_only=True, frozen=True):
    """A request the broker will never grant (the job does not run there, a size out of range)."""

    lease: str
    job: str
    reason: str

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


class MemoryLeaseRenewed(Event, kw_only=True, frozen=True):
    """The borrower's agent says its task still runs: the lease holds for another term."""

    lease: str
    job: str
    node: str = ""  # the borrower's node (its agent writes this); empty in logs before permissions

    def subject(self) -> str:
        return reported_by(f"herd.lease.{self.lease}", self.node)


class MemoryLeaseRevoked(Decision, kw_only=True, frozen=True):
    """The borrower must give back its shares on lender ``gpus`` (empty: the whole lease, host
    share included) by ``deadline``: the lender's own job needs the memory, a job was placed on the
    lender, or the lease expired. The runtime moves the blocks to host and acknowledges."""

    lease: str
    job: str
    gpus: tuple[int, ...] = ()
    deadline: float
    reason: str

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


class MemoryLeaseReleased(Event, kw_only=True, frozen=True):
    """The borrower no longer uses its shares on lender ``gpus`` (empty: the whole lease): its
    runtime's acknowledgment of a revocation, relayed by the agent, or its task ended."""

    lease: str
    job: str
    gpus: tuple[int, ...] = ()
    reason: str = ""
    node: str = ""  # the borrower's node (its agent writes this); empty in logs before permissions

    def subject(self) -> str:
        return reported_by(f"herd.lease.{self.lease}", self.node)


class MemoryBrokerConfigured(Event, kw_only=True, frozen=True):
    """The memory broker's parameters (``services/memory/policy.BrokerParams``) from here on;
    recorded in the log so that a replay lends and revokes as the live broker did."""

    params: dict[str, float] = msgspec.field(default_factory=dict)

    def subject(self) -> str:
        return "herd.cluster.memory"


class MemoryLeaseReclaimed(Decision, kw_only=True, frozen=True):
    """The broker ends a lease whose borrower is gone (attempt ended, worker moved, node lost) or
    missed a revocation's deadline (its agent then stops the task: the lender's owner comes first)."""

    lease: str
    job: str
    reason: str
    deadline_missed: bool = False

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


AnyEvent = (
    NodeRegistered
    | NodeDrained
    | NodeUndrained
    | NodeLost
    | NodePowerDownRequested
    | NodePowerUpRequested
    | NodePoweredDown
    | NodePoweredUp
    | ClockTicked
    | VcConfigured
    | PolicyConfigured
    | GpuHealthChanged
    | JobSubmitted
    | JobRejected
    | JobPlaced
    | JobStarted
    | JobFinished
    | TaskEnded
    | JobCancelRequested
    | JobDurationPredicted
    | JobPreempted
    | JobRequeued
    | ProfileRequested
    | ProfileReported
    | RescaleProposed
    | JobResized
    | RescaleCompleted
    | RescaleFailed
    | WorkerLost
    | ElasticConfigured
    | GpuMemoryReported
    | MemoryLeaseRequested
    | MemoryLeaseGranted
    | MemoryLeaseDenied
    | MemoryLeaseRenewed
    | MemoryLeaseRevoked
    | MemoryLeaseReleased
    | MemoryLeaseReclaimed
    | MemoryBrokerConfigured
)

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in AnyEvent.__args__}  # type: ignore[attr-defined]

# ---------------------------------------------------------------------------
# upcasting

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register a function turning version ``from_version`` of ``event_type`` into the next one."""

    def register(fn: Upcaster) -> Upcaster:
        _UPCASTERS[(event_type, from_version)] = fn
        return fn

    return register


@upcaster("NodeRegistered", 1)
def _node_registered_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    count = int(raw.pop("gpu_count"))
    model = raw.pop("gpu_model", "unknown")
    memory_mb = int(raw.pop("gpu_memory_mb", 0))
    node = raw["node"]
    # v1 agents knew nothing of UUIDs or NVLink: derive stable ids, no peers.
    raw["gpus"] = [{"index": i, "uuid": f"{node}-gpu{i}", "model": model, "memory_mb": memory_mb} for i in range(count)]
    raw["v"] = 2
    return raw


def upcast(raw: dict[str, Any]) -> dict[str, Any]:
    """Bring a raw event dict up to its class's current version."""
    type_name = raw.get("type")
    cls = EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown event type {type_name!r}")
    version = int(raw.get("v", 1))
    while version < cls.VERSION:
        step = _UPCASTERS.get((cls.__name__, version))
        if step is None:
            raise EventDecodeError(f"no upcaster for {cls.__name__} v{version} -> v{version + 1}")
        raw = step(dict(raw))
        version = int(raw.get("v", version + 1))
    return raw


# ---------------------------------------------------------------------------
# encoding

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)
_raw_decoder = msgspec.json.Decoder(dict[str, Any])


class Unreadable(Event, kw_only=True, frozen=True):
    """A stored message that does not decode as an event. Readers make it (it is never written):
    deciders fold it as nothing, and their shell reports it as a dead letter, so one bad message
    neither stops every reader of the log nor vanishes."""

    stored_subject: str
    reason: str
    data: bytes = b""

    def subject(self) -> str:
        return self.stored_subject


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> Event:
    """Decode one stored event; old versions go through the upcasters."""
    try:
        event = _decoder.decode(data)
    except msgspec.ValidationError:
        event = None  # possibly an older shape: take the slow path
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not an event: {exc}") from exc
    if event is not None and event.v == type(event).VERSION:
        return event
    try:
        raw = _raw_decoder.decode(data)
        return msgspec.convert(upcast(raw), AnyEvent)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"invalid event: {exc}") from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a field an upcaster needs is unusable
        raise EventDecodeError(f"invalid event: {type(exc).__name__}: {exc}") from exc


def workers_of(allocations: tuple[Allocation, ...]) -> tuple[str, ...]:
    """An elastic job's workers in rank order: one per GPU, named ``<node>/<gpu>``."""
    return tuple(worker_id(a.node, g) for a in allocations for g in a.gpus)


def stable_id(*parts: str, length: int = 12) -> str:
    """A short deterministic id from its inputs (safe as a NATS subject token)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()
    return digest[:length]
