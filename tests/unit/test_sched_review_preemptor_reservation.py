"""Review of the scheduling pass: a job waiting for the victims it preempted counts their GPUs (and
its VC's quota they hold) as free from now in its reservation. A job behind it must not take them
meanwhile, only to be preempted for it in turn once the victims have stopped."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from tests.helpers import ended, node, submit
from tests.unit.test_scheduler_decider import decisions, drive


def _with(event: ev.JobSubmitted, **spec: object) -> ev.JobSubmitted:
    return msgspec.structs.replace(event, spec=msgspec.structs.replace(event.spec, **spec))


def _churn(rules: int, *, vc: str = "default") -> list[Record]:
    """8 GPUs: V (6 GPUs, priority 0, 10,000 s) runs; P (8 GPUs, priority 5) preempts it; B (2 GPUs,
    priority 0, 1,000 s) comes while V stops; then V has stopped."""
    quota = [ev.VcConfigured(id="vc", vc=vc, gpu_quota=8, can_borrow=False)] if vc != "default" else []
    log = drive(
        [
            ev.PolicyConfigured(id="policy", policy="fifo", rules=rules),
            *quota,
            node("n1", 8) if not quota else node("n1", 16),
            submit("V", 6, vc=vc, duration=10_000.0),
            ev.JobStarted(id="sV", at=0.0, job="V", attempt=0, node="n1"),
            _with(submit("P", 8, vc=vc, duration=100.0), priority=5),
            _with(submit("B", 2, vc=vc, duration=1000.0, at=1.0), priority=0),
        ]
    )
    return drive([ended("V", "n1", outcome="stopped", exit_code=None, at=31.0)], log)


def test_a_job_behind_a_preemptor_does_not_take_the_gpus_its_preemption_counted_on() -> None:
    log = _churn(12)
    assert [p.job for p in decisions(log, ev.JobPreempted)] == ["V"], "B must not be started, then preempted for P"
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["V", "P"]
    assert audit(log, SchedulerDecider()).ok


def test_a_job_of_its_vc_does_not_take_the_quota_a_quota_heads_preemption_counted_on() -> None:
    # (16 GPUs, VC q's quota 8: P waits for the quota V holds, not for GPUs.)
    log = _churn(12, vc="q")
    assert [p.job for p in decisions(log, ev.JobPreempted)] == ["V"]
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["V", "P"]
    assert audit(log, SchedulerDecider()).ok


def test_rules_11_let_the_job_behind_take_them_as_they_decided() -> None:
    for vc in ("default", "q"):
        log = _churn(11, vc=vc)
        assert [p.job for p in decisions(log, ev.JobPreempted)] == ["V", "B"]
        assert audit(log, SchedulerDecider()).ok
