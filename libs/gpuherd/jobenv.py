"""The environment a node agent gives every process of a job: the contract between
``services/nodeagent`` (which sets it) and ``gpuherd.train`` (which reads it).

The torch.distributed names follow torchrun, so a script written for torchrun
runs under gpuherd unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"  # the node's index in the gang (torchrun's name)
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
JOB_ID = "GPUHERD_JOB_ID"
ATTEMPT = "GPUHERD_ATTEMPT"
NODE = "GPUHERD_NODE"
AGENT_ADDR = "GPUHERD_AGENT_ADDR"  # the agent's control socket (see services/nodeagent/control_socket.py)
VIRTUAL_GPUS = "GPUHERD_VIRTUAL_GPUS"  # cpu executor: the declared GPU indices this process stands for
TASK_DIR = "GPUHERD_TASK_DIR"  # the attempt's folder on the node: the agent leaves requests there

RESERVED = frozenset(
    {
        MASTER_ADDR,
        MASTER_PORT,
        RANK,
        WORLD_SIZE,
        LOCAL_RANK,
        LOCAL_WORLD_SIZE,
        GROUP_RANK,
        CUDA_VISIBLE_DEVICES,
        JOB_ID,
        ATTEMPT,
        NODE,
        AGENT_ADDR,
        VIRTUAL_GPUS,
        TASK_DIR,
    }
)

# In TASK_DIR: the agent writes a profile request (``{"request": id, "steps": n}``), the leader
# rank claims it and writes its profile (``StepProfile.to_dict()``) there before telling the agent.
PROFILE_REQUEST_FILE = "profile-request.json"


def profile_result_file(rank: int) -> str:
    return f"profile-rank{rank}.json"


# -- elastic jobs ------------------------------------------------------------------------------------
# An elastic job runs one process per GPU; each is a *worker* with a stable identity
# ("<node>/<gpu>") that survives rescales (its rank does not). The agent writes every generation
# the scheduler commits (JobResized) to ELASTIC_PLAN_FILE in the task folder; workers read it at
# step boundaries (``gpuherd.train.elastic``).
ELASTIC_WORKER = "GPUHERD_ELASTIC_WORKER"
ELASTIC_PLAN_FILE = "elastic-plan.json"

RESERVED = RESERVED | {ELASTIC_WORKER}


def worker_id(node: str, gpu: int) -> str:
    return f"{node}/{gpu}"


@dataclass(frozen=True)
class ElasticPlan:
    """One generation of an elastic job: its workers in rank order, where the generation's
    rendezvous store listens (hosted by its rank 0), whose state everyone takes (``source``: the
    oldest surviving worker), and which workers are new (the switch waits until they are ready)."""

    generation: int
    workers: tuple[str, ...]
    addr: str
    port: int
    source: str
    joiners: tuple[str, ...] = ()
    decided_at: float = 0.0  # when the scheduler committed it (JobResized.at)
    attempt: int = 0

    @property
    def world(self) -> int:
        return len(self.workers)

    def rank_of(self, worker: str) -> int:
        """The worker's rank in this generation; -1 if it is not part of it (it leaves)."""
        try:
            return self.workers.index(worker)
        except ValueError:
            return -1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ElasticPlan:
        raw = json.loads(text)
        return cls(
            generation=int(raw["generation"]),
            workers=tuple(raw["workers"]),
            addr=str(raw["addr"]),
            port=int(raw["port"]),
            source=str(raw["source"]),
            joiners=tuple(raw.get("joiners", ())),
            decided_at=float(raw.get("decided_at", 0.0)),
            attempt=int(raw.get("attempt", 0)),
        )


# -- memory leases -----------------------------------------------------------------------------------
# A job that declares ``memory`` needs runs with its node's other GPUs visible after its own (so a
# neighbor leased later is reachable without a restart); GPU_INDEX says which node GPU the process
# drives. The agent keeps MEMORY_LEASES_FILE in the task folder up to date with every lease of the
# task: per borrower GPU, its shares (tier, lender GPU, CUDA ordinal in this process, MiB) and the
# revocation deadlines. ``gpuherd.train.memory.MemoryTiers`` reads it at step boundaries, never
# uses more of a lender than its share, and answers a revocation with a "lease-released" report.
GPU_INDEX = "GPUHERD_GPU"
GPU_ORDER = "GPUHERD_GPU_ORDER"  # the node GPU index of each CUDA ordinal the process sees, in order
MEMORY_LEASES_FILE = "memory-leases.json"

RESERVED = RESERVED | {GPU_INDEX, GPU_ORDER}

# -- job arrays -------------------------------------------------------------------------------------
# Each element of an array (``array: {count: N}`` or ``{values: [...]}``) runs with its index, and its
# value when the array was given values. Intake writes them into the element's ``env``.
ARRAY_INDEX = "GPUHERD_ARRAY_INDEX"
ARRAY_VALUE = "GPUHERD_ARRAY_VALUE"
ARRAY_ID = "GPUHERD_ARRAY_ID"

RESERVED = RESERVED | {ARRAY_INDEX, ARRAY_VALUE, ARRAY_ID}
