import collections

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.decider import decide_stamped
from gpuherd.invariants import violations
from gpuherd.log.base import Record
from gpuherd.state import ClusterState, apply, encode_state
from services.scheduler.decide import SchedulerDecider
from tests.helpers import finish, node, submit

decider = SchedulerDecider()


def drive(events: list[ev.Event], log: list[Record] | None = None) -> list[Record]:
    """Append ``events`` after ``log`` the way the runner does: each event is folded, then decided on;
    decisions are appended and folded before anything else is decided (own outputs are triggers too)."""
    log = list(log or [])
    state = ClusterState()
    for r in log:
        apply(state, r.seq, r.event)
    inbox = collections.deque(events)
    pending: collections.deque[Record] = collections.deque()
    while inbox or pending:
        if pending:
            for out in decide_stamped(decider, state, pending.popleft()):
                pending.append(append(log, state, out))
        else:
            pending.append(append(log, state, inbox.popleft()))
    return log


def append(log: list[Record], state: ClusterState, event: ev.Event) -> Record:
    record = Record(len(log) + 1, event)
    log.append(record)
    apply(state, record.seq, event)
    return record


def decisions(log: list[Record], kind: type) -> list:
    return [r.event for r in log if isinstance(r.event, kind)]


def test_fifo_head_blocks_smaller_jobs_behind_it() -> None:
    log = drive([node("n1", 4), submit("big", 4), submit("small", 1), submit("big2", 4), submit("tiny", 1)])
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["big"]
    log = drive([node("n1", 4), submit("a", 2), submit("b", 4), submit("c", 1)])
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a"], "c must not overtake the waiting head b"


def test_finish_lets_the_queue_move() -> None:
    log = drive([node("n1", 2), submit("a", 2), submit("b", 2), finish("a")])
    placed = decisions(log, ev.JobPlaced)
    assert [p.job for p in placed] == ["a", "b"]
    assert placed[1].based_on > placed[0].based_on
    assert placed[1].cause == "fin-a-0"


def test_multi_node_gang_and_even_split() -> None:
    log = drive([node("n1", 4), node("n2", 4), node("n3", 4), node("n4", 4), submit("g", 8), submit("e", 4, nodes=2)])
    g, e = decisions(log, ev.JobPlaced)
    assert sorted(a.node for a in g.allocations) == ["n1", "n2"]
    assert [(a.node, len(a.gpus)) for a in e.allocations] == [("n3", 2), ("n4", 2)]


def test_lost_node_requeues_its_jobs_then_places_elsewhere() -> None:
    log = drive(
        [
            node("n1", 2),
            node("n2", 2),
            submit("a", 2),
            submit("b", 2),
            ev.NodeLost(id="lost", node="n1", reason="silent"),
        ]
    )
    requeued = decisions(log, ev.JobRequeued)
    assert [(r.job, r.attempt) for r in requeued] == [("a", 0)]
    assert "node n1 lost" in requeued[0].reason
    placed = [(p.job, p.attempt) for p in decisions(log, ev.JobPlaced)]
    assert placed == [("a", 0), ("b", 0)], "no free GPU is left for a's retry while b runs"
    log2 = drive([node("n1", 2), node("n2", 2), submit("a", 2), ev.NodeLost(id="lost", node="n1")])
    assert [(p.job, p.attempt, p.allocations[0].node) for p in decisions(log2, ev.JobPlaced)] == [
        ("a", 0, "n1"),
        ("a", 1, "n2"),
    ]


def test_cancel_of_waiting_job_is_final_and_frees_the_head() -> None:
    log = drive(
        [node("n1", 1), submit("a"), submit("b"), submit("c"), ev.JobCancelRequested(id="c", job="b"), finish("a")]
    )
    fins = decisions(log, ev.JobFinished)
    assert [(f.job, f.outcome) for f in fins if f.source == "scheduler"] == [("b", "cancelled")]
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a", "c"]


def test_drained_and_lost_nodes_get_no_work() -> None:
    log = drive([node("n1", 2), ev.NodeDrained(id="d", node="n1"), node("n2", 1), submit("a", 1), submit("b", 1)])
    assert [(p.job, p.allocations[0].node) for p in decisions(log, ev.JobPlaced)] == [("a", "n2")]


def test_decide_is_pure() -> None:
    history = [node("n1", 4), node("n2", 4), submit("a", 3), submit("b", 6), submit("c", 2)]
    state = ClusterState()
    for seq, e in enumerate(history, 1):
        apply(state, seq, e)
    before = encode_state(state)
    trigger = Record(5, history[-1])
    first = decide_stamped(decider, state, trigger)
    second = decide_stamped(decider, state, trigger)
    assert first == second and first
    assert encode_state(state) == before, "decide must not change the state"
    assert [d.id for d in first] == [f"scheduler:5:{n}" for n in range(len(first))]
    assert all(d.based_on == 5 and d.cause == history[-1].id for d in first)


jobs = st.lists(st.tuples(st.integers(1, 10), st.sampled_from([None, 1, 2])), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(jobs=jobs, finish_order=st.randoms(use_true_random=False), lose=st.booleans())
def test_random_histories_never_double_book(jobs, finish_order, lose) -> None:
    history: list[ev.Event] = [node(f"n{i}", 4) for i in range(3)]
    for i, (gpus, nodes) in enumerate(jobs):
        if nodes is not None and gpus % nodes:
            nodes = None
        history.append(submit(f"j{i}", gpus, nodes=nodes))
    log = drive(history)
    # finish running jobs in random order, sometimes losing a node, until the queue drains
    for _ in range(60):
        state = ClusterState()
        for r in log:
            apply(state, r.seq, r.event)
        active = sorted(j.job for j in state.jobs.values() if j.status in ("placed", "running"))
        if not active:
            break
        extra: list[ev.Event] = []
        if lose and len(log) % 3 == 0 and state.nodes["n0"].status == "up":
            extra.append(ev.NodeLost(id=f"lost-{len(log)}", node="n0"))
        else:
            victim = finish_order.choice(active)
            extra.append(finish(victim, state.jobs[victim].attempt))
        log = drive(extra, log)
    assert violations(log) == []
    assert all(msgspec.json.encode(r.event) for r in log)
