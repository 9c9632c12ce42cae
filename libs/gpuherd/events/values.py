"""Value types the events carry: GPUs, job specs, allocations, memory shares."""

from __future__ import annotations

from typing import Literal

import msgspec

from gpuherd.jobenv import worker_id


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


# The most GPUs an elastic job's sizes are counted up to: beyond any cluster, and few enough to list.
# (Intake checks only that min <= gpus <= max and that gpus fit the cluster: a max of 10**12 was
# accepted, and listing its sizes took the scheduler's and the elastic service's memory.)
MAX_ELASTIC_WORLD = 65_536


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
        """The world sizes the job may run at: all of min..max (at least one GPU, at most
        ``MAX_ELASTIC_WORLD``), or those that keep the global batch."""
        every = list(range(max(self.min, 1), min(self.max, MAX_ELASTIC_WORLD) + 1))
        if self.global_batch is None or self.micro_batch is None or self.lr_scaling is not None:
            return every
        return [w for w in every if self.global_batch % (w * self.micro_batch) == 0]


class Scaling(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """How a data-parallel job's throughput scales with its workers, as its per-layer profile says
    (``gpuherd profile --ddp``): compute time per sample and the gradient bytes each step
    all-reduces (``gpuherd.scaling``). An elastic job may declare it; the elastic service predicts
    its throughput from it until it has measured, and a simulated job runs by it."""

    compute_per_sample_s: float
    grad_bytes: int


class Dependencies(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """Jobs a job waits for, as Slurm's ``--dependency`` says it (``gpuherd submit --depends``).

    Each list names job ids (an array's id stands for all its elements), or, within a workflow, the
    names of its steps; intake resolves every name to job ids, so a stored spec holds ids only.

    - ``after``: each has started (or ended);
    - ``afterany``: each has ended, however;
    - ``afterok``: each has completed (can no longer be met once one failed, timed out or was cancelled);
    - ``afternotok``: each has failed, timed out or been cancelled (can no longer be met once one completed).
    """

    afterok: tuple[str, ...] = ()
    afterany: tuple[str, ...] = ()
    afternotok: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    def kinds(self) -> tuple[tuple[DependencyKind, tuple[str, ...]], ...]:
        return (
            ("afterok", self.afterok),
            ("afterany", self.afterany),
            ("afternotok", self.afternotok),
            ("after", self.after),
        )

    def ids(self) -> list[str]:
        """Every job named, once, in the order first named."""
        return list(dict.fromkeys(job for _, jobs in self.kinds() for job in jobs))


DependencyKind = Literal["afterok", "afterany", "afternotok", "after"]
DEPENDENCY_KINDS: tuple[DependencyKind, ...] = ("afterok", "afterany", "afternotok", "after")


class ArraySpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """A job array (Slurm's ``--array``): one submission, ``count`` jobs (or one per value of
    ``values``) named ``<name>[i]``, at most ``max_running`` of them placed or running at once."""

    count: int | None = None
    values: tuple[str | int | float, ...] | None = None
    max_running: int | None = None


class ArrayMember(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """Element ``index`` of array ``array`` (of ``size`` elements): set by intake, never by a submitter."""

    array: str  # the array's id; its elements are ``<array>_<index>``
    index: int
    size: int
    value: str | None = None  # its value, when the array was given ``values``
    max_running: int | None = None


class WorkflowMember(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """Step ``step`` of workflow ``workflow`` (its id; ``name`` as submitted): set by intake."""

    workflow: str
    name: str
    step: str


class JobSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """What a submitter asks for. See ``services/scheduler/intake.py`` for validation rules.

    ``array_of`` and ``workflow_of`` are intake's: a job made from an array or a workflow carries
    them; a submission that sets them is refused."""

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
    scaling: Scaling | None = None  # how its throughput scales (elastic jobs: a prior for the elastic service)
    depends_on: Dependencies | None = None  # jobs it waits for (job ids once intake resolved the names)
    kill_on_invalid_dep: bool = True  # cancelled when a dependency can no longer be met (else it waits)
    time_limit_s: float | None = None  # its run time, per attempt; past it the attempt is stopped (``timeout``)
    array: ArraySpec | None = None  # a submission of an array (intake makes its elements)
    array_of: ArrayMember | None = None
    workflow_of: WorkflowMember | None = None


class Allocation(msgspec.Struct, frozen=True, gc=False):
    node: str
    gpus: tuple[int, ...]


class Rendezvous(msgspec.Struct, frozen=True, gc=False):
    """Where a job's processes meet (torch.distributed MASTER_ADDR/MASTER_PORT), chosen by the scheduler."""

    addr: str
    port: int


Locality = Literal["island", "node", "rack", "cluster"]


PartOutcome = Literal["completed", "failed", "stopped", "lost"]


Outcome = Literal["completed", "failed", "cancelled", "timeout"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "failed", "cancelled", "timeout")

# ---------------------------------------------------------------------------
# nodes


RescaleKind = Literal["grow", "shrink", "recover", "rollback"]


class MemoryShare(msgspec.Struct, frozen=True, gc=False):
    """Part of a lease: ``mb`` MiB on lender GPU ``gpu`` (same node as the borrower), or of pinned
    host memory (``tier`` "host", ``gpu`` None)."""

    tier: MemoryTier
    mb: int
    gpu: int | None = None


MAX_OUTPUT_TAIL = 2048  # bytes of output kept in an event; the rest is in the agent's log files


def workers_of(allocations: tuple[Allocation, ...]) -> tuple[str, ...]:
    """An elastic job's workers in rank order: one per GPU, named ``<node>/<gpu>``."""
    return tuple(worker_id(a.node, g) for a in allocations for g in a.gpus)
