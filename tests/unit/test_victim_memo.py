"""A preemption pass that skips the quota heads it found outranking no job of their VC before
(``VictimMemo``) decides what a pass that scans them again decides, pass after pass, as jobs
start, run down their remaining time, learn new durations, are requeued or cancelled; and each
skip is one a scan would agree with. A new policy or scheduling forgets the memo."""

from __future__ import annotations

import random

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
def test_a_pass_that_skips_the_heads_it_found_outranking_none_decides_what_a_full_scan_does(policy: str) -> None:
    rng = random.Random(11)
    history = Unconfigured(policy)
    history.fold(ev.VcConfigured(id="vc-b2", vc="b", gpu_quota=12, can_borrow=False))
    history.fold(ev.VcConfigured(id="vc-default", vc="default", gpu_quota=6, can_borrow=False))
    memo = VictimMemo()
    skipped = 0
    real = VictimMemo.outranks_none

    def checked(self: VictimMemo, state: SchedulerState, job: JobState, claim: object) -> bool:
        """Each skip is sound: a scan now would find nothing to take either."""
        nonlocal skipped
        found = real(self, state, job, claim)
        if found:
            skipped += 1
            in_force = history.decider.policy_for(state)
            assert schedule._victims(state, in_force, job, state.vc_usage(), same_vc=True) == [], job.job
        return found

    VictimMemo.outranks_none = checked  # type: ignore[method-assign]
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
        VictimMemo.outranks_none = real  # type: ignore[method-assign]
    assert skipped > 50  # the history reaches passes that skip a scan


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
