"""Workflows, arrays, dependencies, time limits and per-user limits: judged by intake, decided by the
scheduler from its fold, carried out by the simulated agents on a virtual clock, and audited.

The simulations run the production deciders (``apps.sim.run.make_deciders``) and the agents' own
reconcile step, so what they show is what a live cluster does (``tests/e2e/test_workflows_e2e.py``
runs the same on real processes)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from apps.sim.engine import Simulation
from apps.sim.run import make_deciders
from gpuherd import events as ev
from gpuherd.fold.invariants import violations
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission, job_id_for, judge, recheck, workflow_id_for
from services.scheduler.state import SchedulerState, index_problems
from tests.helpers import node

_scheduler = SchedulerDecider()
SOURCE = "ci"


def cluster(*vcs: ev.VcConfigured, gpus: int = 4, nodes: int = 2) -> SchedulerState:
    state = _scheduler.initial_state()
    for seq, e in enumerate([*(node(f"n{i}", gpus) for i in range(nodes)), *vcs], 1):
        _scheduler.evolve(state, seq, e)
    return state


def submission(data: dict[str, Any], *, seq: int = 1, at: float = 1.0, source: str = SOURCE) -> Submission:
    return Submission(source=source, seq=seq, data=msgspec.json.encode(data), at=at)


def job(name: str, *, duration: float = 10.0, gpus: int = 1, **more: Any) -> dict[str, Any]:
    return {"name": name, "user": "ana", "gpus": gpus, "duration_s": duration, **more}


def pipeline(**more: Any) -> dict[str, Any]:
    return {
        "workflow": "pipe",
        "user": "ana",
        "intake_id": "pipe-1",
        "steps": [
            {"name": "prep", "gpus": 1, "duration_s": 10},
            {"name": "train", "gpus": 2, "duration_s": 30, "depends_on": {"afterok": ["prep"]}},
            {"name": "eval", "gpus": 1, "duration_s": 5, "depends_on": {"afterok": ["train"]}},
        ],
        **more,
    }


# -- intake ---------------------------------------------------------------------------------------------


def test_a_workflow_is_accepted_as_a_whole_with_one_answer_listing_its_steps() -> None:
    verdict = judge(cluster(), submission(pipeline()))
    workflow = workflow_id_for(SOURCE, "pipe-1")
    events = verdict.events()
    assert [type(e) for e in events] == [ev.JobSubmitted] * 3
    assert [e.job for e in events] == [f"{workflow}-prep", f"{workflow}-train", f"{workflow}-eval"]  # type: ignore[attr-defined]
    train = events[1].spec  # type: ignore[attr-defined]
    assert train.depends_on == ev.Dependencies(afterok=(f"{workflow}-prep",)), "step names resolve to job ids"
    assert train.workflow_of == ev.WorkflowMember(workflow=workflow, name="pipe", step="train")
    assert {e.intake_seq for e in events} == {1} and len({e.id for e in events}) == 3  # type: ignore[attr-defined]
    answer = msgspec.json.decode(verdict.reply())
    assert answer["ok"] and answer["workflow"] == answer["job_id"] == workflow
    assert answer["steps"] == {s: [f"{workflow}-{s}"] for s in ("prep", "train", "eval")}
    assert answer["job_ids"] == [e.job for e in events]  # type: ignore[attr-defined]


def test_an_array_makes_one_job_per_element_with_its_index_and_value_in_the_environment() -> None:
    verdict = judge(
        cluster(), submission(job("sweep", array={"values": [0.1, "b", 3], "max_running": 2}, intake_id="s"))
    )
    array = job_id_for(SOURCE, "s")
    elements = verdict.events()
    assert [e.job for e in elements] == [f"{array}_{i}" for i in range(3)]  # type: ignore[attr-defined]
    specs = [e.spec for e in elements]  # type: ignore[attr-defined]
    assert [s.name for s in specs] == ["sweep[0]", "sweep[1]", "sweep[2]"]
    assert [s.env["GPUHERD_ARRAY_VALUE"] for s in specs] == ["0.1", "b", "3"]
    assert [s.env["GPUHERD_ARRAY_INDEX"] for s in specs] == ["0", "1", "2"]
    assert all(s.array is None and s.array_of.max_running == 2 and s.array_of.size == 3 for s in specs)
    assert msgspec.json.decode(verdict.reply())["array"] == array


REFUSED = [
    (
        pipeline(steps=[{"name": "a", "gpus": 1, "duration_s": 1, "depends_on": {"afterok": ["nope"]}}]),
        "'nope', which is no job",
    ),
    (
        pipeline(
            steps=[
                {"name": "a", "gpus": 1, "duration_s": 1, "depends_on": {"afterok": ["c"]}},
                {"name": "b", "gpus": 1, "duration_s": 1, "depends_on": {"afterany": ["a"]}},
                {"name": "c", "gpus": 1, "duration_s": 1, "depends_on": {"after": ["b"]}},
            ]
        ),
        "form a cycle (a -> c -> b -> a)",
    ),
    (
        pipeline(steps=[{"name": "a", "gpus": 1, "duration_s": 1, "depends_on": {"afterok": ["a"]}}]),
        "cannot depend on itself",
    ),
    (
        pipeline(steps=[{"name": "a", "gpus": 1, "duration_s": 1}, {"name": "a", "gpus": 1, "duration_s": 1}]),
        "two steps",
    ),
    (pipeline(steps=[{"name": "a", "gpus": 99, "duration_s": 1}]), "step a: asks for 99 GPUs"),
    (pipeline(steps=[]), "a non-empty list"),
    (pipeline(depends_on={"afterok": ["x"]}), "`depends_on` is given per step"),
    (job("big", array={"count": 1001}), "this one has 1001 (too large)"),
    (job("none", array={"count": 0}), "`array.count` must be at least 1, got 0"),
    (job("negative", array={"count": -3}), "`array.count` must be at least 1, got -3"),
    (job("no-values", array={"values": []}), "`array.values` must hold at least one value"),
    (job("both", array={"count": 2, "values": [1]}), "either `count`"),
    (job("x", array={"count": 2, "max_running": 0}), "`array.max_running` must be at least 1"),
    (job("x", depends_on={"afterok": ["j-unknown"]}), "'j-unknown', which is no job"),
    (job("x", array_of={"array": "a", "index": 0, "size": 1}), "set by gpuherd"),
    (job("x", time_limit_s=0), "`time_limit_s` must be a positive number"),
    (job("x", vc="short", time_limit_s=7200), "above VC short's maximum of 3600s"),
    (job("x", vc="short", gpus=3), "allows 2 per user, so it could never start"),
    (job("x", env={"GPUHERD_ARRAY_INDEX": "1"}), "not set by gpuherd itself (GPUHERD_ARRAY_INDEX)"),
    (job("x", depends_on={"afterok": ["a"], "sometimes": ["b"]}), "unknown field `sometimes`"),
]


@pytest.mark.parametrize(("data", "reason"), REFUSED, ids=[r for _, r in REFUSED])
def test_bad_input_is_refused_with_a_clear_reason_and_recorded(data: dict[str, Any], reason: str) -> None:
    short = ev.VcConfigured(id="vc", vc="short", max_time_limit_s=3600, max_gpus_per_user=2)
    state = cluster(short)
    verdict = judge(state, submission(data))
    (rejected,) = verdict.events()
    assert isinstance(rejected, ev.JobRejected) and reason in rejected.reason, rejected
    assert rejected.payload_excerpt and recheck(state, rejected) is None, "the audit re-judges it the same"


def test_an_empty_array_refused_by_the_rules_before_keeps_its_reason_in_the_audit() -> None:
    state = cluster()
    rejected = judge(state, submission(job("x", array={"count": 0}))).event
    assert isinstance(rejected, ev.JobRejected) and rejected.intake_rules == ev.INTAKE_RULES
    before = "an array has 1 to 1000 elements; this one has 0 (too large)"
    assert recheck(state, msgspec.structs.replace(rejected, intake_rules=5, reason=before)) is None
    assert "another reason" in (recheck(state, msgspec.structs.replace(rejected, intake_rules=5)) or "")


def test_a_resubmitted_workflow_is_the_same_workflow_and_appends_nothing() -> None:
    state = cluster()
    first = judge(state, submission(pipeline()))
    for seq, e in enumerate(first.events(), state.seq + 1):
        _scheduler.evolve(state, seq, e)
        assert recheck(state, e) is not None, "once folded, the same intake id is a duplicate"
    again = judge(state, submission(pipeline(), seq=2))
    assert again.duplicate and again.events() == [] and again.job_ids() == first.job_ids()


def test_every_job_of_an_accepted_workflow_rechecks_on_the_state_it_was_judged_on() -> None:
    state = cluster(ev.VcConfigured(id="vc", vc="default", default_time_limit_s=600))
    verdict = judge(state, submission(pipeline()))
    assert all(recheck(state, e) is None for e in verdict.events())  # type: ignore[arg-type]
    assert all(e.spec.time_limit_s == 600 for e in verdict.events()), "the VC's default time limit is filled in"  # type: ignore[attr-defined]


# -- simulations -----------------------------------------------------------------------------------------


def simulate(
    arrivals: Sequence[tuple[float, dict[str, Any]]],
    *setup: ev.Event,
    nodes: int = 2,
    gpus: int = 4,
    until: float | None = None,
) -> Simulation:
    deciders, timers = make_deciders("fifo", predict=False)
    sim = Simulation(deciders, timers=timers)
    sim.setup([*(node(f"n{i}", gpus) for i in range(nodes)), *setup, ev.PolicyConfigured(policy="fifo")])
    subs = [submission(data, seq=n, at=at) for n, (at, data) in enumerate(arrivals, 1)]
    sim.run(subs, until=until)
    return sim


def by_type(sim: Simulation, kind: type[ev.Event]) -> list[Any]:
    return [r.event for r in sim.records if isinstance(r.event, kind)]


def intervals(sim: Simulation) -> dict[str, tuple[float, float]]:
    """Each job's first placement and its end."""
    placed = {e.job: e.at for e in reversed(by_type(sim, ev.JobPlaced))}
    return {e.job: (placed.get(e.job, e.at), e.at) for e in by_type(sim, ev.JobFinished)}


def assert_clean(sim: Simulation) -> None:
    records = list(sim.records)
    report = audit(records, SchedulerDecider())
    assert report.ok, report.mismatches[:3]
    assert violations(records) == []
    assert index_problems(sim.state_of("scheduler")) == []


def test_a_workflow_runs_its_steps_in_order() -> None:
    sim = simulate([(1.0, pipeline())])
    wf = workflow_id_for(SOURCE, "pipe-1")
    spans = intervals(sim)
    assert spans[f"{wf}-prep"][1] <= spans[f"{wf}-train"][0] and spans[f"{wf}-train"][1] <= spans[f"{wf}-eval"][0]
    assert {e.outcome for e in by_type(sim, ev.JobFinished)} == {"completed"}
    assert_clean(sim)


def test_an_array_never_runs_more_elements_than_max_running() -> None:
    sim = simulate([(1.0, job("sweep", duration=20, array={"count": 8, "max_running": 2}))])
    spans = sorted(intervals(sim).values())
    assert len(spans) == 8
    for t, _ in spans:
        assert sum(1 for start, end in spans if start <= t < end) <= 2
    assert spans[-1][1] == pytest.approx(1.0 + 4 * 20), "two at a time, back to back"
    assert_clean(sim)


def test_a_job_past_its_time_limit_is_stopped_and_ends_as_timeout_and_its_dependants_are_cancelled() -> None:
    long = job("long", duration=1000, time_limit_s=50, intake_id="long")
    long_id = job_id_for(SOURCE, "long")
    after_ok = job("next", depends_on={"afterok": [long_id]}, intake_id="next")
    kept = job("kept", depends_on={"afterok": [long_id]}, kill_on_invalid_dep=False, intake_id="kept")
    on_failure = job("cleanup", depends_on={"afternotok": [long_id]}, intake_id="cleanup")
    sim = simulate([(1.0, long), (2.0, after_ok), (2.0, kept), (2.0, on_failure)], until=500.0)
    finished = {e.job: e for e in by_type(sim, ev.JobFinished)}
    (limit,) = by_type(sim, ev.JobTimeLimitReached)
    assert limit.at == pytest.approx(51.0), "the timer ticks at the deadline, not at its next period"
    assert finished[long_id].outcome == "timeout" and finished[long_id].at == pytest.approx(51.0)
    assert "time limit of 50s reached" in finished[long_id].reason
    cancelled = finished[job_id_for(SOURCE, "next")]
    assert cancelled.outcome == "cancelled" and f"afterok:{long_id} can never be met" in cancelled.reason
    assert finished[job_id_for(SOURCE, "cleanup")].outcome == "completed"
    assert job_id_for(SOURCE, "kept") not in finished, "kill_on_invalid_dep false: it waits until cancelled"
    state = sim.state_of("scheduler")
    why = SchedulerDecider().plan(state).pending[job_id_for(SOURCE, "kept")]
    assert why.kind == "dependency" and "waits until cancelled" in why.detail
    sim.step(600.0, [ev.JobCancelRequested(id="c", at=600.0, source="op", job=job_id_for(SOURCE, "kept"))])
    assert by_type(sim, ev.JobFinished)[-1].reason == "cancelled while waiting"
    ended = [e for e in by_type(sim, ev.TaskEnded) if e.job == long_id]
    assert ended and all(e.outcome == "stopped" and "time limit" in e.reason for e in ended)
    assert_clean(sim)


def test_per_user_limits_hold_a_users_jobs_back_but_not_another_users() -> None:
    vc = ev.VcConfigured(vc="lab", max_running_per_user=1, max_gpus_per_user=2)
    jobs = [(1.0, job(f"ana-{i}", vc="lab", duration=10)) for i in range(3)]
    jobs += [(1.0, job("ben-0", vc="lab", duration=10) | {"user": "ben"})]
    sim = simulate(jobs, vc)
    spans = intervals(sim)
    ana = sorted(v for k, v in spans.items() if k in {job_id_for(SOURCE, f"seq-{n}") for n in (1, 2, 3)})
    assert [round(start) for start, _ in ana] == [1, 11, 21], "one at a time"
    assert spans[job_id_for(SOURCE, "seq-4")][0] == pytest.approx(1.0), "another user is not held back"
    assert_clean(sim)


def test_why_says_what_holds_a_job_back() -> None:
    state = cluster(ev.VcConfigured(id="vc", vc="lab", max_running_per_user=1))
    seq = state.seq
    for data in (job("a", duration=100, intake_id="a", vc="lab"), job("b", intake_id="b", vc="lab")):
        for e in judge(state, submission(data, seq=seq)).events():
            seq += 1
            _scheduler.evolve(state, seq, e)
    first = SchedulerDecider().decide(state, ev.ClockTicked(id="t", at=2.0, source="scheduler"))
    assert [type(e) for e in first] == [ev.JobPlaced]
    for e in first:
        seq += 1
        _scheduler.evolve(state, seq, e)
    wf = judge(state, submission(pipeline(), seq=9)).events()
    for e in wf:
        seq += 1
        _scheduler.evolve(state, seq, e)
    pending = SchedulerDecider().plan(state).pending
    assert pending[job_id_for(SOURCE, "b")].kind == "user limit"
    assert "user ana has 1 jobs placed or running in VC lab" in pending[job_id_for(SOURCE, "b")].detail
    train = pending[wf[1].job]  # type: ignore[attr-defined]
    assert train.kind == "dependency" and train.detail.startswith(f"waits for afterok:{wf[0].job} (pending)")  # type: ignore[attr-defined]


def test_a_time_limit_bounds_the_forecast_of_who_waits_behind_a_job_of_unknown_duration() -> None:
    from services.scheduler.forecast import forecast_starts
    from services.scheduler.policy import Fifo

    state = _scheduler.initial_state()
    _scheduler.evolve(state, 1, node("n0", 2, executor="cpu", ports=(29500, 29600)))
    seq = state.seq
    for n, data in enumerate(
        (
            {"name": "a", "user": "u", "gpus": 2, "command": ["x"], "time_limit_s": 100},
            {"name": "b", "user": "u", "gpus": 2, "command": ["x"]},
        )
    ):
        for e in judge(state, submission(data, seq=n, at=0.0)).events():
            seq += 1
            _scheduler.evolve(state, seq, e)
    placed = plan_and_fold(state)
    assert len(placed) == 1
    started = ev.JobStarted(id="s", at=10.0, job=placed[0].job, attempt=0, node="n0")
    _scheduler.evolve(state, state.seq + 1, started)
    waiting = state.queue[0]
    assert forecast_starts(state, Fifo())[waiting] == pytest.approx(110.0)


def plan_and_fold(state: SchedulerState) -> list[ev.JobPlaced]:
    placed = SchedulerDecider().plan(state).placed
    for e in placed:
        _scheduler.evolve(state, state.seq + 1, e)
    return placed


def test_an_old_shaped_submission_and_vc_decode_with_the_new_fields_at_their_defaults() -> None:
    old_vc = b'{"type":"VcConfigured","id":"v","at":1.0,"source":"cli","v":2,"vc":"lab","gpu_quota":4}'
    vc = ev.decode(old_vc)
    assert isinstance(vc, ev.VcConfigured) and vc.v == 3 and vc.max_time_limit_s is None and not vc.unchecked
    spec = {"name": "a", "user": "b", "gpus": 1, "duration_s": 1.0}
    old = msgspec.json.encode(
        {"type": "JobSubmitted", "id": "s", "v": 2, "job": "j", "spec": spec, "intake_source": "cli", "intake_rules": 2}
    )
    submitted = ev.decode(old)
    assert isinstance(submitted, ev.JobSubmitted) and submitted.v == 3 and submitted.spec.depends_on is None


def test_records_of_a_simulation_replay_to_the_same_state() -> None:
    sim = simulate([(1.0, pipeline()), (1.0, job("sweep", duration=5, array={"count": 4, "max_running": 1}))])
    again = SchedulerDecider()
    state = again.initial_state()
    for record in sim.records:
        state = again.evolve(state, record.seq, record.event)
    assert msgspec.msgpack.encode(state) == msgspec.msgpack.encode(sim.state_of("scheduler"))
    assert isinstance(sim.records[0], Record)


@pytest.mark.parametrize(("limit", "grows"), [(2, False), (4, True)])
def test_an_elastic_job_grows_only_within_its_users_gpu_limit(limit: int, grows: bool) -> None:
    from services.scheduler.resize import on_proposal

    state = cluster(ev.VcConfigured(id="vc", vc="lab", max_gpus_per_user=limit), nodes=1, gpus=8)
    spec = job("elastic", gpus=2, vc="lab", duration=100, elastic={"min": 1, "max": 4}, intake_id="e")
    for e in judge(state, submission(spec)).events():
        _scheduler.evolve(state, state.seq + 1, e)
    (placed,) = plan_and_fold(state)
    _scheduler.evolve(state, state.seq + 1, ev.JobStarted(id="s", at=2.0, job=placed.job, attempt=0, node="n0"))
    proposal = ev.RescaleProposed(id="p", job=placed.job, attempt=0, generation=0, gpus=4, reason="idle GPUs")
    assert bool(on_proposal(state, proposal)) is grows


def test_outcomes_are_forgotten_oldest_first_except_those_a_waiting_job_names_also_after_a_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.scheduler import state as scheduler_state

    monkeypatch.setattr(scheduler_state, "OUTCOMES_KEPT", 3)
    state = _scheduler.initial_state()
    state.dependants["j1"] = {"waiting": None}  # a waiting job names j1: it is kept, whatever its age
    for n in range(1, 6):
        scheduler_state._ended(state, f"j{n}", "completed", float(n))
    assert list(state.outcomes) == ["j4", "j1", "j5"], "the oldest went; j1 moved to the young end when due"
    restored = _scheduler.decode_state(_scheduler.encode_state(state))
    assert restored == state and list(restored.outcomes) == list(state.outcomes)
    assert isinstance(restored.outcomes, OrderedDict), "decoded ordered again (a dict scans its holes: slow)"
    for kept in (state, restored):  # the snapshot forgets exactly as the state it was taken of
        scheduler_state._ended(kept, "j6", "failed", 6.0)
        assert list(kept.outcomes) == ["j1", "j5", "j6"]
    scheduler_state._ended(state, "j7", "completed", 7.0 + scheduler_state.OUTCOMES_KEPT_S)
    assert list(state.outcomes) == ["j7", "j1"], "older than OUTCOMES_KEPT_S: forgotten, however few"
