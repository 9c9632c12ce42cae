"""Review of the scheduling pass: the head's backfill reservation counts the jobs the same pass
placed before it (they end, and give their GPUs back, like any running job)."""

from __future__ import annotations

from gpuherd import events as ev
from services.scheduler.placement import ViewCache
from services.scheduler.policy import Fifo
from services.scheduler.ranks import RankIndex
from services.scheduler.schedule import plan
from services.scheduler.state import SchedulerState
from tests.helpers import node, submit
from tests.unit.test_policies import run, state_of


def _queue(rules: int, *, nodes: int | None = None) -> SchedulerState:
    """16 GPUs: R1 (4 GPUs) ends at t=1000 and R2 (4 GPUs) at t=2000; X (4 GPUs, 10 s) starts now;
    then the head H needs 12 GPUs, which X's and R1's ends give it at t=1000."""
    return state_of(
        ev.PolicyConfigured(id="policy", policy="fifo", rules=rules),
        node("n1", 16),
        submit("R1", 4, duration=1000.0),
        *run("R1", "n1", (0, 1, 2, 3)),
        submit("R2", 4, duration=2000.0),
        *run("R2", "n1", (4, 5, 6, 7)),
        submit("X", 4, duration=10.0),
        submit("H", 12, duration=100.0),
        submit("B", 4, duration=1500.0),
    )


def test_a_job_placed_ahead_of_the_head_in_the_same_pass_counts_for_its_reservation() -> None:
    state = _queue(12)
    for result in (
        plan(state, Fifo()),
        plan(state, Fifo(), explain=False),
        plan(state, Fifo(), explain=False, cache=ViewCache(), ranks=RankIndex()),
    ):
        assert result.head == "H"
        assert result.reserved_at == 1000.0, "X ends at t=10 and R1 at t=1000: 12 GPUs are free then"
        # B (1500 s) would hold 4 of H's GPUs until t=1500: it must not overtake H.
        assert [p.job for p in result.placed] == ["X"]
    assert plan(state, Fifo()).pending["B"].kind == "reserved"


def test_rules_11_reserved_without_the_pass_placements_as_they_decided() -> None:
    result = plan(_queue(11), Fifo())
    assert (result.reserved_at, [p.job for p in result.placed]) == (2000.0, ["X", "B"])


def _split_queue(rules: int) -> SchedulerState:
    """Two 8-GPU nodes: R (4 GPUs on n1) ends at t=1000 and S (4 GPUs on n2) at t=2000; X (4 GPUs on
    n2, 10 s) starts now; the head H needs 8 GPUs as 2 nodes x 4, which X's and R's ends give it at
    t=1000."""
    return state_of(
        ev.PolicyConfigured(id="policy", policy="fifo", rules=rules),
        node("n1", 8),
        node("n2", 8),
        submit("F", 4, duration=5000.0),
        *run("F", "n1", (4, 5, 6, 7)),
        submit("R", 4, duration=1000.0),
        *run("R", "n1", (0, 1, 2, 3)),
        submit("S", 4, duration=2000.0),
        *run("S", "n2", (0, 1, 2, 3)),
        submit("X", 4, duration=10.0),
        submit("H", 8, nodes=2, duration=100.0),
        submit("B", 4, duration=1500.0),
    )


def test_a_multi_node_heads_reservation_counts_the_pass_placements_per_node() -> None:
    # (F holds n1/4-7 until t=5000: H needs n1/0-3 (R, t=1000) and n2/4-7 (X, t=10).)
    state = _split_queue(12)
    for result in (plan(state, Fifo()), plan(state, Fifo(), explain=False)):
        assert (result.head, result.reserved_at) == ("H", 1000.0)
        assert [p.job for p in result.placed] == ["X"]
