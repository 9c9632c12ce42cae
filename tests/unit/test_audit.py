import msgspec

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from tests.helpers import finish, node, submit
from tests.unit.test_scheduler_decider import drive

HISTORY = [node("n1", 4), node("n2", 4), submit("a", 4), submit("b", 4), submit("c", 2), finish("a"), finish("b")]


def test_untampered_log_has_no_mismatch() -> None:
    report = audit(drive(HISTORY), SchedulerDecider())
    assert report.ok, report.mismatches
    assert report.decisions_checked == 3 and report.batches_checked == 3


def test_forged_decision_is_reported() -> None:
    log = drive(HISTORY)
    forged = ev.JobPlaced(
        id="scheduler:3:1",
        at=0.0,
        source="scheduler",
        based_on=3,
        cause=log[2].event.id,
        job="b",
        attempt=0,
        allocations=(ev.Allocation("n1", (0, 1, 2, 3)),),
    )
    log.append(Record(len(log) + 1, forged))
    report = audit(log, SchedulerDecider())
    assert [(m.event_id, m.kind) for m in report.mismatches] == [("scheduler:3:1", "unexpected")]


def test_altered_decision_is_reported_as_differing() -> None:
    log = drive(HISTORY)
    i = next(i for i, r in enumerate(log) if isinstance(r.event, ev.JobPlaced))
    original = log[i].event
    altered = msgspec.structs.replace(original, allocations=(ev.Allocation("n2", (0, 1, 2, 3)),))
    log[i] = Record(log[i].seq, altered)
    report = audit(log, SchedulerDecider())
    # The altered placement differs, and so does the next one, made on the state the tampering changed.
    assert [(m.event_id, m.kind) for m in report.mismatches] == [(original.id, "differs"), ("scheduler:5:0", "differs")]
    assert "would decide" in report.mismatches[0].detail


def test_event_claiming_to_be_the_scheduler_is_unattributable() -> None:
    log = drive(HISTORY)
    log.append(
        Record(len(log) + 1, ev.JobRequeued(id="hand-made", source="scheduler", job="c", attempt=0, reason="trust me"))
    )
    report = audit(log, SchedulerDecider())
    assert [m.kind for m in report.mismatches] == ["unattributable"]


def test_the_rules_a_service_records_at_start_are_inputs_not_unattributed_decisions() -> None:
    from services.elastic.decide import ElasticDecider

    log = drive(HISTORY)
    recorded = ev.ElasticConfigured(id="elastic:rules:1f", source="elastic", params={}, rules=ev.ELASTIC_RULES)
    log.append(Record(len(log) + 1, recorded))
    assert audit(log, ElasticDecider()).ok


def test_a_forged_decision_claiming_to_be_based_on_nothing_is_reported() -> None:
    log = drive(HISTORY)
    cause = next(r for r in log if isinstance(r.event, ev.JobSubmitted) and r.event.job == "c")  # decided nothing
    forged = ev.JobPlaced(
        id=f"scheduler:{cause.seq}:0",
        at=0.0,
        source="scheduler",
        based_on=0,
        cause=cause.event.id,
        job="c",
        attempt=0,
        allocations=(ev.Allocation("n1", (0, 1)),),
    )
    log.append(Record(len(log) + 1, forged))
    report = audit(log, SchedulerDecider())
    assert [(m.event_id, m.kind) for m in report.mismatches] == [(forged.id, "unattributable")]
