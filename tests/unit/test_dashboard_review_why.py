"""A job's page says why the job is where it is now: once a requeued job is placed again, its last
requeue's reason is its history (the timeline), not why it runs."""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.log import Record
from services.dashboard.view import DashboardView
from tests.helpers import node, submit

REQUEUED = "node n1 lost: no heartbeat for 30 s"


def _placed(attempt: int, at: float, reason: str = "") -> ev.JobPlaced:
    allocations = (ev.Allocation("n1", (0,)),)
    return ev.JobPlaced(
        id=f"place-{attempt}",
        at=at,
        source="scheduler",
        job="a",
        attempt=attempt,
        allocations=allocations,
        reason=reason,
    )


def test_a_job_running_again_after_a_requeue_is_not_explained_by_that_requeue() -> None:
    events: list[ev.Event] = [
        node("n1", 2),
        submit("a", 1, at=1.0),
        _placed(0, 2.0),
        ev.JobStarted(id="s0", at=3.0, source="agent.n1", job="a", attempt=0, node="n1"),
        ev.JobRequeued(id="rq", at=4.0, source="scheduler", job="a", attempt=0, reason=REQUEUED),
    ]
    view = DashboardView()
    view.fold_all(Record(seq, e) for seq, e in enumerate(events, 1))
    waiting = view.job("a")
    assert waiting is not None and waiting["status"] == "pending"
    view.fold(6, _placed(1, 5.0, reason="first fit"))
    view.fold(7, ev.JobStarted(id="s1", at=6.0, source="agent.n1", job="a", attempt=1, node="n1"))
    running = view.job("a")
    assert running is not None and running["status"] == "running"
    assert running["why"] == "first fit"
    assert REQUEUED in [e["detail"] for e in running["timeline"]]  # (the requeue stays in its history)
    view.fold(8, ev.JobFinished(id="f", at=7.0, source="scheduler", job="a", attempt=1, outcome="completed"))
    ended = view.job("a")
    assert ended is not None and ended["why"] == "completed"
