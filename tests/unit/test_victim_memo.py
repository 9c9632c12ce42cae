"""A preemption pass that asks a quota head only about the jobs of its VC it outranked before, or
skips it where it outranked none (``VictimMemo``), decides what a pass that scans them all again
decides, pass after pass, as jobs start, run down their remaining time, learn new durations, are
requeued or cancelled; and each narrowed scan finds what a full one would. A new policy or
scheduling forgets the memo."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gpuherd import events as ev
from gpuherd.fold.state import JobState
from services.scheduler import schedule
from services.scheduler.placement import ViewCache
from services.scheduler.policy import POLICIES
from services.scheduler.schedule import VictimMemo, plan
from services.scheduler.state import SchedulerState
from tests.helpers import submit
from tests.unit.test_rank_index import History


class Unconfigured(History):
    """The history of ``test_rank_index`` under one policy: its steps that reconfigure the policy
    (which forgets the memo) fold a duration prediction instead."""

    def fold(self, event: ev.Event) -> None:
        if isinstance(event, ev.PolicyConfigured) and self.seq > 0:
            running = list(self.state.active) or list(self.state.queue)
            if not running:
                return
            event = ev.JobDurationPredicted(
                id=f"d-{event.id}", at=event.at, job=running[self.seq % len(running)], seconds=7200.0
            )
        super().fold(event)


def test_only_policies_whose_outranking_fades_with_time_keep_the_memo() -> None:
    fading = sorted(name for name, cls in POLICIES.items() if cls.preemptive and cls.outranking_fades)
    assert fading == ["srtf"]  # LAS: a running job's service, and what outranks it, grows as it runs
    assert not VictimMemo().holds_for(History("las").state, POLICIES["las"]())


@pytest.mark.parametrize("policy", ["srtf", "fifo", "sjf"])
def test_a_pass_that_asks_only_what_its_heads_outranked_before_decides_what_a_full_scan_does(policy: str) -> None:
    rng = random.Random(11)
    history = Unconfigured(policy)
    history.fold(ev.VcConfigured(id="vc-b2", vc="b", gpu_quota=12, can_borrow=False))
    history.fold(ev.VcConfigured(id="vc-default", vc="default", gpu_quota=6, can_borrow=False))
    memo = VictimMemo()
    narrowed = {"none": 0, "some": 0}
    real_victims, real_before = schedule._victims, VictimMemo.outranked_before

    def counted(self: VictimMemo, state: SchedulerState, job: JobState, claim: object) -> tuple[str, ...] | None:
        before = real_before(self, state, job, claim)
        if before is not None:
            narrowed["some" if before else "none"] += 1
        return before

    def checked(state: SchedulerState, policy_: Any, job: JobState, vc_used: Any, **kw: Any) -> list[JobState]:
        """Each scan the memo narrows or skips finds what a full scan finds now."""
        found = real_victims(state, policy_, job, vc_used, **kw)
        full = real_victims(state, policy_, job, vc_used, same_vc=kw.get("same_vc", False))
        assert [j.job for j in found] == [j.job for j in full], job.job
        return found

    VictimMemo.outranked_before = counted  # type: ignore[method-assign]
    schedule._victims = checked  # type: ignore[assignment]
    try:
        for i in range(600):
            history.step(rng, i)
            state = history.state
            if not state.queue:
                continue
            in_force = history.decider.policy_for(state)
            kept = plan(state, in_force, cache=ViewCache(), victimless=memo, explain=False)
            scanned = plan(state, in_force, cache=ViewCache(), explain=False)
            assert [p.job for p in kept.preempted] == [p.job for p in scanned.preempted], f"after event {i}"
            assert [p.job for p in kept.placed] == [p.job for p in scanned.placed], f"after event {i}"
            assert (kept.head, kept.reserved_at) == (scanned.head, scanned.reserved_at), f"after event {i}"
    finally:
        VictimMemo.outranked_before = real_before  # type: ignore[method-assign]
        schedule._victims = real_victims  # type: ignore[assignment]
    assert narrowed["none"] > 50  # the history reaches passes that skip a scan
    if policy == "srtf":
        assert narrowed["some"] > 10, narrowed  # and, where jobs are outranked, passes that narrow one


def test_a_head_whose_remaining_time_falls_is_scanned_again() -> None:
    """The memo is keyed by the head's claim: a new prediction that shortens the waiting head
    makes it outrank the running job it did not outrank before (no event named that job)."""
    history = History("srtf")  # trusting predictions over declared durations (a sim node needs one)
    history.fold(ev.PolicyConfigured(id="p-2", policy="srtf", params={"declared_durations": 0.0}))
    history.fold(submit("runs", 8, vc="b", duration=5000.0))
    history.fold(ev.JobDurationPredicted(id="d-runs", job="runs", seconds=1000.0))
    history.fold(ev.JobPlaced(id="p-runs", job="runs", attempt=0, allocations=(ev.Allocation("n0", tuple(range(8))),)))
    history.fold(ev.JobStarted(id="s-runs", job="runs", attempt=0, node="n0"))
    history.fold(submit("waits", 8, vc="b", duration=5000.0))
    history.fold(ev.JobDurationPredicted(id="d-waits", job="waits", seconds=5000.0))
    memo, policy = VictimMemo(), history.decider.policy_for(history.state)
    assert not plan(history.state, policy, cache=ViewCache(), victimless=memo, explain=False).preempted
    history.fold(ev.JobDurationPredicted(id="d-waits-2", job="waits", seconds=10.0))
    shorter = plan(history.state, policy, cache=ViewCache(), victimless=memo, explain=False)
    assert [p.job for p in shorter.preempted] == ["runs"]


def test_a_job_the_hourly_cap_held_back_is_asked_about_again_once_its_hour_has_passed() -> None:
    """A job the head outranks but may not take yet (preempted twice within the hour) becomes one it
    may take as time passes, with no event naming it: the memo keeps no scan that held one back."""
    history = History("srtf")
    history.fold(submit("runs", 8, vc="b", duration=5000.0))
    allocation = (ev.Allocation("n0", tuple(range(8))),)
    history.fold(ev.JobPlaced(id="p-runs", at=0.0, job="runs", attempt=0, allocations=allocation))
    history.fold(ev.JobStarted(id="s-runs", at=0.0, job="runs", attempt=0, node="n0"))
    history.fold(submit("waits", 8, vc="b", duration=100.0, at=10.0))
    state = history.state
    cap = state.scheduling.param("max_preemptions_per_hour")
    state.preempted_at["runs"] = [state.now - 1.0] * int(cap)  # (its recent preemptions: at the cap)
    memo, policy = VictimMemo(), history.decider.policy_for(state)
    assert not plan(state, policy, cache=ViewCache(), victimless=memo, explain=False).preempted
    # An hour on, by an event of another VC: nothing names "runs" or changes what "waits" claims.
    history.fold(submit("elsewhere", 1, vc="a", duration=100.0, at=state.now + 3600.0))
    later = plan(history.state, policy, cache=ViewCache(), victimless=memo, explain=False)
    assert [p.job for p in later.preempted] == ["runs"]
