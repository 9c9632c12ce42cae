"""Scheduling rules 13: a VC's quota head's reservation counts an elastic job that the same pass
started smaller at the GPUs it started on, not at the GPUs it asked for."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.schedule import Plan
from services.scheduler.state import SchedulerState
from tests.helpers import node, submit
from tests.unit.test_policies import run, state_of


def _cluster(rules: int) -> list[ev.Event]:
    """VC v (quota 16, no borrowing) runs r1 (8 GPUs of n0, ends at t=100). Other VCs' jobs leave
    7 GPUs free: 3 on n3 and 4 on n4."""
    return [
        ev.VcConfigured(id="vc", vc="v", gpu_quota=16, can_borrow=False),
        ev.PolicyConfigured(id="policy", policy="fifo", backfill=True, rules=rules),
        *(node(f"n{i}", 8) for i in range(5)),
        submit("r1", 8, vc="v", duration=100.0),
        *run("r1", "n0", tuple(range(8))),
        *(e for n in (1, 2) for e in (submit(f"o{n}", 8, duration=1e6), *run(f"o{n}", f"n{n}", tuple(range(8))))),
        submit("o3", 5, duration=1e6),
        *run("o3", "n3", (0, 1, 2, 3, 4)),
        submit("o4", 4, duration=1e6),
        *run("o4", "n4", (0, 1, 2, 3)),
        ev.ClockTicked(id="t", at=10.0, source="scheduler"),
    ]


def _elastic(job: str, gpus: int, duration: float) -> ev.JobSubmitted:
    submitted = submit(job, gpus, vc="v", duration=duration)
    # It runs on 2, 4 or 8 GPUs (those that divide its global batch of 8 samples, 1 per GPU).
    spec = msgspec.structs.replace(submitted.spec, elastic=ev.Elastic(min=2, max=gpus, global_batch=8, micro_batch=1))
    return msgspec.structs.replace(submitted, spec=spec)


def _plan(rules: int) -> Plan:
    state: SchedulerState = state_of(
        *_cluster(rules),
        _elastic("e", 8, duration=50.0),  # 7 GPUs are free: it starts on 4
        submit("big", 16, vc="v", duration=50.0),  # the quota stops it (8 + 4 + 16 > 16): the VC's quota head
        submit("mid", 2, vc="v", duration=1e5),  # fits the 3 GPUs left and the quota now, ends long after big's start
    )
    return SchedulerDecider().plan(state)


def test_an_elastic_job_started_smaller_gives_back_at_its_end_only_the_quota_it_holds() -> None:
    result = _plan(ev.SCHEDULING_RULES)
    (started,) = result.placed
    assert started.job == "e" and sum(len(a.gpus) for a in started.allocations) == 4
    assert result.pending["big"].kind == "quota"
    # When r1 and e have ended (t=100), v has 16 - (8 + 4) + 8 + 4 = 16 GPUs of quota: all of it
    # for big, none spare. mid would hold 2 of them until long after: it waits.
    assert result.pending["mid"].kind == "reserved"
    assert "would delay big" in result.pending["mid"].detail


def test_logs_of_rules_12_are_decided_by_them() -> None:
    # Counted at the 8 GPUs it asked for, e gave back 4 more than it held: 4 spare, and mid started.
    assert [p.job for p in _plan(12).placed] == ["e", "mid"]
