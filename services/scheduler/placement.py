"""Where a job's gang fits: all of its GPUs at once, or nowhere; and how close together.

DL jobs are bound by GPU-to-GPU bandwidth, so placement is topology-aware.
Every candidate placement gets a :class:`Score`, compared lexicographically
(lower is better):

1. fewest nodes (a gang inside one node talks over NVLink/PCIe, not the network),
2. fewest racks (the rack's switch is faster than the spine),
3. fewest NVLink islands touched (GPUs of one island are all NVLink peers),
4. least free space left in the islands it touches, then on its nodes (best
   fit: large holes stay open for large jobs),
5. node names (a deterministic tie-break: placement is a pure function of state).

The placement's *locality* is the tightest level the whole gang fits in:
``island`` (one NVLink island), ``node``, ``rack`` or ``cluster``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from gpuherd.events import Allocation, JobSpec, Locality
from gpuherd.state import ClusterState, NodeState


@dataclass(frozen=True, slots=True)
class NodeView:
    """What placement needs to know of one node that accepts work."""

    name: str
    rack: str
    islands: tuple[tuple[int, ...], ...]  # free GPU indices, grouped by NVLink island
    runs_processes: bool = False
    free: int = field(init=False, compare=False)  # how many: read in every pass, so kept
    island_sizes: frozenset[int] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "free", sum(len(i) for i in self.islands))
        object.__setattr__(self, "island_sizes", frozenset(len(i) for i in self.islands))


class Score(NamedTuple):
    nodes: int
    racks: int
    islands: int
    island_leftover: int
    node_leftover: int
    names: tuple[str, ...]

    @property
    def locality(self) -> Locality:
        if self.nodes == 1:
            return "island" if self.islands == 1 else "node"
        return "rack" if self.racks == 1 else "cluster"


class Placement(msgspec.Struct, frozen=True):
    allocations: tuple[Allocation, ...]
    locality: Locality
    reason: str


def view_of(node: NodeState) -> NodeView:
    free = set(node.free_gpus())
    islands = tuple(tuple(i for i in island if i in free) for island in node.islands)
    return NodeView(
        name=node.node,
        rack=node.rack,
        islands=tuple(i for i in islands if i),
        runs_processes=node.runs_processes(),
    )


def views(state: ClusterState) -> dict[str, NodeView]:
    """Every node that accepts new work, with its free, healthy GPUs."""
    return {name: view_of(node) for name, node in sorted(state.nodes.items()) if node.accepts_work()}


class ViewCache:
    """``views(state)`` kept between passes: a node's view is recomputed only when the fold
    changed the node (its ``version``) or it is another node object (another state, a decoded
    snapshot). Holding the node object keeps the identity check sound. It saves the decider
    rebuilding every node's view on every event of a large cluster."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[NodeState, int, NodeView | None]] = {}
        self._names: list[str] = []
        self._of: dict[str, NodeState] | None = None  # the nodes dict the names were taken from

    def views(self, state: ClusterState) -> dict[str, NodeView]:
        nodes = state.nodes
        if nodes is not self._of or len(self._names) != len(nodes):  # nodes are added, never removed
            self._of = nodes
            self._names = sorted(nodes)
            self._entries = {name: entry for name, entry in self._entries.items() if name in nodes}
        out: dict[str, NodeView] = {}
        entries = self._entries
        for name in self._names:
            node = nodes[name]
            entry = entries.get(name)
            if entry is None or entry[0] is not node or entry[1] != node.version:
                entry = (node, node.version, view_of(node) if node.accepts_work() else None)
                entries[name] = entry
            if entry[2] is not None:
                out[name] = entry[2]
        return out


def can_run(spec: JobSpec, runs_processes: bool) -> bool:
    """A job with a command needs an executor that runs processes; the sim executor runs jobs
    that say how long they take."""
    if runs_processes:
        return spec.command is not None
    return spec.duration_s is not None


def take(view: NodeView, count: int) -> tuple[int, ...]:
    """``count`` free GPUs of one node, from as few NVLink islands as possible: the best-fitting
    island that holds them all, else the largest islands first."""
    fitting = [island for island in view.islands if len(island) >= count]
    if fitting:
        best = min(fitting, key=lambda island: (len(island), island))
        return best[:count]
    chosen: list[int] = []
    for island in sorted(view.islands, key=lambda island: (-len(island), island)):
        chosen += island[: count - len(chosen)]
        if len(chosen) == count:
            break
    return tuple(sorted(chosen))


def score(allocations: Iterable[Allocation], nodes: dict[str, NodeView]) -> Score:
    allocs = list(allocations)
    islands = island_leftover = node_leftover = 0
    for alloc in allocs:
        view = nodes[alloc.node]
        used = set(alloc.gpus)
        for island in view.islands:
            taken = used.intersection(island)
            if taken:
                islands += 1
                island_leftover += len(island) - len(taken)
        node_leftover += view.free - len(used)
    return Score(
        nodes=len(allocs),
        racks=len({nodes[a.node].rack for a in allocs}),
        islands=islands,
        island_leftover=island_leftover,
        node_leftover=node_leftover,
        names=tuple(sorted(a.node for a in allocs)),
    )


def fits_by_count(spec: JobSpec, sizes: Iterable[int]) -> bool:
    """Whether the gang fits nodes with these numbers of usable GPUs. Placement never fails for
    topology (islands only rank candidates), so this is exactly when ``place`` finds one."""
    if spec.nodes is not None:
        per_node = spec.gpus // spec.nodes
        return sum(1 for n in sizes if n >= per_node) >= spec.nodes
    return sum(sizes) >= spec.gpus


class IslandIndex:
    """The nodes of one pass by the sizes of their free NVLink islands: the best one-node home for a
    job in O(log n) rather than a scan of every node. Entries go stale as placements shrink a
    node's free GPUs; they are checked against the current view when they surface."""

    def __init__(self, nodes: dict[str, NodeView]) -> None:
        self.nodes = nodes
        heaps: dict[tuple[bool, int], list[tuple[int, str]]] = {}
        for view in nodes.values():
            entry = (view.free, view.name)
            for size in view.island_sizes:
                heaps.setdefault((view.runs_processes, size), []).append(entry)
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps

    def add(self, view: NodeView) -> None:
        for size in view.island_sizes:
            heapq.heappush(self._heaps.setdefault((view.runs_processes, size), []), (view.free, view.name))

    def best_island(self, spec: JobSpec) -> NodeView | None:
        """The node with the best-fitting free island for the whole job: the smallest island that
        holds it, then the fewest free GPUs on the node, then the name (the score's order)."""
        flags = [flag for flag in (False, True) if can_run(spec, flag)]
        for size in sorted({size for flag, size in self._heaps if flag in flags and size >= spec.gpus}):
            best: tuple[int, str] | None = None
            for flag in flags:
                heap = self._heaps.get((flag, size))
                while heap:
                    free, name = heap[0]
                    view = self.nodes.get(name)
                    if view is not None and view.free == free and any(len(i) == size for i in view.islands):
                        break
                    heapq.heappop(heap)
                if heap and (best is None or heap[0] < best):
                    best = heap[0]
            if best is not None:
                return self.nodes[best[1]]
        return None


def place(spec: JobSpec, nodes: dict[str, NodeView], index: IslandIndex | None = None) -> Placement | None:
    """The best-scoring placement of the whole gang, or None if it does not fit now. ``index``
    (over ``nodes``) finds a one-node placement without scanning every node."""
    if index is not None and spec.nodes in (None, 1):
        home = index.best_island(spec)
        if home is not None:
            allocs = _gang([(home, spec.gpus)])
            s = score(allocs, nodes)
            return Placement(allocs, s.locality, _describe(s, spec))
    eligible = [v for v in nodes.values() if v.free and can_run(spec, v.runs_processes)]
    if spec.nodes in (None, 1):
        single = _best_single(spec.gpus, eligible)
        if single is not None:
            s = score(single, nodes)
            return Placement(single, s.locality, _describe(s, spec))
    if spec.nodes is not None:
        candidates = _even_split(spec.gpus, spec.nodes, eligible)
    else:
        candidates = _fewest_nodes(spec.gpus, eligible)
    best: tuple[Score, tuple[Allocation, ...]] | None = None
    for allocs in candidates:
        s = score(allocs, nodes)
        if best is None or s < best[0]:
            best = (s, allocs)
    if best is None:
        return None
    s, allocs = best
    return Placement(allocs, s.locality, _describe(s, spec))


def _describe(s: Score, spec: JobSpec) -> str:
    where = {
        "island": "one NVLink island",
        "node": f"one node, {s.islands} NVLink islands",
        "rack": f"{s.nodes} nodes in one rack",
        "cluster": f"{s.nodes} nodes across {s.racks} racks",
    }[s.locality]
    return f"{spec.gpus} GPU(s) on {where}"


def _gang(parts: Iterable[tuple[NodeView, int]]) -> tuple[Allocation, ...]:
    return tuple(sorted((Allocation(v.name, take(v, n)) for v, n in parts), key=lambda a: a.node))


def _best_single(gpus: int, eligible: list[NodeView]) -> tuple[Allocation, ...] | None:
    """The best one-node placement, by the score's order, without building every candidate:
    fewest islands touched, least island leftover, least node leftover, then the name."""
    best: tuple[int, int, int, str] | None = None
    winner = None
    for v in eligible:
        free = v.free
        if free < gpus:
            continue
        fitting = [len(i) for i in v.islands if len(i) >= gpus]
        if fitting:
            key = (1, min(fitting) - gpus, free - gpus, v.name)
        else:
            touched, total = 0, 0
            for size in sorted((len(i) for i in v.islands), reverse=True):
                touched += 1
                total += size
                if total >= gpus:
                    break
            key = (touched, total - gpus, free - gpus, v.name)
        if best is None or key < best:
            best, winner = key, v
    return None if winner is None else _gang([(winner, gpus)])


def _fewest_nodes(gpus: int, eligible: list[NodeView]) -> list[tuple[Allocation, ...]]:
    single = [_gang([(v, gpus)]) for v in eligible if v.free >= gpus]
    if single:
        return single
    # The fewest nodes that can hold the gang at all; then try to find that many within one rack.
    by_free = sorted(eligible, key=lambda v: (-v.free, v.name))
    total, needed = 0, 0
    for v in by_free:
        total += v.free
        needed += 1
        if total >= gpus:
            break
    else:
        return []
    groups: dict[str, list[NodeView]] = {}
    for v in by_free:
        groups.setdefault(v.rack, []).append(v)
    candidates = [c for group in [*groups.values(), by_free] if (c := _fill(gpus, needed, group)) is not None]
    return candidates


def _fill(gpus: int, count: int, group: list[NodeView]) -> tuple[Allocation, ...] | None:
    """``count`` nodes of ``group`` (sorted by free GPUs, largest first) holding ``gpus``: the
    largest ``count - 1`` whole, and the best-fitting node for the rest."""
    if len(group) < count:
        return None
    whole = group[: count - 1]
    rest = gpus - sum(v.free for v in whole)
    if rest <= 0:
        return None  # fewer nodes would do; not a candidate at this count
    last = [v for v in group[count - 1 :] if v.free >= rest]
    if not last:
        return None
    fit = min(last, key=lambda v: (v.free, v.name))
    return _gang([*((v, v.free) for v in whole), (fit, rest)])


def _even_split(gpus: int, count: int, eligible: list[NodeView]) -> list[tuple[Allocation, ...]]:
    per_node = gpus // count
    fitting = sorted((v for v in eligible if v.free >= per_node), key=lambda v: (v.free, v.name))
    groups: dict[str, list[NodeView]] = {}
    for v in fitting:
        groups.setdefault(v.rack, []).append(v)
    return [_gang((v, per_node) for v in group[:count]) for group in [*groups.values(), fitting] if len(group) >= count]
