"""Elastic rules 5: the elastic service knows its VCs' per-user limits as the scheduler applies them
(``max_running_per_user``, ``max_gpus_per_user``: ``services/scheduler/holds.py``). It shrinks no
elastic job for a waiting job its user's limit holds back (the scheduler would not start it whatever
GPUs are freed), unless shrinking that user's own elastic jobs lifts the hold; and it grows no job
past its user's GPU limit (the scheduler refuses such a grow)."""

from __future__ import annotations

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.decider import replay
from services.elastic.policy import UserLimits
from services.scheduler.decide import SchedulerDecider
from tests.unit.test_elastic_policy import _at, _decide, _state
from tests.unit.test_resize import ELASTIC, _completed, _e, _propose, started
from tests.unit.test_scheduler_decider import drive


def _submit(job: str, spec: ev.JobSpec) -> ev.JobSubmitted:
    return ev.JobSubmitted(id=f"s-{job}", source="test", job=job, spec=spec, intake_source="t")


def _rigid(user: str, gpus: int, vc: str = "lab") -> ev.JobSpec:
    return ev.JobSpec(name="rigid", user=user, gpus=gpus, vc=vc, command=("python", "x.py"))


def _why_pending(log: list[Record]) -> dict[str, str]:
    """What the scheduler says holds each waiting job back (its pass's own verdict)."""
    state = replay(SchedulerDecider(), log)
    return {job: why.kind for job, why in SchedulerDecider().plan(state).pending.items()}


def _j_at_3_on_n1() -> list[Record]:
    """Ana's elastic job j grown to 3 GPUs of n1 (1 free there); n2's 4 GPUs free."""
    return _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)


@pytest.mark.parametrize("limit", [{"max_running_per_user": 1}, {"max_gpus_per_user": 4}], ids=["running jobs", "GPUs"])
def test_no_elastic_job_shrinks_for_a_job_its_user_s_limit_holds_back(limit: dict[str, int]) -> None:
    """Bo runs 3 GPUs in VC lab and waits for 3 more: his VC allows one running job per user (or 4
    GPUs), so the scheduler will not start the waiting job however many GPUs free up. Rules 4 shrank
    ana's elastic job for it anyway: it trained slower for GPUs that then stood idle, kept for a job
    that could not take them."""
    log = drive([ev.VcConfigured(id="lab", source="test", vc="lab", **limit)], _j_at_3_on_n1())
    log = drive([_submit("b1", _rigid("bo", 3)), _submit("b2", _rigid("bo", 3))], log)
    log = _at(log, 1100.0)
    state = _state(log)
    assert state.jobs["b1"].status == "placed" and state.jobs["b2"].status == "pending"
    assert _why_pending(log)["b2"] == "user limit", "the scheduler holds b2 back by its user's limit"
    assert _decide(log) == [], "no shrink lets b2 start: nothing to shrink for"
    (old,) = _decide(log, rules=4)
    assert old.job == "j" and old.gpus == 2 and "b2 waits" in old.reason, "a log of rules 4 re-derives as decided"

    # Another user's job in the same VC is not held back: j shrinks for it as before.
    log = _at(drive([_submit("c1", _rigid("cy", 3))], log), 1200.0)
    assert _state(log).jobs["c1"].status == "pending" and _why_pending(log).get("c1") != "user limit"
    (proposal,) = _decide(log)
    assert proposal.job == "j" and proposal.gpus == 2 and "c1 waits" in proposal.reason


def _bo_elastic_at_3_on_n2(log: list[Record]) -> list[Record]:
    """Bo's elastic job k running on 3 of n2's GPUs in VC lab, which allows 4 GPUs per user."""
    elastic = ev.JobSpec(name="k", user="bo", gpus=3, vc="lab", command=("python", "k.py"), elastic=ELASTIC)
    log = drive([ev.VcConfigured(id="lab", source="test", vc="lab", max_gpus_per_user=4), _submit("k", elastic)], log)
    log = drive([_e(ev.JobStarted, job="k", attempt=0, node="n2")], log)
    assert _state(log).jobs["k"].allocations == (ev.Allocation("n2", (0, 1, 2)),)
    return log


def test_a_job_its_user_s_gpu_limit_holds_back_is_helped_by_that_user_s_own_elastic_jobs_only() -> None:
    """Bo's elastic job k holds 3 of the 4 GPUs lab allows him; his job b2 asks for 2: held back
    although 2 GPUs are free. Shrinking ana's job would not help it; shrinking his own k by one lets
    it start. Rules 4 did neither, and kept the 2 free GPUs idle for b2 for as long as k ran."""
    log = _bo_elastic_at_3_on_n2(_j_at_3_on_n1())
    log = _at(drive([_submit("b2", _rigid("bo", 2))], log), 1100.0)
    assert _why_pending(log)["b2"] == "user limit"
    (proposal,) = _decide(log)
    assert (proposal.job, proposal.gpus) == ("k", 2) and "b2 waits" in proposal.reason
    assert _decide(log, rules=4) == [], "a log of rules 4 re-derives as decided"

    # The scheduler commits the shrink; once it is done b2 fits bo's limit and starts.
    log = drive([msgspec.structs.replace(proposal, id="p-k", at=1100.0)], log)
    (resized,) = [r.event for r in log if isinstance(r.event, ev.JobResized) and r.event.job == "k"]
    shape = {"node": "n2", "world": 2, "world_before": 3}
    log = drive([_e(ev.RescaleCompleted, job="k", attempt=0, generation=resized.generation, **shape)], log)
    assert _state(log).jobs["b2"].status == "placed"
    assert _decide(_at(log, 1200.0)) == [], "nothing waits: no further shrink"


def test_no_job_is_grown_past_its_user_s_gpu_limit() -> None:
    """The scheduler refuses a grow that takes a user past the GPUs the VC allows per user: rules 4
    proposed it anyway (and again every retry_s), lending idle GPUs to a job that could not take
    them rather than to one that could."""
    elastic = ev.JobSpec(name="k", user="bo", gpus=2, vc="lab", command=("python", "k.py"), elastic=ELASTIC)
    lab = ev.VcConfigured(id="lab", source="test", vc="lab", max_gpus_per_user=2)
    log = drive([lab, _submit("k", elastic)], started())  # ana's j on 2 of n1's GPUs
    (k_node,) = (a.node for a in _state(log).jobs["k"].allocations)
    log = _at(drive([_e(ev.JobStarted, job="k", attempt=0, node=k_node)], log), 1000.0)
    assert {(p.job, p.gpus) for p in _decide(log, rules=4)} == {("j", 3), ("k", 3)}
    (grow,) = [p for p in _decide(log, rules=4) if p.job == "k"]
    refused = drive([msgspec.structs.replace(grow, id="p-k", at=1000.0)], log)
    assert not [r for r in refused if isinstance(r.event, ev.JobResized)], "the scheduler refuses it"
    assert {(p.job, p.gpus) for p in _decide(log)} == {("j", 3)}, "bo holds the 2 GPUs lab allows him"


def test_user_limits_count_what_the_scheduler_counts() -> None:
    """The counts come from the log alone and agree with the scheduler's own (jobs placed or running
    per VC and user, and the GPUs they hold, a shrink's GPUs until it is done), plus the round's own
    resizes and starts (as the scheduler's pass counts its own placements)."""
    log = drive([_submit("b2", _rigid("bo", 2))], _bo_elastic_at_3_on_n2(_j_at_3_on_n1()))
    shrinking = drive([_e(ev.RescaleProposed, job="k", attempt=0, generation=0, gpus=2)], log)
    assert _state(shrinking).jobs["k"].rescale is not None and len(_state(shrinking).jobs["k"].workers) == 2
    for moment in (log, shrinking):
        state, scheduler = _state(moment), replay(SchedulerDecider(), moment)
        resizable = [j for j in (state.jobs["j"], state.jobs["k"]) if j.rescale is None]
        limits = UserLimits(state, resizable, {j.job: len(j.workers) for j in resizable})
        b2 = state.jobs["b2"]
        assert limits.gpu_room(b2) == 4 - scheduler.user_gpus["lab/bo"] == 1, "k holds 3 (2 + 1 leaving)"
        assert not limits.running_limit_reached(b2) and scheduler.user_active["lab/bo"] == 1
        assert limits.gpu_room(state.jobs["j"]) is None, "VC default has no per-user limit"

    state = _state(log)
    sizes = {"j": 3, "k": 3}
    limits = UserLimits(state, [state.jobs["j"], state.jobs["k"]], sizes)
    b2 = state.jobs["b2"]
    sizes["k"] = 2  # a shrink this round gives its user's GPUs back
    assert limits.gpu_room(b2) == 2
    limits.started(b2)
    assert limits.gpu_room(b2) == 0 and limits.running_limit_reached(b2) is False
