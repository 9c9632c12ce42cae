"""Scheduling rules 12: elastic rescales. A rollback keeps only the committed workers whose GPUs
the job still holds (and the fold never gives a resize a GPU another job holds); a grow does not
take the GPUs a preemption counted on; a rescale never reported done is rolled back after
``rescale_timeout_s``."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.fold.invariants import violations
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from services.scheduler.policy import check_policy
from tests.helpers import ended, node, submit, tick
from tests.unit.test_resize import SPEC, _completed, _e, _propose, _resized, _state
from tests.unit.test_scheduler_decider import decisions, drive

CMD = ("python", "t.py")
OTHER = ev.JobSpec(name="k", user="bo", gpus=2, command=CMD)


def _rules(rules: int) -> list[ev.Event]:
    return [ev.PolicyConfigured(id="policy", policy="fifo", rules=rules)]


def _running(rules: int) -> list[Record]:
    """One 4-GPU cpu node; the elastic job j (sizes 1 to 3) placed on n1/0,1 and running."""
    log = drive(
        [
            *_rules(rules),
            node("n1", 4, executor="cpu", ports=(29500, 29599)),
            ev.JobSubmitted(id="s", source="test", job="j", spec=SPEC, intake_source="t"),
        ]
    )
    return drive([_e(ev.JobStarted, job="j", attempt=0, node="n1")], log)


def _with(spec: ev.JobSpec, **fields: object) -> ev.JobSpec:
    return msgspec.structs.replace(spec, **fields)


def _with_spec(submitted: ev.JobSubmitted, **fields: object) -> ev.JobSubmitted:
    return msgspec.structs.replace(submitted, spec=_with(submitted.spec, **fields))


def _holders(log: list[Record]) -> list[str | None]:
    return [g.job for g in _state(log).nodes["n1"].gpus]


def _audits_clean(log: list[Record]) -> bool:
    return audit(log, SchedulerDecider()).ok


# -- a rollback takes back no GPU the job gave up -----------------------------------------------------


def _recover_then_fail(rules: int, *, grow_committed: bool) -> list[Record]:
    """j grows to n1/0,1,2 (committed, or still in flight); its worker n1/1 dies, the scheduler
    commits a recover to n1/0,2 and gives GPU 1 back; k (2 GPUs) is placed on n1/1,3; then the
    recover fails."""
    log = _propose(_running(rules), 3)
    if grow_committed:
        log = _completed(log, 1, 3, 2)
    log = drive([_e(ev.WorkerLost, job="j", attempt=0, node="n1", gpu=1, exit_code=137)], log)
    assert [(r.kind, r.allocations) for r in _resized(log)][-1] == ("recover", (ev.Allocation("n1", (0, 2)),))
    log = drive([ev.JobSubmitted(id="sk", source="test", job="k", spec=OTHER, intake_source="t")], log)
    assert _holders(log) == ["j", "k", "j", "k"]
    return drive([_e(ev.RescaleFailed, job="j", attempt=0, generation=2, node="n1", reason="re-form timed out")], log)


def test_a_rollback_after_a_recover_leaves_the_dead_workers_gpu_to_the_job_now_holding_it() -> None:
    log = _recover_then_fail(12, grow_committed=True)
    rollback = _resized(log)[-1]
    assert rollback.kind == "rollback" and rollback.allocations == (ev.Allocation("n1", (0, 2)),)
    assert rollback.state_from == "n1/0" and rollback.releasing == ()
    assert _holders(log) == ["j", "k", "j", "k"] and violations(log) == []
    assert _audits_clean(log)


def test_a_rollback_of_a_recover_during_a_grow_keeps_the_committed_survivor_and_lets_the_joiner_go() -> None:
    log = _recover_then_fail(12, grow_committed=False)  # committed: n1/0,1; n1/2 joined with the grow
    rollback = _resized(log)[-1]
    assert rollback.kind == "rollback" and rollback.allocations == (ev.Allocation("n1", (0,)),)
    assert rollback.releasing == (ev.Allocation("n1", (2,)),)
    assert _holders(log) == ["j", "k", "j", "k"] and violations(log) == []


def test_rules_11_rolled_back_onto_the_dead_workers_gpu_and_their_logs_audit_as_decided() -> None:
    log = _recover_then_fail(11, grow_committed=True)
    assert _resized(log)[-1].allocations == (ev.Allocation("n1", (0, 1, 2)),), "as rules 11 decided"
    assert _audits_clean(log)
    assert [v.split(": ", 1)[1] for v in violations(log)] == ["j grew onto n1/1, held by k"]
    state = _state(log)
    assert _holders(log) == ["j", "k", "j", "k"], "the fold does not apply it: k keeps its GPU"
    assert state.jobs["j"].allocations == (ev.Allocation("n1", (0, 2)),) and state.jobs["j"].generation == 2


def test_the_fold_never_gives_a_resize_a_gpu_another_job_holds() -> None:
    log = _recover_then_fail(12, grow_committed=True)
    job = _state(log).jobs["j"]
    taking = _e(
        ev.JobResized,
        job="j",
        attempt=0,
        generation=job.generation + 1,
        allocations=(ev.Allocation("n1", (0, 1, 2)),),
        kind="grow",
    )
    log = drive([taking], log)
    state = _state(log)
    assert _holders(log) == ["j", "k", "j", "k"]
    assert state.jobs["j"].generation == job.generation and state.jobs["j"].allocations == job.allocations
    assert state.jobs["k"].held == 2 and state.jobs["j"].held == 2


# -- a grow leaves the GPUs a preemption counted on -----------------------------------------------------


def _preempting(rules: int, preemptor_gpus: int) -> list[Record]:
    """n1 has 5 GPUs: j (elastic, priority 10) runs on 0,1, v on 2,3, GPU 4 is idle. The elastic
    service proposes j 2->3; before it is decided, p (priority 5) comes and preempts v."""
    log = drive(
        [
            *_rules(rules),
            node("n1", 5, executor="cpu", ports=(29500, 29599)),
            ev.JobSubmitted(id="s", source="test", job="j", spec=_with(SPEC, priority=10), intake_source="t"),
            submit("v", 2, command=CMD),
        ]
    )
    log = drive([_e(ev.JobStarted, job=job, attempt=0, node="n1") for job in ("j", "v")], log)
    stale = _e(ev.RescaleProposed, job="j", attempt=0, generation=0, gpus=3, based_on=log[-1].seq)
    log = drive([_with_spec(submit("p", preemptor_gpus, command=CMD), priority=5)], log)
    assert [(x.job, x.by) for x in decisions(log, ev.JobPreempted)] == [("v", "p")]
    return drive([stale], log)


def test_a_stale_grow_does_not_take_the_idle_gpu_a_preemptor_counted_on() -> None:
    log = _preempting(12, preemptor_gpus=3)  # p needs v's GPUs and GPU 4
    assert _resized(log) == []
    log = drive([ended("v", "n1", outcome="stopped")], log)
    placed = [(p.job, p.allocations) for p in decisions(log, ev.JobPlaced)]
    assert placed[-1] == ("p", (ev.Allocation("n1", (2, 3, 4)),)), "v stopped for p, and p starts"
    assert _holders(log) == ["j", "j", "p", "p", "p"] and _audits_clean(log)


def test_a_grow_into_a_gpu_the_waiting_preemptor_does_not_need_goes_on() -> None:
    log = _preempting(12, preemptor_gpus=2)  # v's GPUs are enough for p
    assert [(r.kind, r.allocations) for r in _resized(log)] == [("grow", (ev.Allocation("n1", (0, 1, 4)),))]
    log = drive([ended("v", "n1", outcome="stopped")], log)
    assert decisions(log, ev.JobPlaced)[-1].job == "p" and _holders(log) == ["j", "j", "p", "p", "j"]


def test_rules_11_let_a_stale_grow_take_the_preemptors_gpu_and_their_logs_audit_as_decided() -> None:
    log = _preempting(11, preemptor_gpus=3)
    assert [r.kind for r in _resized(log)] == ["grow"]
    log = drive([ended("v", "n1", outcome="stopped")], log)
    assert _state(log).jobs["p"].status == "pending", "v stopped for nothing"
    assert _audits_clean(log)


# -- a rescale never reported done is rolled back ------------------------------------------------------


def _shrink_never_reported(rules: int, *, params: dict[str, float] | None = None) -> list[Record]:
    """j runs on n1/0,1,2 (committed); at t=100 the scheduler commits a shrink to n1/0, and the new
    rank 0's report that it is done is lost."""
    policy = ev.PolicyConfigured(id="policy", policy="fifo", rules=rules, params=params or {})
    log = drive(
        [
            policy,
            node("n1", 4, executor="cpu", ports=(29500, 29599)),
            ev.JobSubmitted(id="s", source="test", job="j", spec=SPEC, intake_source="t"),
        ]
    )
    log = drive([_e(ev.JobStarted, job="j", attempt=0, node="n1")], log)
    log = _completed(_propose(log, 3), 1, 3, 2)
    log = drive([_e(ev.RescaleProposed, at=100.0, job="j", attempt=0, generation=1, gpus=1)], log)
    shrink = _resized(log)[-1]
    assert shrink.kind == "shrink" and shrink.at == 100.0 and shrink.releasing == (ev.Allocation("n1", (1, 2)),)
    return log


def test_a_rescale_never_reported_done_is_rolled_back_at_the_first_tick_past_its_deadline() -> None:
    log = drive([tick(1900.0, lost_after=1e9)], _shrink_never_reported(12))
    assert _resized(log)[-1].kind == "shrink", "1800 s after it was committed is not past the deadline yet"
    log = drive([tick(1901.0, lost_after=1e9)], log)
    rollback = _resized(log)[-1]
    assert rollback.kind == "rollback" and rollback.generation == 3
    assert rollback.allocations == (ev.Allocation("n1", (0, 1, 2)),) and rollback.joiners == ("n1/1", "n1/2")
    assert rollback.state_from == "n1/0" and "shrink to generation 2 not reported done within 1800s" in rollback.reason
    assert _audits_clean(log)
    log = _completed(log, 3, 3, 1)
    job = _state(log).jobs["j"]
    assert job.rescale is None and job.held == 3 and job.committed == rollback.allocations
    log = drive([tick(9000.0, lost_after=1e9)], log)
    assert _resized(log)[-1] == rollback, "a rescale reported done has no deadline"


def test_the_deadline_is_a_cluster_parameter_of_the_policy() -> None:
    log = _shrink_never_reported(12, params={"rescale_timeout_s": 60.0})
    log = drive([tick(161.0, lost_after=1e9)], log)
    assert [r.kind for r in _resized(log)][-1] == "rollback"
    assert check_policy("fifo", {"rescale_timeout_s": 0.0}) is not None, "a deadline must be positive"
    assert check_policy("fifo", {"rescale_timeout_s": 60.0}) is None


def test_an_overdue_rescale_with_too_few_committed_workers_left_stops_the_attempt() -> None:
    spec = _with(SPEC, elastic=ev.Elastic(min=2, max=4, global_batch=24, micro_batch=4))
    log = drive(
        [
            *_rules(12),
            node("n1", 4, executor="cpu", ports=(29500, 29599)),
            ev.JobSubmitted(id="s", source="test", job="j", spec=spec, intake_source="t"),
        ]
    )
    log = _propose(drive([_e(ev.JobStarted, job="j", attempt=0, node="n1")], log), 3)  # grow to n1/0,1,2
    log = drive([_e(ev.WorkerLost, job="j", attempt=0, node="n1", gpu=1, exit_code=137)], log)  # recover to 0,2
    assert _resized(log)[-1].kind == "recover"  # of the committed n1/0,1 only n1/0 is left: below the minimum
    log = drive([tick(3600.0, lost_after=1e9)], log)
    (stop,) = decisions(log, ev.JobPreempted)
    assert stop.job == "j" and stop.by == "" and "too few of its committed workers" in stop.reason
    log = drive([ended("j", "n1", outcome="stopped")], log)
    (requeued,) = decisions(log, ev.JobRequeued)
    assert requeued.attempt == 0 and requeued.reason == stop.reason
    assert _state(log).jobs["j"].attempt == 1, "a new attempt, placed afresh"
    assert _audits_clean(log)


def test_rules_11_left_a_rescale_never_reported_done_in_flight_and_their_logs_audit_as_decided() -> None:
    log = drive([tick(36000.0, lost_after=1e9)], _shrink_never_reported(11))
    assert [r.kind for r in _resized(log)][-1] == "shrink"
    assert _state(log).jobs["j"].rescale == "shrink"
    assert _audits_clean(log)
