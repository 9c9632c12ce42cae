"""The order a decider keeps between its passes (``RankIndex``) is the policy's own sort of the
queue, after every event: submissions, predictions, placements, requeues, cancellations of
waiting jobs (which leave the state in the same event) and policy changes, and as time passes
(LAS: a waiting job starves)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from services.scheduler import schedule
from services.scheduler.decide import SchedulerDecider
from services.scheduler.placement import ViewCache
from services.scheduler.policy import POLICIES, Policy
from services.scheduler.ranks import KeptOrder, RankIndex
from services.scheduler.schedule import plan
from services.scheduler.state import SchedulerState, index_problems
from tests.helpers import node, submit

STATIC = sorted(name for name, cls in POLICIES.items() if cls.static_rank)
INDEXED = sorted(name for name, cls in POLICIES.items() if cls.static_rank or cls.timed_rank)
VCS = ("a", "b", "default")


def test_the_policies_with_static_ranks_are_those_whose_waiting_ranks_ignore_time_and_other_jobs() -> None:
    # LAS ranks by waiting time too (starvation), at a moment it tells; fair share by everyone's use:
    # it sorts at every pass.
    assert STATIC == ["fifo", "qssf", "sjf", "srtf"]
    assert INDEXED == ["fifo", "las", "qssf", "sjf", "srtf"]


class History:
    """A scheduler state folded one event at a time, as a decider folds its log."""

    def __init__(self, policy: str, *, backfill: bool = True) -> None:
        self.decider = SchedulerDecider()
        self.state: SchedulerState = self.decider.initial_state()
        self.seq = 0
        self.now = 0.0
        self.backfill = backfill
        self.fold(ev.PolicyConfigured(id="p", policy=policy, backfill=backfill))
        for vc in VCS[:2]:
            self.fold(ev.VcConfigured(id=f"vc-{vc}", vc=vc, gpu_quota=8, can_borrow=vc == "a"))
        for n in range(3):
            self.fold(node(f"n{n}", 8))

    def fold(self, event: ev.Event) -> None:
        self.seq += 1
        self.state = self.decider.evolve(self.state, self.seq, event)

    def waiting(self) -> list[str]:
        return list(self.state.queue)

    def step(self, rng: random.Random, i: int) -> None:
        self.now += rng.choice([0.0, 1.0, 60.0])
        waiting, running = self.waiting(), [j for j in self.state.active]
        roll = rng.random()
        if roll < 0.4 or not waiting:
            spec = submit(f"j{i}", rng.choice([1, 2, 4, 8]), vc=rng.choice(VCS), at=self.now).spec
            duration = rng.choice([None, 30.0, 600.0, 600.0, 7200.0])
            spec = ev.JobSpec(**{**_fields(spec), "duration_s": duration, "priority": rng.choice([0, 0, 1])})
            self.fold(ev.JobSubmitted(id=f"s{i}", at=self.now, source="t", job=f"j{i}", spec=spec, intake_source="t"))
        elif roll < 0.6:
            job = rng.choice(waiting + running)
            sigma = rng.choice([0.0, 0.5])
            seconds = rng.choice([10.0, 600.0, 3600.0])
            self.fold(
                ev.JobDurationPredicted(id=f"d{i}", at=self.now, job=job, seconds=seconds, sigma=sigma, user_history=1)
            )
        elif roll < 0.72:
            job = self.state.jobs[rng.choice(waiting)]
            free = {name: n.free_gpus() for name, n in self.state.nodes.items()}
            where = next((name for name, gpus in free.items() if len(gpus) >= job.spec.gpus), None)
            if where is not None:
                gpus = tuple(sorted(free[where])[: job.spec.gpus])
                allocation = ev.Allocation(where, gpus)
                self.fold(
                    ev.JobPlaced(id=f"p{i}", at=self.now, job=job.job, attempt=job.attempt, allocations=(allocation,))
                )
                self.fold(ev.JobStarted(id=f"st{i}", at=self.now, job=job.job, attempt=job.attempt, node=where))
        elif roll < 0.82 and running:
            job = self.state.jobs[rng.choice(running)]
            self.fold(ev.JobRequeued(id=f"r{i}", at=self.now, job=job.job, attempt=job.attempt, reason="preempted"))
        elif roll < 0.92:
            job = self.state.jobs[rng.choice(waiting)]  # a waiting job cancelled leaves the state at once
            self.fold(ev.JobFinished(id=f"c{i}", at=self.now, job=job.job, attempt=job.attempt, outcome="cancelled"))
        else:
            policy = rng.choice(INDEXED)
            params = {"declared_durations": float(rng.random() < 0.5)} if policy != "las" else {}
            if policy == "qssf":
                params["quantile"] = rng.choice([0.5, 0.9])
            if policy == "las":  # starving within a history's hours, and ranked by service
                params = {
                    "min_starvation_s": rng.choice([60.0, 600.0]),
                    "first_queue_gpu_s": rng.choice([60.0, 3600.0]),
                }
            self.fold(
                ev.PolicyConfigured(id=f"c{i}", at=self.now, policy=policy, params=params, backfill=self.backfill)
            )


def _fields(spec: ev.JobSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


def _sorted(state: SchedulerState, policy: Policy, without: set[str] = frozenset(), keep: list[str] = ()) -> list[str]:
    jobs = [state.jobs[j] for j in state.queue if state.jobs[j].spec.vc not in without or j in keep]
    return [j.job for j in sorted(jobs, key=lambda j: policy.rank(j, state))]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(INDEXED))
def test_the_kept_order_is_the_policys_sort_after_every_event(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    history, index = History(policy), RankIndex()
    for i in range(120):
        history.step(rng, i)
        state = history.state
        assert not index_problems(state)
        in_force = history.decider.policy_for(state)
        if rng.random() < 0.5:
            continue  # passes do not follow every event: the index catches up on several at once
        assert index.refresh(state, in_force)
        assert [j.job for j in index.order(state)] == _sorted(state, in_force), f"after event {i}"
        without = {vc for vc in VCS if rng.random() < 0.5}
        keep = [first.job for vc in without if (first := index.first(state, vc, lambda j: True)) is not None]
        expected = _sorted(state, in_force, without, keep)
        assert [j.job for j in index.order(state, without, [state.jobs[j] for j in keep])] == expected


def test_a_pass_ranks_only_the_waiting_jobs_that_changed_since_the_pass_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    history = History("srtf")
    for i in range(500):
        history.fold(submit(f"j{i}", 16, at=float(i), duration=float(1000 - i)))  # none fits: all wait
    ranked: list[str] = []
    srtf = POLICIES["srtf"]
    monkeypatch.setattr(srtf, "key", lambda self, job, state: (ranked.append(job.job), job.spec.duration_s)[1:])
    decider = history.decider
    decider._schedule(history.state, set())
    assert len(ranked) >= 500  # the first pass ranks the queue
    ranked.clear()
    history.fold(ev.JobDurationPredicted(id="d", at=600.0, job="j7", seconds=5.0))
    history.fold(submit("late", 16, at=600.0, duration=1.0))
    decider._schedule(history.state, set())
    assert sorted(ranked) == ["j7", "late"]


@pytest.mark.parametrize("depth", [1000, 3], ids=["deep", "shallow"])
@pytest.mark.parametrize("backfill", [True, False], ids=["backfill", "no-backfill"])
@pytest.mark.parametrize("policy", INDEXED)
def test_a_pass_reading_the_kept_order_decides_what_a_sorted_pass_decides(
    policy: str, backfill: bool, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same placements, preemptions, head and reservation, pass after pass on a busy queue, whether
    the pass reads the decider's kept order (which sets aside the VCs whose quota holds every job
    still to come, and merges the per-VC orders where VCs are full, even under FIFO) or sorts. A
    shallow backfill depth makes the jobs read behind the head count: those of a VC set aside too."""
    monkeypatch.setattr(schedule, "BACKFILL_DEPTH", depth)
    rng = random.Random(7)
    history = History(policy, backfill=backfill)
    # Quotas that hold back their first job while smaller jobs behind it still fit.
    history.fold(ev.VcConfigured(id="vc-b2", vc="b", gpu_quota=12, can_borrow=False))
    history.fold(ev.VcConfigured(id="vc-default", vc="default", gpu_quota=6, can_borrow=False))
    index = RankIndex()
    set_aside = 0
    for i in range(400):
        history.step(rng, i)
        state = history.state
        if not state.queue or rng.random() < 0.3:
            continue  # (the index catches up on several events at once)
        in_force = history.decider.policy_for(state)
        aside_before = KeptOrder.set_aside
        calls: list[str] = []

        def counting(self: KeptOrder, vc: str, calls: list[str] = calls, real=aside_before) -> None:
            calls.append(vc)
            real(self, vc)

        KeptOrder.set_aside = counting  # type: ignore[method-assign]
        try:
            kept = plan(state, in_force, backfill=backfill, cache=ViewCache(), ranks=index, explain=False)
        finally:
            KeptOrder.set_aside = aside_before  # type: ignore[method-assign]
        set_aside += len(calls)
        sorted_pass = plan(state, in_force, backfill=backfill, cache=ViewCache(), explain=False)
        assert [p.job for p in kept.placed] == [p.job for p in sorted_pass.placed], f"after event {i}"
        assert [p.job for p in kept.preempted] == [p.job for p in sorted_pass.preempted], f"after event {i}"
        assert (kept.head, kept.reserved_at) == (sorted_pass.head, sorted_pass.reserved_at), f"after event {i}"
    assert set_aside > 0  # the history reaches passes that set a VC aside


@pytest.mark.parametrize(("depth", "short_starts"), [(2, False), (3, True)])
def test_the_jobs_of_a_vc_set_aside_count_toward_the_depth_behind_the_head_and_only_those(
    depth: int, short_starts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VC b's quota (8) holds back b-hold once b-first has taken 6 of it: no later job of b fits, so
    the pass sets b aside at b-0 and passes over b-00. The head (16 GPUs on the 10 free) is found
    next. Behind it, b-1 and b-2 count toward the backfill depth (b-00, before the head, does not):
    the short job after them starts only if the depth is more than 2, as in a sorted pass."""
    monkeypatch.setattr(schedule, "BACKFILL_DEPTH", depth)
    history = History("fifo")
    history.fold(submit("a-running", 8, vc="a", duration=600.0))
    history.fold(ev.JobPlaced(id="pl", job="a-running", attempt=0, allocations=(ev.Allocation("n0", tuple(range(8))),)))
    history.fold(ev.JobStarted(id="st", job="a-running", attempt=0, node="n0"))
    jobs = [
        ("b-first", 6, "b", None), ("b-hold", 4, "b", None), ("b-0", 4, "b", None), ("b-00", 4, "b", None),
        ("head", 16, "default", 2), ("b-1", 4, "b", None), ("b-2", 4, "b", None), ("short", 1, "default", None),
    ]  # fmt: skip
    for n, (job, gpus, vc, nodes) in enumerate(jobs):
        history.fold(submit(job, gpus, nodes=nodes, vc=vc, at=float(n), duration=1200.0 if job == "b-first" else 10.0))
    state = history.state
    in_force = history.decider.policy_for(state)
    expected = ["b-first", "short"] if short_starts else ["b-first"]
    sorted_pass = plan(state, in_force, cache=ViewCache(), explain=False)
    assert [p.job for p in sorted_pass.placed] == expected and sorted_pass.head == "head"
    set_aside: list[str] = []
    real = KeptOrder.set_aside
    monkeypatch.setattr(KeptOrder, "set_aside", lambda self, vc: (set_aside.append(vc), real(self, vc))[-1])
    kept = plan(state, in_force, cache=ViewCache(), ranks=RankIndex(), explain=False)
    assert [p.job for p in kept.placed] == expected and kept.head == "head"
    assert set_aside == ["b"]
