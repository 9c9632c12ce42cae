"""Scheduling rules 14: a gang split over nodes reserves the nodes it needs at its start, not every
spare GPU: a job behind it that runs past its start may use GPUs of the other nodes, or those of its
nodes beyond its per-node share."""

from __future__ import annotations

import random

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from services.scheduler.placement import ViewCache
from services.scheduler.policy import Fifo
from services.scheduler.ranks import RankIndex
from services.scheduler.schedule import Plan, plan
from services.scheduler.state import SchedulerState
from tests.helpers import finish, node, submit
from tests.unit.test_policies import run, state_of
from tests.unit.test_scheduler_decider import decisions, drive, folded


def _policy(rules: int) -> ev.PolicyConfigured:
    return ev.PolicyConfigured(id="policy", policy="fifo", rules=rules)


def _passes(state: SchedulerState) -> list[Plan]:
    """The explained pass, and the decider's own (reading the kept order, and sorting the queue)."""
    return [
        plan(state, Fifo()),
        plan(state, Fifo(), explain=False, cache=ViewCache(), ranks=RankIndex()),
        plan(state, Fifo(), explain=False),
    ]


def _cluster(rules: int) -> list[ev.Event]:
    """n1..n4, 8 GPUs each. a (4 GPUs of n1) and b (8 GPUs of n2) end at t=100; L3 (4 GPUs of n3)
    and L4 (6 GPUs of n4) run for a long time. H (16 GPUs on 2 nodes) can start at t=100, on n1
    and n2: the only nodes that are whole by then."""
    return [
        _policy(rules),
        *(node(f"n{i}", 8) for i in range(1, 5)),
        submit("a", 4, duration=100.0),
        *run("a", "n1", (0, 1, 2, 3)),
        submit("b", 8, duration=100.0),
        *run("b", "n2", tuple(range(8))),
        submit("L3", 4, duration=1e6),
        *run("L3", "n3", (0, 1, 2, 3)),
        submit("L4", 6, duration=1e6),
        *run("L4", "n4", tuple(range(6))),
        submit("H", 16, nodes=2, duration=100.0),
    ]


def test_a_long_job_that_fits_beside_a_multi_node_heads_nodes_overtakes_it() -> None:
    """d (2 GPUs, long) fits n4 (whose 2 GPUs H never needs): it starts now. Under rules 11 to 13 a
    multi-node head had no spare GPUs at all, so d waited for H's start and ran after it."""
    state = state_of(*_cluster(ev.SCHEDULING_RULES), submit("d", 2, duration=10_000.0))
    for result in _passes(state):
        assert (result.head, result.reserved_at) == ("H", 100.0)
        assert [(p.job, [a.node for a in p.allocations]) for p in result.placed] == [("d", ["n4"])]


def test_a_long_job_is_placed_beside_the_heads_nodes_where_its_best_fit_is_one_of_them() -> None:
    """d (3 GPUs, long): its best fit is n1 (4 free, as n3, and first by name), which H needs whole at
    t=100; it starts on n3 instead. e (4 GPUs, long) then fits only n1's 4 free GPUs: it waits."""
    state = state_of(*_cluster(ev.SCHEDULING_RULES), submit("d", 3, duration=10_000.0), submit("e", 4, duration=1e4))
    for result in _passes(state):
        assert [(p.job, [a.node for a in p.allocations]) for p in result.placed] == [("d", ["n3"])]
    explained = _passes(state)[0]
    assert explained.pending["e"].kind == "reserved"
    # (it named neither the head's nodes nor when: "which waits for 16 GPUs (reserved from t=100)")
    assert explained.pending["e"].detail == (
        "would delay H, which waits for 16 GPUs on 2 nodes (its start is reserved in 1m 40s, at t=100)"
    )


def test_a_job_on_a_head_node_beyond_its_per_node_share_overtakes_it() -> None:
    """H2 (8 GPUs on 2 nodes, 4 per node) waits for a (2 GPUs of n1) and b (n2), which end at t=100:
    then n1 and n2 have 8 free. f (4 GPUs, long) may take 4 of n1's 6 free GPUs now (n1 keeps 4 for
    H2 at t=100), and g (1 GPU, long) n3's last. h (2 GPUs, long) fits only n1's last 2: it waits."""
    events = [
        _policy(ev.SCHEDULING_RULES),
        *(node(f"n{i}", 8) for i in range(1, 4)),
        submit("a", 2, duration=100.0),
        *run("a", "n1", (0, 1)),
        submit("b", 8, duration=100.0),
        *run("b", "n2", tuple(range(8))),
        submit("L3", 7, duration=1e6),
        *run("L3", "n3", tuple(range(7))),
        submit("H2", 8, nodes=2, duration=100.0),
        submit("f", 4, duration=1e4),
        submit("g", 1, duration=1e4),
        submit("h", 2, duration=1e4),
    ]
    for result in _passes(state_of(*events)):
        assert (result.head, result.reserved_at) == ("H2", 100.0)
        placed = {p.job: [a.node for a in p.allocations] for p in result.placed}
        assert placed == {"f": ["n1"], "g": ["n3"]}, "h would leave n1 short of H2's 4 GPUs at t=100"
    assert _passes(state_of(*events))[0].pending["h"].kind == "reserved"


def _log(rules: int) -> list[Record]:
    """Decided as the events come: L1 (6 GPUs, long) on n1, a (4 GPUs, t=100) on n2, b (8 GPUs,
    t=100) on n3, L4 (5 GPUs, long) on n4; then H (16 GPUs on 2 nodes: n2 and n3 at t=100) and d
    (2 GPUs, long), whose best fit is n1's 2 free GPUs, which H never needs."""
    log = drive([_policy(rules), *(node(f"n{i}", 8) for i in range(1, 5)), submit("L1", 6, duration=1e6)])
    for job, gpus, duration in (("a", 4, 100.0), ("b", 8, 100.0), ("L4", 5, 1e6)):
        log = drive([submit(job, gpus, duration=duration)], log)
    nodes = {p.job: p.allocations[0].node for p in decisions(log, ev.JobPlaced)}
    assert nodes == {"L1": "n1", "a": "n2", "b": "n3", "L4": "n4"}
    return drive([submit("H", 16, nodes=2, duration=100.0), submit("d", 2, duration=10_000.0)], log)


def test_the_multi_node_head_still_starts_at_its_reserved_time() -> None:
    log = _log(ev.SCHEDULING_RULES)
    assert [(p.job, p.allocations[0].node) for p in decisions(log, ev.JobPlaced)][4:] == [("d", "n1")]
    ended = drive([finish("a", at=100.0), finish("b", at=100.0)], log)
    started = decisions(ended, ev.JobPlaced)[-1]
    assert (started.job, started.at, sorted(a.node for a in started.allocations)) == ("H", 100.0, ["n2", "n3"])


def test_rules_13_kept_every_gpu_for_a_multi_node_head_and_their_logs_audit_as_decided() -> None:
    old = _log(13)
    assert [p.job for p in decisions(old, ev.JobPlaced) if p.job in ("d", "H")] == []
    assert SchedulerDecider().plan(folded(old)).pending["d"].kind == "reserved"
    assert audit(old, SchedulerDecider()).ok and audit(_log(ev.SCHEDULING_RULES), SchedulerDecider()).ok


def test_what_overtakes_a_multi_node_head_leaves_it_its_nodes_at_its_reserved_start() -> None:
    """Random clusters: whatever a pass lets overtake a multi-node head, the head still fits (by its
    per-node share) at its reserved start, once the running jobs that end by then have ended and
    the jobs started now that do not end by then still hold their GPUs."""
    rng = random.Random(14)
    overtook = 0
    for case in range(150):
        events: list[ev.Event] = [_policy(ev.SCHEDULING_RULES), *(node(f"n{i}", 8) for i in range(5))]
        ends: dict[str, float] = {}
        for i in range(5):
            used = 0
            while used < 8 and rng.random() < 0.8:
                gpus = rng.randint(1, 8 - used)
                job, ends[job] = f"r{i}-{used}", rng.choice([50.0, 100.0, 200.0, 1e6])
                events += [submit(job, gpus, duration=ends[job]), *run(job, f"n{i}", tuple(range(used, used + gpus)))]
                used += gpus
        nodes = rng.choice([2, 3])
        head = submit("H", nodes * rng.choice([4, 6, 8]), nodes=nodes, duration=100.0)
        behind = [submit(f"c{j}", rng.randint(1, 6), duration=rng.choice([40.0, 150.0, 1e5])) for j in range(6)]
        state = state_of(*events, head, *behind)
        for result in _passes(state):
            if result.head != "H" or result.reserved_at is None:
                continue
            free = {f"n{i}": 8 for i in range(5)}
            for job_id, job in state.jobs.items():
                if job_id in ends and ends[job_id] > result.reserved_at:
                    free[job.allocations[0].node] -= job.spec.gpus
            for placed in result.placed:
                if state.jobs[placed.job].spec.duration_s > result.reserved_at:  # type: ignore[operator]
                    overtook += 1
                    for alloc in placed.allocations:
                        free[alloc.node] -= len(alloc.gpus)
            assert sum(gpus >= head.spec.gpus // nodes for gpus in free.values()) >= nodes, f"case {case}"
    assert overtook > 50, "the cases let jobs run past the head's start"
