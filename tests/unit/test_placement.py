"""Topology-aware placement on hand-built topologies."""

import random

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply, islands_of
from services.scheduler.placement import NodeView, Score, place, score, take, views
from tests.helpers import node


def spec(gpus: int, nodes: int | None = None, *, command: bool = False) -> ev.JobSpec:
    return ev.JobSpec(
        name="t",
        user="u",
        gpus=gpus,
        nodes=nodes,
        duration_s=None if command else 1.0,
        command=("x",) if command else None,
    )


def view(name: str, *islands: tuple[int, ...], rack: str = "r1", processes: bool = False) -> NodeView:
    return NodeView(name=name, rack=rack, islands=tuple(islands), runs_processes=processes)


def cluster(*views_: NodeView) -> dict[str, NodeView]:
    return {v.name: v for v in views_}


def test_islands_are_connected_components_of_the_nvlink_graph() -> None:
    gpus = [
        ev.GpuInfo(index=i, uuid=str(i), model="m", memory_mb=1, nvlink_peers=p)
        for i, p in enumerate([(1,), (0,), (3,), (2,), ()])
    ]
    assert islands_of(gpus) == [[0, 1], [2, 3], [4]]


def test_a_job_that_fits_one_island_gets_one_island() -> None:
    # 2 islands of 4: GPUs 0,1 of the first are busy. A 3-GPU job must not straddle islands.
    nodes = cluster(view("n1", (2, 3), (4, 5, 6, 7)))
    p = place(spec(3), nodes)
    assert p is not None
    assert p.allocations == (ev.Allocation("n1", (4, 5, 6)),)
    assert p.locality == "island"


def test_best_fitting_island_keeps_whole_islands_free() -> None:
    # A 2-GPU job goes into the island that has exactly 2 free, not into the whole free one.
    nodes = cluster(view("n1", (0, 1, 2, 3), (6, 7)))
    p = place(spec(2), nodes)
    assert p is not None and p.allocations[0].gpus == (6, 7) and p.locality == "island"


def test_island_beats_best_fit_across_nodes() -> None:
    # n1 fits best by node (5 free) but only across islands; n2 has a whole island of 4.
    nodes = cluster(view("n1", (0, 1), (4, 5, 6)), view("n2", (0, 1, 2, 3), (4, 5, 6, 7)))
    p = place(spec(4), nodes)
    assert p is not None and p.allocations == (ev.Allocation("n2", (0, 1, 2, 3)),) and p.locality == "island"


def test_crossing_islands_on_one_node_beats_two_nodes() -> None:
    nodes = cluster(view("n1", (0, 1), (4, 5)), view("n2", (0, 1, 2)), view("n3", (0, 1, 2)))
    p = place(spec(4), nodes)
    assert p is not None and p.allocations == (ev.Allocation("n1", (0, 1, 4, 5)),) and p.locality == "node"


def test_multi_node_prefers_one_rack() -> None:
    # 12 GPUs need 2 nodes of 8. a1 (rack A) + b1 (rack B) would do, but a1 + a2 share a rack.
    nodes = cluster(
        view("a1", tuple(range(8)), rack="A"),
        view("a2", tuple(range(6)), rack="A"),
        view("b1", tuple(range(8)), rack="B"),
    )
    p = place(spec(12), nodes)
    assert p is not None
    assert [a.node for a in p.allocations] == ["a1", "a2"]
    assert p.locality == "rack"
    assert sum(len(a.gpus) for a in p.allocations) == 12


def test_multi_node_takes_fewest_nodes_even_across_racks() -> None:
    # Rack A could hold 8 GPUs only on 3 nodes; two nodes of different racks are fewer.
    nodes = cluster(
        view("a1", (0, 1, 2), rack="A"),
        view("a2", (0, 1, 2), rack="A"),
        view("a3", (0, 1, 2), rack="A"),
        view("b1", (0, 1, 2, 3, 4), rack="B"),
    )
    p = place(spec(8), nodes)
    assert p is not None and len(p.allocations) == 2 and p.locality == "cluster"


def test_even_split_within_one_rack_and_one_island_per_node() -> None:
    nodes = cluster(
        view("a1", (0, 1, 2, 3), (4, 5, 6, 7), rack="A"),
        view("b1", (0, 1, 2, 3), (4, 5, 6, 7), rack="B"),
        view("b2", (0, 1), (4, 5, 6, 7), rack="B"),
    )
    p = place(spec(8, nodes=2), nodes)
    assert p is not None
    assert [a.node for a in p.allocations] == ["b1", "b2"]
    assert p.allocations[1].gpus == (4, 5, 6, 7)  # the whole island, not 0,1 + two more
    assert p.locality == "rack"


def test_gang_is_all_or_nothing() -> None:
    nodes = cluster(view("n1", (0, 1)), view("n2", (0,)))
    assert place(spec(4), nodes) is None
    assert place(spec(4, nodes=2), nodes) is None


def test_commands_need_process_nodes_and_sim_jobs_need_sim_nodes() -> None:
    nodes = cluster(view("sim1", (0, 1, 2, 3)), view("cpu1", (0, 1), processes=True))
    real = place(spec(2, command=True), nodes)
    assert real is not None and real.allocations[0].node == "cpu1"
    assert place(spec(4, command=True), nodes) is None
    simulated = place(spec(2), nodes)
    assert simulated is not None and simulated.allocations[0].node == "sim1"


def test_ties_break_by_node_name() -> None:
    nodes = cluster(view("z", (0, 1)), view("a", (0, 1)), view("m", (0, 1)))
    p = place(spec(2), nodes)
    assert p is not None and p.allocations[0].node == "a"


def test_score_orders_levels_lexicographically() -> None:
    nodes = cluster(view("n1", (0, 1, 2, 3), (4, 5, 6, 7), rack="A"), view("n2", (0, 1, 2, 3), rack="B"))
    one_island = score([ev.Allocation("n1", (0, 1))], nodes)
    two_islands = score([ev.Allocation("n1", (0, 4))], nodes)
    two_racks = score([ev.Allocation("n1", (0,)), ev.Allocation("n2", (0,))], nodes)
    assert one_island < two_islands < two_racks
    assert (one_island.locality, two_islands.locality, two_racks.locality) == ("island", "node", "cluster")
    assert isinstance(one_island, Score) and one_island.island_leftover == 2


def test_take_uses_the_fewest_islands() -> None:
    v = view("n", (0,), (2, 3), (4, 5, 6))
    assert take(v, 2) == (2, 3)
    assert take(v, 5) == (2, 3, 4, 5, 6)


def test_views_come_from_state_with_busy_and_unhealthy_gpus_left_out() -> None:
    state = ClusterState()
    apply(state, 1, node("n1", 8, island=4))
    state.nodes["n1"].gpus[0].job = "x"
    state.nodes["n1"].gpus[5].healthy = False
    assert views(state)["n1"].islands == ((1, 2, 3), (4, 6, 7))


def _random_views(rng: random.Random, nodes: int) -> dict[str, NodeView]:
    """Nodes of two 4-GPU islands, each GPU free with odds 0.6, in 3 racks (fully busy nodes left out)."""
    free = {}
    for n in range(nodes):
        islands = tuple(t for t in (tuple(i for i in range(b, b + 4) if rng.random() < 0.6) for b in (0, 4)) if t)
        if islands:
            free[f"n{n:02d}"] = view(f"n{n:02d}", *islands, rack=f"r{n % 3}")
    return free


def test_the_island_index_finds_what_a_full_scan_finds() -> None:
    from services.scheduler.placement import IslandIndex

    rng = random.Random(5)
    for _ in range(30):
        free = _random_views(rng, 40)
        index = IslandIndex(free)
        for _ in range(25):  # place one-node jobs one after another, as a pass does
            job = spec(rng.choice([1, 1, 2, 3, 4]))
            fast, slow = place(job, free, index), place(job, free)
            assert fast == slow
            if fast is None:
                continue
            alloc = fast.allocations[0]
            old = free[alloc.node]
            left = tuple(t for t in (tuple(i for i in isl if i not in alloc.gpus) for isl in old.islands) if t)
            free[alloc.node] = NodeView(old.name, old.rack, left, old.runs_processes)
            index.add(free[alloc.node])


def test_a_placement_that_avoids_nodes_is_the_best_on_the_others_and_the_index_forgets_none() -> None:
    from services.scheduler.placement import IslandIndex

    rng = random.Random(7)
    for _ in range(30):
        free = _random_views(rng, 30)
        index = IslandIndex(free)
        for _ in range(20):
            job = spec(rng.choice([1, 2, 3, 4, 6]), rng.choice([None, None, 2]))
            best = place(job, free, index)
            avoid = frozenset(rng.sample(sorted(free), 3) + ([best.allocations[0].node] if best else []))
            others = {name: v for name, v in free.items() if name not in avoid}
            assert place(job, free, index, avoid=avoid) == place(job, others)
            assert place(job, free, index) == best == place(job, free), "the avoided nodes' claims are back"


def test_a_view_cache_moved_to_another_state_keeps_no_claim_about_the_first() -> None:
    # A decider's cache sees another state after a snapshot or a lost lease: there, n2 runs
    # processes, so a claim that n2 has one free sim GPU must not place a sim job on it.
    from services.scheduler.placement import ViewCache
    from services.scheduler.state import new_state

    cache = ViewCache()
    first = new_state()
    apply(first, 1, node("n2", 1))
    cache.refresh(first)
    second = new_state()
    for seq, registration in enumerate((node("n1", 2), node("n2", 1, executor="cpu")), 1):
        apply(second, seq, registration)
    free, _, index = cache.refresh(second)
    placed = place(spec(1), free, index)
    assert placed is not None and placed.allocations[0].node == "n1"
    index.end_pass()
