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
from typing import NamedTuple

import msgspec

from gpuherd.events import Allocation, JobSpec, Locality
from gpuherd.fold import NodeState
from services.scheduler.state import SchedulerState


class NodeView:
    """What placement needs to know of one node that accepts work (immutable: a pass replaces the
    view of a node it places on). Made in every pass for each node that changed, so a plain class:
    a frozen dataclass costs several times as much to build."""

    __slots__ = ("free", "island_sizes", "islands", "name", "rack", "runs_processes")

    def __init__(
        self, name: str, rack: str, islands: tuple[tuple[int, ...], ...], runs_processes: bool = False
    ) -> None:
        self.name = name
        self.rack = rack
        self.islands = islands  # free GPU indices, grouped by NVLink island
        self.runs_processes = runs_processes
        sizes = [len(i) for i in islands]
        self.free = sum(sizes)  # how many: read in every pass, so kept
        self.island_sizes = frozenset(sizes)

    def _key(self) -> tuple:
        return (self.name, self.rack, self.islands, self.runs_processes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeView) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"NodeView(name={self.name!r}, rack={self.rack!r}, islands={self.islands!r}, "
            f"runs_processes={self.runs_processes!r})"
        )


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
    gpus = node.gpus
    islands = []
    for island in node.islands:
        free = tuple(i for i in island if gpus[i].job is None and gpus[i].healthy)
        if free:
            islands.append(free)
    return NodeView(node.node, node.rack, tuple(islands), node.executor != "sim")


def views(state: SchedulerState) -> dict[str, NodeView]:
    """Every node that accepts new work, with its free, healthy GPUs."""
    return {name: view_of(node) for name, node in sorted(state.nodes.items()) if node.accepts_work()}


class PassViews(NamedTuple):
    """What a pass starts from: the views (shared with the cache: a pass puts back those it
    replaced when it ends), free GPUs per executor kind (runs processes or not), and the island
    index over the views."""

    free: dict[str, NodeView]
    free_total: dict[bool, int]
    index: IslandIndex


def free_totals(nodes: dict[str, NodeView]) -> dict[bool, int]:
    totals = {False: 0, True: 0}
    for view in nodes.values():
        totals[view.runs_processes] += view.free
    return totals


def pass_views(state: SchedulerState) -> PassViews:
    """Everything built afresh from the state (a one-off pass: ``gpuherd why``, tests)."""
    free = views(state)
    return PassViews(free, free_totals(free), IslandIndex(free))


class ViewCache:
    """``pass_views(state)`` kept between a decider's passes. The fold lists nodes by their last
    change (``SchedulerState.changed_since``), so a pass recomputes only the views of nodes changed
    since the pass before, and keeps the free totals and island index up to date with them,
    instead of rebuilding all three over every node of a large cluster. Another nodes dict
    (another state, a decoded snapshot) or a clock that went back rebuilds everything."""

    def __init__(self) -> None:
        self._of: dict[str, NodeState] | None = None
        self._clock = 0
        self._views: dict[str, NodeView] = {}
        self._totals = {False: 0, True: 0}
        self._index = IslandIndex({})
        self.asleep: set[str] = set()  # up, but powered down, powering down or booting

    def refresh(self, state: SchedulerState) -> PassViews:
        """The views of ``state`` (a pass replaces those of the nodes it places on and puts them
        back when it ends: most passes place nothing) and its own copy of the free totals."""
        nodes = state.nodes
        if nodes is not self._of or state.node_clock < self._clock:
            self._of = nodes
            self._views, self._totals, self.asleep = {}, {False: 0, True: 0}, set()
            self._index = IslandIndex({})  # (claims about another state's nodes could look true)
            changed: Iterable[str] = nodes
        else:
            changed = state.changed_since(self._clock)
        fresh: list[NodeView] = []
        for name in changed:
            node = nodes[name]
            old = self._views.pop(name, None)
            if old is not None:
                self._totals[old.runs_processes] -= old.free
            if node.accepts_work():
                view = self._views[name] = view_of(node)
                self._totals[view.runs_processes] += view.free
                fresh.append(view)
            if node.status == "up" and not node.accepts_work():
                self.asleep.add(name)
            else:
                self.asleep.discard(name)
        self._clock = state.node_clock
        if self._index.entries > 4 * len(self._views) + 256:
            self._index = IslandIndex(self._views)  # drop the stale entries
        else:
            self._index.nodes = self._views
            for view in fresh:
                self._index.add(view)
        return PassViews(self._views, dict(self._totals), self._index)


def can_run(spec: JobSpec, runs_processes: bool) -> bool:
    """A job with a command needs an executor that runs processes; the sim executor runs jobs
    that say how long they take."""
    if runs_processes:
        return spec.command is not None
    return spec.duration_s is not None


def take(view: NodeView, count: int) -> tuple[int, ...]:
    """``count`` free GPUs of one node, from as few NVLink islands as possible: the best-fitting
    island that holds them all, else the largest islands first."""
    best: tuple[int, ...] | None = None
    for island in view.islands:
        if len(island) >= count and (best is None or (len(island), island) < (len(best), best)):
            best = island
    if best is not None:
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
    # (Stops at the first nodes that suffice: a pass asks this of every job it considers.)
    if spec.nodes is not None:
        per_node, wanted = spec.gpus // spec.nodes, spec.nodes
        for n in sizes:
            if n >= per_node:
                wanted -= 1
                if not wanted:
                    return True
        return wanted <= 0
    wanted = spec.gpus
    for n in sizes:
        wanted -= n
        if wanted <= 0:
            return True
    return wanted <= 0


class IslandIndex:
    """Nodes by the sizes of their free NVLink islands: the best one-node home for a job in
    O(log n) rather than a scan of every node.

    Each heap entry claims "node N had F free GPUs and a free island of size S". Claims go stale
    as GPUs are taken or freed; they are checked against the current views when they surface and
    dropped if false, so a node only needs a fresh claim pushed when its view changes. A pass
    (``begin_pass``) replaces the views of the nodes it places on, keeping the ones they replaced;
    a claim false for the pass but true for a view the pass replaced is put back at ``end_pass``
    (once the pass has put its views back), so the index stays whole for the next pass whatever
    this one placed."""

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
        self.entries = sum(len(h) for h in heaps.values())
        self._replaced: dict[str, NodeView] | None = None  # during a pass: views it replaced
        self._put_back: list[tuple[tuple[bool, int], tuple[int, str]]] = []

    def add(self, view: NodeView) -> None:
        for size in view.island_sizes:
            heapq.heappush(self._heaps.setdefault((view.runs_processes, size), []), (view.free, view.name))
            self.entries += 1

    def begin_pass(self, replaced: dict[str, NodeView]) -> None:
        """A pass starts: it records in ``replaced`` the view each node had before it placed there."""
        self._replaced = replaced

    def end_pass(self) -> None:
        if self._replaced is None:
            return
        for key, entry in self._put_back:
            heapq.heappush(self._heaps[key], entry)
        self._put_back.clear()
        self._replaced = None

    def best_island(self, spec: JobSpec, avoid: frozenset[str] = frozenset()) -> NodeView | None:
        """The node with the best-fitting free island for the whole job: the smallest island that
        holds it, then the fewest free GPUs on the node, then the name (the score's order). Nodes
        in ``avoid`` are passed over (their true claims are set aside and pushed back after)."""
        flags = [flag for flag in (False, True) if can_run(spec, flag)]
        passed_over: list[tuple[tuple[bool, int], tuple[int, str]]] = []
        try:
            for size in sorted({size for flag, size in self._heaps if flag in flags and size >= spec.gpus}):
                best: tuple[int, str] | None = None
                for flag in flags:
                    heap = self._heaps.get((flag, size))
                    while heap:
                        entry = heap[0]
                        if _claims(self.nodes, entry, flag, size):
                            if entry[1] not in avoid:
                                break
                            passed_over.append(((flag, size), heapq.heappop(heap)))
                            continue
                        heapq.heappop(heap)
                        if self._replaced and _claims(self._replaced, entry, flag, size):
                            self._put_back.append(((flag, size), entry))
                        else:
                            self.entries -= 1
                    if heap and (best is None or heap[0] < best):
                        best = heap[0]
                if best is not None:
                    return self.nodes[best[1]]
            return None
        finally:
            for key, entry in passed_over:
                heapq.heappush(self._heaps[key], entry)


def _claims(nodes: dict[str, NodeView], entry: tuple[int, str], runs_processes: bool, size: int) -> bool:
    view = nodes.get(entry[1])
    return (
        view is not None
        and view.free == entry[0]
        and view.runs_processes == runs_processes
        and size in view.island_sizes
    )


def place(
    spec: JobSpec,
    nodes: dict[str, NodeView],
    index: IslandIndex | None = None,
    avoid: frozenset[str] = frozenset(),
) -> Placement | None:
    """The best-scoring placement of the whole gang, or None if it does not fit now. ``index``
    (over ``nodes``) finds a one-node placement without scanning every node. Nodes in ``avoid``
    are not used (a backfill job kept off the nodes a waiting gang needs)."""
    if index is not None and spec.nodes in (None, 1):
        home = index.best_island(spec, avoid)
        if home is not None:
            allocs = _gang([(home, spec.gpus)])
            s = score(allocs, nodes)
            return Placement(allocs, s.locality, _describe(s, spec))
    eligible = [v for v in nodes.values() if v.free and can_run(spec, v.runs_processes)]
    if avoid:
        eligible = [v for v in eligible if v.name not in avoid]
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
