"""Where a job's gang fits: all of its GPUs at once, or nowhere.

Consolidating placement: a job goes on as few nodes as possible, and among
nodes that fit, on the one with the fewest free GPUs (best fit), so large
holes stay open for large jobs. Ties break by node name: placement is a
deterministic function of the state.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from gpuherd.events import Allocation, JobSpec
from gpuherd.state import ClusterState

FreeMap = Mapping[str, list[int]]


class Placement(msgspec.Struct, frozen=True):
    allocations: tuple[Allocation, ...]
    reason: str


def free_by_node(state: ClusterState) -> dict[str, list[int]]:
    """Free, healthy GPU indices of every node that accepts new work."""
    return {name: node.free_gpus() for name, node in sorted(state.nodes.items()) if node.status == "up"}


def place(spec: JobSpec, free: FreeMap) -> Placement | None:
    if spec.nodes is not None:
        return _place_even(spec.gpus, spec.nodes, free)
    return _place_fewest_nodes(spec.gpus, free)


def _place_even(gpus: int, nodes: int, free: FreeMap) -> Placement | None:
    per_node = gpus // nodes
    fitting = sorted((len(idx), name) for name, idx in free.items() if len(idx) >= per_node)
    if len(fitting) < nodes:
        return None
    chosen = sorted(name for _, name in fitting[:nodes])
    allocs = tuple(Allocation(name, tuple(free[name][:per_node])) for name in chosen)
    return Placement(allocs, f"{nodes} node(s) x {per_node} GPU(s), best fit")


def _place_fewest_nodes(gpus: int, free: FreeMap) -> Placement | None:
    best_single = min(((len(idx), name) for name, idx in free.items() if len(idx) >= gpus), default=None)
    if best_single is not None:
        name = best_single[1]
        return Placement((Allocation(name, tuple(free[name][:gpus])),), "one node, best fit")
    # Span nodes: take the emptiest nodes first, so the gang touches as few as possible.
    allocs = []
    remaining = gpus
    for count, name in sorted(((len(idx), name) for name, idx in free.items() if idx), key=lambda t: (-t[0], t[1])):
        take = min(count, remaining)
        allocs.append(Allocation(name, tuple(free[name][:take])))
        remaining -= take
        if remaining == 0:
            return Placement(tuple(sorted(allocs, key=lambda a: a.node)), f"{len(allocs)} nodes, fewest possible")
    return None
