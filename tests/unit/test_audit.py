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


def test_an_audit_reads_the_log_twice_and_holds_only_the_deciders_decisions() -> None:
    from gpuherd.runtime.audit import Audit

    log = drive(HISTORY)
    check = Audit(SchedulerDecider())
    for record in iter(log):  # (each read a stream: nothing asks for the log as a whole)
        check.see(record)
    assert all(r.event.source == "scheduler" for batch in check._batches.values() for r in batch)
    for record in iter(log):
        check.fold(record)
    report = check.finish()
    assert report == audit(log, SchedulerDecider()) and report.ok and report.events == len(log)
    assert not check._causes, "each cause was let go once its batch was decided again"


def test_a_decision_caused_by_an_event_after_its_based_on_is_unattributable() -> None:
    log = drive(HISTORY)
    placed = next(r.event for r in log if isinstance(r.event, ev.JobPlaced))
    ids = {r.event.id for r in log}
    # A cause the state it claims to be decided on had not folded (and that caused nothing else).
    later = next(r for r in log if r.seq > placed.based_on and f"scheduler:{r.seq}:0" not in ids)
    forged = msgspec.structs.replace(placed, id=f"scheduler:{later.seq}:0", cause=later.event.id)
    log.append(Record(log[-1].seq + 1, forged))
    report = audit(log, SchedulerDecider())
    assert [(m.event_id, m.kind) for m in report.mismatches] == [(forged.id, "unattributable")]
