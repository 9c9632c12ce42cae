"""A job its VC's quota stops is protected as the gang head is: later jobs of its VC start only if
they end before its reserved start or use quota it will not need then.

(Found side by side with the Helios simulator on philly.csv: a 16-GPU job waited 13.9 days while
225 later jobs of its own VC started ahead of it, because only a job whose gang did not fit was
protected.)
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.fold import JobState
from services.analytics.jobs import job_table
from services.analytics.traces import load_philly_csv, submissions
from services.scheduler.decide import SchedulerDecider
from services.scheduler.schedule import Plan
from services.scheduler.state import SchedulerState
from tests.helpers import node, submit
from tests.unit.test_policies import run, state_of


def _vc(quota: int, *, rules: int = ev.SCHEDULING_RULES, backfill: bool = True) -> list[ev.Event]:
    return [
        ev.VcConfigured(id="vc", vc="v", gpu_quota=quota, can_borrow=False),
        ev.PolicyConfigured(id="policy", policy="fifo", backfill=backfill, rules=rules),
        *(node(f"n{i}", 8) for i in range(4)),
    ]


def _busy(at: float = 10.0) -> list[ev.Event]:
    """VC v runs r1 (8 GPUs, ends at 100) and r2 (4 GPUs, ends at 1000): 12 of its 16 GPUs."""
    return [
        submit("r1", 8, vc="v", duration=100.0),
        *run("r1", "n0", tuple(range(8))),
        submit("r2", 4, vc="v", duration=1000.0),
        *run("r2", "n1", (0, 1, 2, 3)),
        ev.ClockTicked(id="t", at=at, source="scheduler"),
    ]


def _plan(state: SchedulerState) -> Plan:
    """The decider's pass on ``state``, explained (by the policy, backfill and rules in force)."""
    return SchedulerDecider().plan(state)


def _placed(state: SchedulerState) -> list[str]:
    return [p.job for p in _plan(state).placed]


def test_later_jobs_of_its_vc_start_only_if_they_end_before_the_quota_heads_reserved_start() -> None:
    state = state_of(
        *_vc(16),
        *_busy(),
        submit("big", 16, vc="v", duration=50.0),  # stopped by the quota: 12 + 16 > 16
        submit("long", 4, vc="v", duration=1000.0),  # fits the quota now, ends after big's start
        submit("short", 4, vc="v", duration=50.0),  # ends long before it
        submit("unknown", 1, vc="v", duration=None),
        submit("other-vc", 8, duration=5000.0),  # another VC's quota: not held back
    )
    result = _plan(state)
    assert [p.job for p in result.placed] == ["short", "other-vc"]
    assert result.pending["big"].kind == "quota"
    for held in ("long", "unknown"):
        assert result.pending[held].kind == "reserved"
        detail = result.pending[held].detail
        assert "would delay big, the first job of VC v its quota holds back (its start is reserved in " in detail
        assert state.now == 10 and detail.endswith("reserved in 16m 30s, at t=1000)"), detail


def test_logs_of_the_first_rules_are_decided_by_them() -> None:
    state = state_of(*_vc(16, rules=1), *_busy(), submit("big", 16, vc="v"), submit("long", 4, vc="v", duration=1e4))
    assert _placed(state) == ["long"]  # as the pass decided before quota heads were protected


def test_quota_the_head_will_not_need_is_lent_to_later_jobs_however_long() -> None:
    # big needs 12: once r1 ends (t=100) the VC has 8 + 8 free, 4 more than big needs.
    state = state_of(
        *_vc(16),
        submit("r1", 8, vc="v", duration=100.0),
        *run("r1", "n0", tuple(range(8))),
        submit("big", 12, vc="v"),
        submit("long-1", 4, vc="v", duration=1e5),
        submit("long-2", 4, vc="v", duration=1e5),
    )
    result = _plan(state)
    assert [p.job for p in result.placed] == ["long-1"]
    assert result.pending["long-2"].kind == "reserved"


def test_with_backfill_off_nothing_of_its_vc_overtakes_it() -> None:
    state = state_of(*_vc(16, backfill=False), *_busy(), submit("big", 16, vc="v"), submit("short", 1, vc="v"))
    result = _plan(state)
    assert result.placed == [] and result.pending["short"].kind == "order"


def test_a_job_larger_than_its_whole_quota_holds_nothing_back() -> None:
    # Accepted before intake refused such jobs (or left so by a smaller quota): it never starts.
    state = state_of(*_vc(4), submit("huge", 8, vc="v"), submit("small", 1, vc="v"))
    assert _placed(state) == ["small"]


def test_a_large_job_is_not_starved_by_a_stream_of_small_jobs_of_its_vc(tmp_path: Path) -> None:
    # Shaped like the philly.csv case: a 16-GPU VC busy with two 8-GPU jobs, a 16-GPU job, then a
    # small job every 100 s for a day, running 500 or 2,000 s. Before, the small jobs kept taking the
    # quota each freed GPU gave back and the large job waited for the stream to end.
    rows = [(0, 3000.0, 8, "v"), (0, 4000.0, 8, "v"), (60, 600.0, 16, "v")]
    rows += [(100 + 100 * i, 500.0 if i % 2 else 2000.0, 1, "v") for i in range(864)]
    lines = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    for t, duration, gpus, vc in rows:
        stamp = pd.Timestamp("2017-10-01", tz="UTC") + pd.Timedelta(seconds=t)
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S},{duration},{gpus},{duration * gpus},{vc}")
    (tmp_path / "philly.csv").write_text("\n".join(lines) + "\n")
    trace = load_philly_csv(tmp_path / "philly.csv")
    result = simulate(submissions(trace), ClusterSpec(vcs={"v": VcSpec(nodes=2)}), "fifo")
    jobs = job_table(result.records).jobs
    big = jobs[jobs["gpus"] == 16].iloc[0]
    assert big["start_time"] - big["submit_time"] <= 4000.0 - 60.0, "it starts once both 8-GPU jobs end"
    later = jobs[(jobs["gpus"] == 1) & (jobs["start_time"] < big["start_time"])]
    # Those that overtook it ended by its start (backfill), never delaying it.
    assert len(later) > 0 and (later["end_time"] <= big["start_time"]).all()


def _quota_checks(monkeypatch: pytest.MonkeyPatch, state: SchedulerState) -> tuple[Plan, list[str], Plan, list[str]]:
    """The decider's pass and the explained one on ``state``, each with the jobs it checked the quota of."""
    from services.scheduler import schedule
    from services.scheduler.placement import ViewCache

    looked: list[str] = []
    check_quota = schedule.check_quota

    def counted(work: schedule.Pass, job: JobState, position: int) -> int | None:
        looked.append(job.job)
        return check_quota(work, job, position)

    monkeypatch.setattr(schedule, "check_quota", counted)
    policy, backfill = SchedulerDecider().policy_for(state), state.scheduling.backfill
    fast = schedule.plan(state, policy, backfill=backfill, cache=ViewCache(), explain=False)
    fast_looked = list(looked)
    looked.clear()
    explained = schedule.plan(state, policy, backfill=backfill)
    assert (explained.placed, explained.preempted) == (fast.placed, fast.preempted)
    return fast, fast_looked, explained, looked


def test_without_backfill_the_deciders_pass_looks_no_further_than_the_quota_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing of a VC starts behind its quota head without backfill: the decider's pass (no
    # explanations) passes over those jobs, and stops once every VC with waiting jobs is held back,
    # rather than ask each of a deep queue at every pass what the explained pass tells it.
    waiting = [submit(f"small-{i}", 1, vc="v") for i in range(50)]
    state = state_of(*_vc(16, backfill=False), *_busy(), submit("big", 16, vc="v"), *waiting)
    fast, fast_looked, explained, looked = _quota_checks(monkeypatch, state)
    assert (fast.placed, fast_looked) == ([], ["big"])
    assert len(looked) == 51 and explained.pending["small-49"].kind == "order"


def test_the_deciders_pass_skips_jobs_behind_a_quota_head_that_its_quota_has_no_room_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With backfill, a job behind its VC's quota head may start if it ends in time, but not one
    # larger than the room left in a quota it may not exceed: the decider's pass does not ask those.
    wide = [submit(f"wide-{i}", 8, vc="v", duration=10.0) for i in range(30)]
    state = state_of(*_vc(16), *_busy(), submit("big", 16, vc="v"), *wide, submit("short", 1, vc="v", duration=50.0))
    fast, fast_looked, explained, looked = _quota_checks(monkeypatch, state)
    assert ([p.job for p in fast.placed], fast_looked) == (["short"], ["big", "short"])
    assert len(looked) == 32 and explained.pending["wide-29"].kind == "quota"
