import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply, fold
from tests.helpers import finish, node, placed, records, submit


def encode_state(state: ClusterState) -> bytes:
    return msgspec.msgpack.encode(state)


def decode_state(data: bytes) -> ClusterState:
    return msgspec.msgpack.decode(data, type=ClusterState)


def run(*events: ev.Event) -> ClusterState:
    return fold((r.seq, r.event) for r in records(*events))


def test_submit_place_start_finish_releases_gpus() -> None:
    s = run(node("n1", 4), submit("a", 2), placed("a", ("n1", (0, 1))))
    assert s.jobs["a"].status == "placed" and s.free_gpus() == 2 and s.queue == []
    apply(s, 10, ev.JobStarted(id="s", at=2.0, job="a", attempt=0, node="n1"))
    assert s.jobs["a"].status == "running" and s.jobs["a"].started_at == 2.0
    apply(s, 11, finish("a", at=5.0))
    assert s.jobs["a"].status == "completed" and s.free_gpus() == 4 and s.jobs["a"].finished_at == 5.0


def test_requeue_bumps_attempt_and_keeps_queue_order() -> None:
    s = run(node("n1", 1), submit("a"), submit("b"), placed("a", ("n1", (0,))))
    assert s.queue == ["b"]
    apply(s, 10, ev.JobRequeued(id="r", job="a", attempt=0, reason="node lost"))
    assert s.jobs["a"].status == "pending" and s.jobs["a"].attempt == 1
    assert s.queue == ["a", "b"], "a requeued job keeps its place by submission order"
    assert s.free_gpus() == 1


def test_stale_attempt_reports_are_ignored() -> None:
    s = run(node("n1", 1), submit("a"), placed("a", ("n1", (0,))))
    apply(s, 10, ev.JobRequeued(id="r", job="a", attempt=0, reason="x"))
    apply(s, 11, finish("a", attempt=0))  # the old attempt's late report
    assert s.jobs["a"].status == "pending"
    apply(s, 12, placed("a", ("n1", (0,)), attempt=0))  # a placement of a stale attempt
    assert s.jobs["a"].status == "pending" and s.free_gpus() == 1


def test_reregistration_keeps_allocations_and_drain() -> None:
    s = run(node("n1", 2), submit("a"), placed("a", ("n1", (1,))), ev.NodeDrained(id="d", node="n1", reason="fix"))
    apply(s, 10, node("n1", 2))
    assert s.nodes["n1"].gpus[1].job == "a"
    assert s.nodes["n1"].status == "drained" and s.nodes["n1"].reason == "fix"


def test_lost_node_goes_back_up_on_registration() -> None:
    s = run(node("n1"), ev.NodeLost(id="l", node="n1", reason="silent"))
    assert s.nodes["n1"].status == "lost"
    apply(s, 10, node("n1"))
    assert s.nodes["n1"].status == "up"


def test_cancel_request_marks_live_jobs_only() -> None:
    s = run(node("n1"), submit("a"), submit("b"), finish("b"))
    apply(s, 10, ev.JobCancelRequested(id="c1", job="a"))
    apply(s, 11, ev.JobCancelRequested(id="c2", job="b"))
    assert s.jobs["a"].cancel_requested and not s.jobs["b"].cancel_requested


def test_snapshot_roundtrip_equals_fold() -> None:
    s = run(node("n1", 4), node("n2", 4), submit("a", 3), submit("b", 5), placed("a", ("n1", (0, 1, 2))))
    assert decode_state(encode_state(s)) == s


def test_fold_is_deterministic() -> None:
    history = [node("n1", 4), submit("a", 2), placed("a", ("n1", (0, 1))), finish("a", at=3.0)]
    assert encode_state(run(*history)) == encode_state(run(*history))


def test_placement_on_missing_gpus_is_not_applied() -> None:
    s = run(node("n1", 2), submit("a", 1))
    apply(s, 10, placed("a", ("ghost", (0,))))
    apply(s, 11, placed("a", ("n1", (5,))))
    assert s.jobs["a"].status == "pending" and s.free_gpus() == 2


def test_a_state_that_drops_finished_jobs_keeps_their_count() -> None:
    history = records(node("n1", 4), submit("a"), submit("b"), finish("b"))
    assert "b" in fold((r.seq, r.event) for r in history).jobs, "the default fold keeps history"
    lean = fold(((r.seq, r.event) for r in history), ClusterState(retain_finished=False))
    assert set(lean.jobs) == {"a"} and lean.ended == {"completed": 1} and lean.queue == ["a"]


def test_the_fold_says_which_nodes_an_event_changed_and_what_ran() -> None:
    s = run(node("n1", 4), node("n2", 4), submit("a", 2), placed("a", ("n2", (0, 1))))
    assert s.touched == ["n2"]
    apply(s, 10, ev.JobStarted(id="s", at=2.0, job="a", attempt=0, node="n2"))
    assert s.touched == [] and s.accounted == []
    apply(s, 11, finish("a", at=5.0))
    assert s.touched == ["n2"] and s.accounted == [("a", 5.0, 6.0)], "2 GPUs for 3 s"
