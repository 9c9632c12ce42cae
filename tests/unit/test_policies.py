"""Policies, quotas, preemption and pending reasons: one scheduling pass at a time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from services.scheduler.policy import POLICIES, Las, check_policy, make_policy, remaining_s
from services.scheduler.schedule import plan
from services.scheduler.state import SchedulerState
from tests.helpers import node, submit
from tests.unit.test_scheduler_decider import drive, folded

_scheduler = SchedulerDecider()


def apply(state: SchedulerState, seq: int, event: ev.Event) -> SchedulerState:
    """Fold as the scheduler does."""
    return _scheduler.evolve(state, seq, event)


def state_of(*events: ev.Event) -> SchedulerState:
    state = _scheduler.initial_state()
    for seq, e in enumerate(events, 1):
        apply(state, seq, e)
    return state


def placed(state: SchedulerState, policy: str = "fifo", **params: float) -> list[str]:
    return [p.job for p in plan(state, make_policy(policy, params)).placed]


def run(job: str, node_name: str, gpus: tuple[int, ...], at: float = 0.0, attempt: int = 0) -> list[ev.Event]:
    return [
        ev.JobPlaced(
            id=f"p-{job}-{attempt}", at=at, job=job, attempt=attempt, allocations=(ev.Allocation(node_name, gpus),)
        ),
        ev.JobStarted(id=f"s-{job}-{attempt}", at=at, job=job, attempt=attempt, node=node_name),
    ]


def test_every_policy_is_registered_with_its_name() -> None:
    assert set(POLICIES) == {"fifo", "sjf", "srtf", "las", "qssf", "fairshare"}
    with pytest.raises(ValueError, match="unknown policy 'lottery'"):
        make_policy("lottery")
    with pytest.raises(ValueError, match="policy las has no parameter bogus"):
        make_policy("las", {"bogus": 1.0})


def test_sjf_and_qssf_order_by_expected_duration_and_service() -> None:
    state = state_of(
        node("n1", 4),
        submit("long", 1, duration=500),
        submit("short", 1, duration=10),
        submit("wide", 4, duration=20),
    )
    assert [j.job for j in make_policy("sjf").order(state)] == ["short", "wide", "long"]
    assert [j.job for j in make_policy("fifo").order(state)] == ["long", "short", "wide"]
    predictions = [
        ev.JobDurationPredicted(id=f"pred-{job}", job=job, seconds=s) for job, s in (("long", 500), ("short", 10))
    ]
    predictions.append(ev.JobDurationPredicted(id="pred-wide", job="wide", seconds=20))
    for seq, prediction in enumerate(predictions, 100):
        apply(state, seq, prediction)
    assert [j.job for j in make_policy("qssf").order(state)] == ["short", "wide", "long"]  # 10, 80, 500 GPU-s


def test_qssf_ranks_by_prediction_not_by_the_declared_duration() -> None:
    """In a trace simulation the declared duration is the truth: QSSF must not peek at it."""
    state = state_of(node("n1", 4), submit("declared-short", 1, duration=10), submit("declared-long", 1, duration=900))
    apply(state, 10, ev.JobDurationPredicted(id="p1", job="declared-short", seconds=5000))
    apply(state, 11, ev.JobDurationPredicted(id="p2", job="declared-long", seconds=60))
    assert [j.job for j in make_policy("qssf").order(state)] == ["declared-long", "declared-short"]


def test_qssf_uses_predictions_and_a_default_when_there_is_none() -> None:
    cpu = node("n1", 4, executor="cpu", ports=(29500, 29599))
    a = submit("a", 2, duration=None, command=("x",))
    b = submit("b", 1, duration=None, command=("x",))
    prediction = ev.JobDurationPredicted(id="pred", job="a", seconds=60.0, model="test")
    state = state_of(cpu, a, b, prediction)
    # a: 60 s x 2 = 120; b: no prediction -> 3600 s x 1.
    assert [j.job for j in make_policy("qssf").order(state)] == ["a", "b"]
    assert [j.job for j in make_policy("qssf", {"default_duration_s": 10.0}).order(state)] == ["b", "a"]


def test_priority_goes_first_under_every_policy() -> None:
    urgent = submit("urgent", 1, duration=1000)
    urgent = ev.JobSubmitted(
        id=urgent.id, job="urgent", spec=ev.JobSpec(**{**_spec(urgent), "priority": 5}), intake_source="test"
    )
    state = state_of(node("n1", 1), submit("early", 1, duration=1), urgent)
    for name in POLICIES:
        assert make_policy(name).order(state)[0].job == "urgent", name


def _spec(e: ev.JobSubmitted) -> dict:
    import msgspec

    return msgspec.structs.asdict(e.spec)


def test_las_queues_by_attained_service_and_guards_against_starvation() -> None:
    policy = Las(first_queue_gpu_s=100.0, queue_ratio=10.0, starvation_factor=2.0, min_starvation_s=50.0)
    events = [node("n1", 4), submit("old", 1, duration=None), submit("new", 1, duration=None)]
    state = state_of(*events, *run("old", "n1", (0,), at=0.0))
    requeue = ev.JobRequeued(id="rq", at=150.0, job="old", attempt=0, reason="preempted")
    apply(state, 99, requeue)  # old ran 150 GPU-s: second queue
    assert state.jobs["old"].service_gpu_s == 150.0
    assert policy.queue(state.jobs["old"], state) == 1 and policy.queue(state.jobs["new"], state) == 0
    assert [j.job for j in policy.order(state)] == ["new", "old"]
    # Waiting longer than max(50, 2 x 150 s run) promotes it back to the first queue.
    state.now = 150.0 + 301.0
    assert policy.queue(state.jobs["old"], state) == 0
    assert [j.job for j in policy.order(state)] == ["old", "new"]


def test_fair_share_prefers_the_vc_that_used_less_per_weight() -> None:
    events = [
        ev.VcConfigured(id="v1", vc="vision", weight=1.0),
        ev.VcConfigured(id="v2", vc="nlp", weight=1.0),
        node("n1", 2),
        submit("v-old", 2, vc="vision", duration=None),
        *run("v-old", "n1", (0, 1), at=0.0),
        ev.JobFinished(id="f", at=1000.0, job="v-old", attempt=0, outcome="completed"),
        submit("v-next", 1, vc="vision", at=1000.0),
        submit("n-next", 1, vc="nlp", at=1000.0),
    ]
    state = state_of(*events)
    assert [j.job for j in make_policy("fairshare").order(state)] == ["n-next", "v-next"]
    # Past use decays: a day later with a 1 h half-life, vision's 2000 GPU-s count for almost nothing.
    apply(state, 100, ev.PolicyConfigured(id="pc", at=1000.0, policy="fairshare", params={"half_life_s": 3600.0}))
    assert state.past_usage("vc:vision") == pytest.approx(2000.0)
    state.now = 1000.0 + 24 * 3600
    assert state.past_usage("vc:vision") < 1e-3


def test_quota_without_borrowing_holds_a_job_and_says_why() -> None:
    state = state_of(
        ev.VcConfigured(id="v", vc="vision", gpu_quota=2, can_borrow=False),
        node("n1", 8),
        submit("a", 2, vc="vision"),
        submit("b", 1, vc="vision"),
        submit("c", 1),
    )
    result = plan(state, make_policy("fifo"))
    assert [p.job for p in result.placed] == ["a", "c"]
    assert result.pending["b"].kind == "quota"
    assert "VC vision uses 2 of its 2 GPUs" in result.pending["b"].detail


def test_borrowing_is_recorded_and_reclaimed_by_preemption_when_the_owner_waits() -> None:
    events = [
        ev.VcConfigured(id="v1", vc="vision", gpu_quota=2, can_borrow=True),
        ev.VcConfigured(id="v2", vc="nlp", gpu_quota=2, can_borrow=True),
        node("n1", 4),
        submit("vision-big", 4, vc="vision"),
    ]
    state = state_of(*events)
    (p,) = plan(state, make_policy("fifo")).placed
    assert p.borrowed == 2, "2 of its 4 GPUs are beyond vision's quota"
    state = state_of(*events, p, ev.JobStarted(id="s", job="vision-big", attempt=0, node="n1"))
    apply(state, 50, submit("nlp-job", 2, vc="nlp"))
    result = plan(state, make_policy("fifo"))
    (pre,) = result.preempted
    assert pre.job == "vision-big" and pre.by == "nlp-job" and "reclaiming" in pre.reason
    assert result.pending["nlp-job"].kind == "preempting"


def test_priority_preempts_the_least_lost_work_and_only_what_the_gang_needs() -> None:
    events = [
        node("n1", 4),
        submit("old", 2, duration=None, at=0.0),
        submit("young", 2, duration=None, at=0.0),
        *run("old", "n1", (0, 1), at=0.0),
        *run("young", "n1", (2, 3), at=90.0),
    ]
    state = state_of(*events)
    state.now = 100.0
    vip = ev.JobSubmitted(
        id="vip",
        at=100.0,
        job="vip",
        spec=ev.JobSpec(name="vip", user="u", gpus=2, duration_s=5.0, priority=3),
        intake_source="t",
    )
    apply(state, 20, vip)
    result = plan(state, make_policy("fifo"))
    assert [(p.job, p.by) for p in result.preempted] == [("young", "vip")], "young lost 10 s of work, old 100 s"
    # While young stops, vip waits for it and nothing else is preempted.
    apply(state, 21, result.preempted[0])
    again = plan(state, make_policy("fifo"))
    assert again.preempted == [] and again.pending["vip"].kind == "preempting"


def test_preemption_takes_no_job_whose_gpus_the_gang_would_not_use() -> None:
    # n1: "keep" (priority 5) and "young" (2 GPUs, 10 s of work); n2: "old" (4 GPUs, 100 s).
    # vip (4 GPUs) fits on n2 alone once old stops: young, though the cheaper victim, is not needed.
    def job(name: str, gpus: int, priority: int) -> ev.JobSubmitted:
        spec = ev.JobSpec(name=name, user="u", gpus=gpus, duration_s=1000.0, priority=priority)
        return ev.JobSubmitted(id=name, at=100.0, job=name, spec=spec, intake_source="t")

    def victims(rules: int) -> list[str]:
        state = state_of(
            ev.PolicyConfigured(id="policy", policy="fifo", rules=rules),
            node("n1", 4),
            node("n2", 4),
            *(job(name, gpus, priority) for name, gpus, priority in [("keep", 2, 5), ("young", 2, 0), ("old", 4, 0)]),
            *run("keep", "n1", (0, 1)),
            *run("young", "n1", (2, 3), at=90.0),
            *run("old", "n2", (0, 1, 2, 3)),
        )
        state.now = 100.0
        apply(state, 20, job("vip", 4, 3))
        return [p.job for p in plan(state, make_policy("fifo")).preempted]

    assert victims(ev.SCHEDULING_RULES) == ["old"], "young's GPUs are not where vip goes"
    assert victims(6) == ["young", "old"], "a log of the rules before is re-derived as it was decided"


def test_preemption_is_bounded_per_hour() -> None:
    state = state_of(node("n1", 2), submit("low", 2, duration=None), *run("low", "n1", (0, 1), at=0.0))
    state.preempted_at["low"] = [10.0, 20.0]
    state.now = 100.0
    apply(
        state,
        30,
        ev.JobSubmitted(
            id="hi",
            at=100.0,
            job="hi",
            spec=ev.JobSpec(name="hi", user="u", gpus=2, duration_s=1.0, priority=9),
            intake_source="t",
        ),
    )
    result = plan(state, make_policy("fifo"))
    assert result.preempted == [] and result.pending["hi"].kind == "gang"


def test_pending_reasons_name_the_cause_and_position() -> None:
    state = state_of(
        node("n1", 6),
        node("n2", 4),
        ev.NodeDrained(id="d", node="n2", reason="maintenance"),
        submit("running", 4, duration=1000),
        submit("huge", 10),
        submit("head", 5),  # reserved from t=1000, when 6 GPUs are free: 1 to spare
        submit("behind", 2, duration=5000),  # fits the 2 free GPUs now, but would hold 2 at t=1000
        submit("spare", 1, duration=5000),  # holds only the one GPU head will not need
    )
    apply(state, 20, plan(state, make_policy("fifo")).placed[0])
    result = plan(state, make_policy("fifo"))
    assert result.pending["huge"].kind == "drained" and "n2" in result.pending["huge"].detail
    assert result.pending["head"].kind == "gang" and result.pending["head"].position == 2
    assert result.pending["behind"].kind == "reserved" and "would delay head" in result.pending["behind"].detail
    assert result.head == "head" and result.reserved_at == 1000.0
    assert [p.job for p in result.placed] == ["spare"]


def test_qssf_ranks_by_a_quantile_of_the_prediction_and_a_fallback_without_user_history() -> None:
    state = state_of(node("n1", 4), submit("sure", 1, duration=10), submit("unsure", 1, duration=10))
    # Same median; "unsure" spreads widely and its user has no history the model knew.
    apply(state, 10, ev.JobDurationPredicted(id="p1", job="sure", seconds=1000, sigma=0.1, user_history=5))
    apply(state, 11, ev.JobDurationPredicted(id="p2", job="unsure", seconds=900, sigma=2.0))
    order = lambda **p: [j.job for j in make_policy("qssf", p).order(state)]  # noqa: E731
    assert order() == ["unsure", "sure"]  # by the median
    assert order(quantile=0.8) == ["sure", "unsure"]  # the spread counts against it
    assert order(quantile=0.8, fallback_quantile=0.5) == ["unsure", "sure"]  # ... but not without user history
    assert "between 0 and 1" in (check_policy("qssf", {"quantile": 1.5}) or "")


def test_las_preempts_only_a_job_that_ran_its_minimum_and_starving_jobs_never_preempt() -> None:
    policy = Las(first_queue_gpu_s=100.0, queue_ratio=10.0, min_run_s=300.0, min_starvation_s=50.0)
    state = state_of(node("n1", 1), submit("old", 1, duration=None, command=("x",)), *run("old", "n1", (0,), at=0.0))
    apply(state, 50, submit("new", 1, duration=None, command=("x",)))
    state.now = 200.0  # old attained 200 GPU-s (second queue) but ran under min_run_s
    new, old = state.jobs["new"], state.jobs["old"]
    assert policy.service_queue(old, state) == 1 and not policy.outranks(new, old, state)
    state.now = 400.0
    assert policy.outranks(new, old, state)
    # A job promoted by the starvation guard goes first but takes nobody's GPUs.
    state.jobs["new"].service_gpu_s = 5000.0  # (as if it had run 5000 s before)
    state.now = 30_000.0  # waited more than 4 x 5000 s
    assert policy.queue(new, state) == 0 and policy.starving(new, state)
    assert not policy.outranks(new, old, state)


def test_a_cluster_that_trusts_no_declared_duration_expects_the_predicted_one() -> None:
    from services.scheduler.state import index_problems

    state = state_of(node("n1", 2), submit("a", 1, duration=100), *run("a", "n1", (0,), at=0.0))
    apply(state, 20, ev.JobDurationPredicted(id="pa", at=1.0, job="a", seconds=5000))
    assert state.expected_end(state.jobs["a"]) == 100.0
    apply(state, 21, ev.PolicyConfigured(id="pc", at=2.0, policy="fifo", params={"declared_durations": 0.0}))
    assert state.expected_duration(state.jobs["a"]) == 5000 and state.expected_end(state.jobs["a"]) == 5000.0
    assert index_problems(state) == []  # the running jobs' ends moved with it
    assert check_policy("fifo", {"declared_durations": 0.5}) is not None


@settings(max_examples=200, deadline=None)
@given(
    waiting=st.one_of(st.none(), st.floats(0.0, 1e6)),
    running=st.one_of(st.none(), st.floats(0.0, 1e6)),
    served=st.floats(0.0, 1e6),
    started_at=st.floats(0.0, 1e6),
    now=st.floats(0.0, 2e6),
    status=st.sampled_from(["running", "placed"]),
)
def test_srtf_outranks_exactly_the_running_jobs_with_more_time_left(
    waiting: float | None, running: float | None, served: float, started_at: float, now: float, status: str
) -> None:
    """SRTF's test of running jobs (asked of each at every pass) is its definition, remaining times
    compared, for unknown durations, jobs past their expected end and jobs not started yet alike."""
    state = state_of(node("n1", 4), submit("w", 1, duration=waiting), submit("r", 2, duration=running))
    state.now = now
    job = state.jobs["r"]
    job.status, job.service_gpu_s = status, served  # type: ignore[assignment]
    job.started_at = started_at if status == "running" else None
    srtf, w = POLICIES["srtf"](), state.jobs["w"]
    assert srtf.outranked_by(w, state)(job) == (remaining_s(w, state) < remaining_s(job, state))


# -- SRTF and LAS count an elastic job's work at each of its sizes ------------------------------------
# An elastic job declaring 1000 s on 2 GPUs starts at 0 on 2 GPUs and grows to 4 at t=400: at t=500 it
# has done 400 s + 100 s x 4/2 = 600 s of its work (1200 GPU-s), 400 s are left. Rules 9 counted the
# time since its start on top of the GPU time its resize had already counted (900 s done, 100 left).

GROWN_ELASTIC = ev.Elastic(min=1, max=4, global_batch=16, micro_batch=4)  # sizes 1, 2, 4


def _grown_at_400(rules: int, policy: str = "srtf") -> list[Record]:
    """The elastic job "grown" on n1's 4 GPUs, grown at t=400; at t=500 "short" (1 GPU, 200 s) arrives."""
    spec = ev.JobSpec(name="grown", user="u", gpus=2, duration_s=1000.0, command=("x",), elastic=GROWN_ELASTIC)
    log = drive(
        [
            ev.PolicyConfigured(id="policy", policy=policy, rules=rules),
            node("n1", 4, executor="cpu", ports=(29500, 29599)),
            ev.JobSubmitted(id="sub-grown", at=0.0, job="grown", spec=spec, intake_source="t"),
        ]
    )
    log = drive([ev.JobStarted(id="s-grown", at=0.0, job="grown", attempt=0, node="n1")], log)
    log = drive([ev.RescaleProposed(id="grow", at=400.0, job="grown", attempt=0, generation=0, gpus=4)], log)
    (resized,) = (r.event for r in log if isinstance(r.event, ev.JobResized))
    assert len(resized.allocations[0].gpus) == 4
    completed = ev.RescaleCompleted(
        id="grown-4", at=400.0, job="grown", attempt=0, generation=1, node="n1", world=4, world_before=2
    )
    short = submit("short", 1, at=500.0, duration=200.0, command=("x",))
    return drive([completed, short], log)


def test_srtf_counts_a_resized_elastic_jobs_work_at_each_of_its_sizes() -> None:
    for rules, done in ((ev.SCHEDULING_RULES, 600.0), (9, 900.0)):
        state = folded(_grown_at_400(rules))
        grown = state.jobs["grown"]
        assert state.now == 500.0 and grown.held == 4 and grown.attained_s(500.0) == 600.0
        assert remaining_s(grown, state) == 1000.0 - done, f"rules {rules}"
        short = state.jobs["short"]
        srtf = make_policy("srtf")
        assert srtf.outranked_by(short, state)(grown) == (remaining_s(short, state) < remaining_s(grown, state))


def test_srtf_preempts_a_grown_elastic_job_with_more_left_and_old_logs_audit_as_decided() -> None:
    log = _grown_at_400(ev.SCHEDULING_RULES)
    (preempted,) = (r.event for r in log if isinstance(r.event, ev.JobPreempted))
    assert (preempted.job, preempted.by) == ("grown", "short"), "400 s left of grown's work, 200 s of short's"
    old = _grown_at_400(9)
    assert not any(isinstance(r.event, ev.JobPreempted) for r in old), "rules 9 re-derived as decided"
    for decided in (log, old):
        assert audit(decided, SchedulerDecider()).ok


def test_las_counts_a_resized_elastic_jobs_service_once() -> None:
    state = folded(_grown_at_400(ev.SCHEDULING_RULES, policy="las"))
    grown = state.jobs["grown"]
    assert grown.service_gpu_s + grown.running_gpu_s(state.now) == 2 * 400.0 + 4 * 100.0
    # Just past 1200 GPU-s is the second queue: a double count (1600) would make it the third.
    assert Las(first_queue_gpu_s=1199.0, queue_ratio=1.3).service_queue(grown, state) == 1
