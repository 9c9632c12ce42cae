"""The core fold every reader needs: nodes, their GPUs and who holds them, each job's life cycle
(``state``, ``core``), and the fold of memory leases that the broker and the agents share
(``leases``). A service keeps what only it needs in a state of its own, a subclass of
``ClusterState`` (``services/<name>/state.py``), folded after the core."""

from gpuherd.fold.core import HANDLERS, apply, fold, jobs_on, recovers_from_lost_workers, vc_problem
from gpuherd.fold.state import (
    ACTIVE,
    TERMINAL,
    ClusterState,
    GpuSlot,
    JobState,
    JobStatus,
    NodeState,
    NodeStatus,
    PartEnd,
    PowerState,
    VcState,
    islands_of,
    oldest_first,
)

__all__ = [
    "ACTIVE",
    "HANDLERS",
    "TERMINAL",
    "ClusterState",
    "GpuSlot",
    "JobState",
    "JobStatus",
    "NodeState",
    "NodeStatus",
    "PartEnd",
    "PowerState",
    "VcState",
    "apply",
    "fold",
    "islands_of",
    "jobs_on",
    "oldest_first",
    "recovers_from_lost_workers",
    "vc_problem",
]
