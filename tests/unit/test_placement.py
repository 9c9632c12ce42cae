from gpuherd.events import JobSpec
from services.scheduler.placement import place


def spec(gpus: int, nodes: int | None = None) -> JobSpec:
    return JobSpec(name="j", user="u", gpus=gpus, nodes=nodes, duration_s=1.0)


def test_single_node_best_fit_leaves_big_holes_open() -> None:
    free = {"a": [0, 1, 2, 3, 4, 5, 6, 7], "b": [2, 3], "c": [0, 1, 2]}
    p = place(spec(2), free)
    assert p is not None and [(a.node, a.gpus) for a in p.allocations] == [("b", (2, 3))]
    assert "one node" in p.reason


def test_spans_fewest_nodes_when_no_node_fits() -> None:
    free = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3, 4, 5], "c": [0], "d": [0, 1]}
    p = place(spec(9), free)
    assert p is not None
    assert sorted((a.node, len(a.gpus)) for a in p.allocations) == [("a", 3), ("b", 6)]
    assert sum(len(a.gpus) for a in p.allocations) == 9


def test_even_split_over_requested_nodes() -> None:
    free = {"a": [0, 1, 2, 3, 4, 5, 6, 7], "b": [0, 1, 2, 3], "c": [4, 5, 6, 7], "d": [0]}
    p = place(spec(8, nodes=2), free)
    assert p is not None
    assert [(a.node, a.gpus) for a in p.allocations] == [("b", (0, 1, 2, 3)), ("c", (4, 5, 6, 7))]


def test_gang_is_all_or_nothing() -> None:
    assert place(spec(5), {"a": [0, 1], "b": [0, 1]}) is None
    assert place(spec(4, nodes=2), {"a": [0, 1, 2], "b": [0]}) is None


def test_ties_break_by_node_name() -> None:
    free = {"z": [0, 1], "a": [0, 1], "m": [0, 1]}
    p = place(spec(2), free)
    assert p is not None and p.allocations[0].node == "a"
