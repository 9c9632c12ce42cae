"""What a report relay stores for a node: exactly what that node's agent may append itself."""

from __future__ import annotations

import pytest

from gpuherd import events as ev
from gpuherd.log.relay import check_report, matches, subjects_of
from gpuherd.security import appends_of
from services.nodeagent.spec import EMITS, permissions
from services.relay.spec import permissions as relay_permissions


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("herd.node.n1", "herd.node.n1", True),
        ("herd.node.n1", "herd.node.n2", False),
        ("herd.job.*.by.n1", "herd.job.j7.by.n1", True),
        ("herd.job.*.by.n1", "herd.job.j7.by.n2", False),
        ("herd.job.*.by.n1", "herd.job.j7", False),
        ("herd.job.*.by.n1", "herd.job.j7.by.n1.x", False),
        ("herd.job.>", "herd.job.j7.by.n1", True),
        ("herd.job.>", "herd.job", False),
        ("herd.*", "herd.node.n1", False),
    ],
)
def test_matches_reads_nats_wildcards(pattern: str, subject: str, expected: bool) -> None:
    assert matches(pattern, subject) is expected


def test_a_relay_stores_for_a_node_what_its_agent_may_append_and_nothing_else() -> None:
    assert set(subjects_of("n1")) == set(appends_of(EMITS, node="n1", source="agent.n1"))
    agent = set(permissions("n1").publish)
    assert set(subjects_of("n1")) <= agent
    assert set(subjects_of("*")) <= set(relay_permissions("relay").publish)
    assert "herd.report.n1" in agent and "herd.report.n2" not in agent


def test_every_event_an_agent_writes_passes_the_relays_check_for_its_own_node_only() -> None:
    stamp = {"id": "x", "at": 1.0, "source": "agent.n1"}
    reports = [
        ev.JobStarted(**stamp, job="j1", attempt=0, node="n1"),
        ev.TaskEnded(**stamp, job="j1", attempt=0, node="n1", outcome="completed", exit_code=0),
        ev.NodePoweredDown(**stamp, node="n1"),
        ev.MemoryLeaseRenewed(**stamp, lease="l1", job="j1", node="n1"),
    ]
    for report in reports:
        event, problem = check_report("n1", ev.encode(report))
        assert event == report and problem == "", report
        event, problem = check_report("n2", ev.encode(report))
        assert event is None and "may not write" in problem, report


def test_a_report_that_is_no_event_or_has_no_id_is_refused_with_the_reason() -> None:
    assert check_report("n1", b"{not json")[0] is None
    event, problem = check_report("n1", ev.encode(ev.NodePoweredDown(id="", at=1.0, source="agent.n1", node="n1")))
    assert event is None and "no id" in problem


def test_a_report_whose_subject_nats_cannot_take_is_refused() -> None:
    spaced = ev.encode(ev.JobStarted(id="y", at=1.0, source="agent.n1", job="a b", attempt=0, node="n1"))
    event, problem = check_report("n1", spaced)
    assert event is None and "no NATS subject" in problem


def test_a_copy_being_stored_elsewhere_or_a_full_queue_is_retried_not_final() -> None:
    from gpuherd.errors import LogError, LogUnavailable
    from gpuherd.log.jetstream import _refusal

    for code in (10158, 10164, 10167):
        assert isinstance(_refusal("append", {"code": 409, "err_code": code}), LogUnavailable), code
    assert not isinstance(_refusal("append", {"code": 400, "err_code": 10071}), LogUnavailable)
    assert isinstance(_refusal("append", {"code": 400, "err_code": 10071}), LogError)
