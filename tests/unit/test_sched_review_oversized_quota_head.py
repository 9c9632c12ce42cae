"""Review of the scheduling pass: a waiting job larger than its VC's whole quota (accepted before the
quota was lowered) can never start, and takes no part in its VC's preemption: the VC's first job its
quota can ever admit is the one that may preempt within the VC (its quota head)."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from services.scheduler.placement import ViewCache
from services.scheduler.policy import Fifo
from services.scheduler.ranks import RankIndex
from services.scheduler.schedule import Plan, plan
from services.scheduler.state import SchedulerState
from tests.helpers import node, submit
from tests.unit.test_policies import run, state_of


def _with(event: ev.JobSubmitted, **spec: object) -> ev.JobSubmitted:
    return msgspec.structs.replace(event, spec=msgspec.structs.replace(event.spec, **spec))


def _state(rules: int) -> SchedulerState:
    """VC A (quota 8, then 4, no borrowing) runs L (4 GPUs, priority 0). O (8 GPUs, priority 5)
    was accepted under quota 8 and can never start under 4; J (4 GPUs, priority 5) outranks L."""
    return state_of(
        ev.PolicyConfigured(id="policy", policy="fifo", rules=rules),
        ev.VcConfigured(id="vc8", vc="A", gpu_quota=8, can_borrow=False),
        node("n1", 16),
        submit("L", 4, vc="A", duration=10_000.0),
        *run("L", "n1", (0, 1, 2, 3)),
        _with(submit("O", 8, vc="A"), priority=5),
        ev.VcConfigured(id="vc4", vc="A", gpu_quota=4, can_borrow=False),
        _with(submit("J", 4, vc="A"), priority=5),
    )


def _passes(state: SchedulerState) -> list[Plan]:
    """The explained pass, and the decider's own (reading the kept order, and sorting the queue)."""
    return [
        plan(state, Fifo()),
        plan(state, Fifo(), explain=False, cache=ViewCache(), ranks=RankIndex()),
        plan(state, Fifo(), explain=False),
    ]


def test_a_job_larger_than_its_vcs_quota_does_not_keep_the_next_job_of_its_vc_from_preempting() -> None:
    for result in _passes(_state(12)):
        assert [(p.job, p.by) for p in result.preempted] == [("L", "J")]
        assert result.placed == []


def test_rules_11_let_the_oversized_job_stand_for_its_vc_as_they_decided() -> None:
    for result in _passes(_state(11)):
        assert result.preempted == []


def test_why_the_oversized_job_waits_says_it_cannot_start_under_the_quota() -> None:
    pending = plan(_state(12), Fifo()).pending
    assert pending["O"].kind == "quota"
    assert "more than VC A's whole quota of 4" in pending["O"].detail
    assert pending["J"].kind == "preempting"
