"""Random cluster histories against every policy: the scheduler's invariants hold, and every
recorded decision replays.

Each history mixes submissions (VCs with and without borrowing, priorities,
gangs), parts of attempts ending (some failing), nodes lost by clock ticks,
drains and undrains, unhealthy GPUs and live policy changes, then lets every
running attempt end until nothing runs.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.fold import ACTIVE, ClusterState, apply
from gpuherd.fold.invariants import violations
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from services.scheduler.policy import POLICIES
from tests.helpers import ended, node, tick
from tests.unit.test_scheduler_decider import drive, fold_log

VCS = [
    ev.VcConfigured(id="vc-a", vc="a", gpu_quota=4, can_borrow=True),
    ev.VcConfigured(id="vc-b", vc="b", gpu_quota=4, can_borrow=False),
]


def job_event(i: int, rng: random.Random, at: float) -> ev.JobSubmitted:
    gpus = rng.choice([1, 1, 2, 3, 4, 6, 8])
    nodes = 2 if gpus in (4, 8) and rng.random() < 0.4 else None
    spec = ev.JobSpec(
        name=f"j{i}",
        user=rng.choice(["ana", "ben", "cy"]),
        gpus=gpus,
        nodes=nodes,
        vc=rng.choice(["a", "b", "default"]),
        duration_s=rng.choice([5.0, 50.0, 500.0]),
        priority=rng.choice([0, 0, 0, 1]),
        max_retries=rng.choice([0, 1]),
    )
    return ev.JobSubmitted(id=f"test:intake:{i}", at=at, source="test", job=f"j{i}", spec=spec, intake_source="t")


def open_parts(state: ClusterState) -> list[tuple[str, int, str]]:
    return [
        (j.job, j.attempt, a.node)
        for j in state.jobs.values()
        if j.status in ACTIVE
        for a in j.allocations
        if a.node not in j.parts_ended
    ]


def check_gangs_and_quotas(log: list[Record]) -> None:
    state = ClusterState()
    for record in log:
        apply(state, record.seq, record.event)
        event = record.event
        if isinstance(event, ev.JobPlaced) and state.jobs[event.job].allocations == event.allocations:
            spec = state.jobs[event.job].spec
            sizes = [len(a.gpus) for a in event.allocations]
            assert sum(sizes) == spec.gpus, f"gang of {event.job} split: {sizes} for {spec.gpus} GPUs"
            if spec.nodes is not None:
                assert sizes == [spec.gpus // spec.nodes] * spec.nodes
        for vc in state.vcs.values():
            if vc.gpu_quota is None:
                continue
            active = [j for j in state.jobs.values() if j.status in ACTIVE and j.spec.vc == vc.vc]
            beyond = sum(j.spec.gpus for j in active) - sum(j.borrowed for j in active)
            assert beyond <= vc.gpu_quota, f"seq {record.seq}: VC {vc.vc} over quota without recorded borrowing"
            if not vc.can_borrow:
                assert all(j.borrowed == 0 for j in active)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(sorted(POLICIES)), steps=st.integers(5, 40))
def test_random_histories_keep_every_invariant_and_replay(seed: int, policy: str, steps: int) -> None:
    rng = random.Random(seed)
    history: list[ev.Event] = [*VCS, ev.PolicyConfigured(id="p0", policy=policy, backfill=rng.random() < 0.7)]
    history += [node(f"n{i}", 4, island=2, rack=f"r{i % 2}") for i in range(4)]
    log = drive(history)
    now, submitted, lost = 0.0, 0, False
    for step in range(steps):
        now += rng.choice([1.0, 5.0, 30.0])
        state = fold_log(log)
        roll = rng.random()
        if roll < 0.45:
            extra: ev.Event = job_event(submitted, rng, now)
            submitted += 1
        elif roll < 0.75 and open_parts(state):
            job, attempt, part = rng.choice(open_parts(state))
            outcome = "stopped" if state.jobs[job].stopping() else rng.choice(["completed", "completed", "failed"])
            extra = ended(job, part, attempt, outcome=outcome, at=now)
        elif roll < 0.8 and not lost:
            extra, lost = tick(now, lost_after=10.0, n1=now, n2=now, n3=now), True  # n0 goes silent
        elif roll < 0.88:
            name = f"n{rng.randrange(1, 4)}"
            drained = state.nodes[name].status == "drained"
            extra = (ev.NodeUndrained if drained else ev.NodeDrained)(id=f"d{step}", at=now, node=name)
        elif roll < 0.93:
            extra = ev.GpuHealthChanged(
                id=f"h{step}",
                at=now,
                node=f"n{rng.randrange(1, 4)}",
                index=rng.randrange(4),
                healthy=False,
                reason="XID",
            )
        else:
            extra = ev.PolicyConfigured(
                id=f"p{step}", at=now, policy=rng.choice(sorted(POLICIES)), backfill=rng.random() < 0.5
            )
        log = drive([extra], log)
    # Let everything that runs come to an end; undrain so that every job can fit again.
    log = drive([ev.NodeUndrained(id=f"u{i}", at=now, node=f"n{i}") for i in range(1, 4)], log)
    for _ in range(500):
        state = fold_log(log)
        parts = open_parts(state)
        if not parts:
            break
        job, attempt, part = parts[0]
        log = drive([ended(job, part, attempt, outcome="stopped" if state.jobs[job].stopping() else "completed")], log)

    assert violations(log) == []
    check_gangs_and_quotas(log)
    # Nothing runs now, so nothing may wait for GPUs: only for what no free GPU can fix.
    state = fold_log(log)
    pending = SchedulerDecider().plan(state).pending
    stuck = {job: p for job, p in pending.items() if p.kind not in ("quota", "drained", "no-node")}
    assert not stuck, f"jobs wait though nothing runs: {stuck}"
    assert all(state.jobs[j].spec.vc == "b" for j, p in pending.items() if p.kind == "quota")
    report = audit(log, SchedulerDecider())
    assert report.ok, report.mismatches[:3]
