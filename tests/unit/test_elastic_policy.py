"""The elastic service's policy: grow into idle GPUs, shrink for waiting jobs, predicted
throughput per GPU, hysteresis."""

from __future__ import annotations

import math

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.runtime.decider import replay
from services.elastic.decide import ElasticDecider
from services.elastic.policy import ElasticParams, allreduce_s, decide, params_from, predicted_throughput
from services.elastic.state import ElasticState, JobModel, job_model
from tests.unit.test_resize import ELASTIC, SPEC, _completed, _e, _propose, started
from tests.unit.test_scheduler_decider import drive

PARAMS = ElasticParams(min_interval_s=60.0, hold_after_shrink_s=300.0)


def _state(log) -> ElasticState:
    return replay(ElasticDecider(PARAMS), log)


def _at(log, seconds: float):
    """Let time pass: a tick at ``seconds``."""
    tick = ev.ClockTicked(id=f"tick{seconds}", at=seconds, source="t", last_heard={}, lost_after_s=1e15)
    return drive([tick], log)


def _decide(log, rules: int = ev.ELASTIC_RULES, **kw) -> list[ev.RescaleProposed]:
    state = _state(log)
    state.shrunk_at = kw.get("shrunk_at", {})
    state.proposed = kw.get("proposed", {})
    return decide(state, PARAMS, rules)


def test_idle_gpus_grow_a_job_to_the_largest_size_that_keeps_its_global_batch() -> None:
    (proposal,) = _decide(started())  # 2 of n1's GPUs and all of n2's are free; sizes 1, 2, 3
    assert (proposal.job, proposal.gpus, proposal.generation) == ("j", 3, 0)
    assert "idle" in proposal.reason


def test_a_job_is_not_resized_again_within_the_minimum_interval_nor_grown_right_after_a_shrink() -> None:
    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)
    log = _propose(log, 1, generation=1)  # shrunk at t=1000
    log = _completed(log, 2, 1, 3)
    assert _decide(log) == []  # within min_interval_s of the last rescale
    later = _at(log, 1000.0 + PARAMS.min_interval_s + 1)
    # It measured the same throughput at 3 GPUs as at 2: one more GPU gains nothing (rules 2 grow one
    # size at a time, while the marginal gain lasts; rules 1 took the largest size of enough average
    # efficiency).
    assert [p.gpus for p in _decide(later)] == [2]
    assert [p.gpus for p in _decide(later, rules=1)] == [3]
    assert _decide(later, shrunk_at={"j": 1000.0}) == []  # held after a shrink for waiting jobs
    # A proposal the scheduler has not answered yet is not repeated before retry_s.
    assert _decide(later, proposed={"j": (2, later[-1].event.at)}) == []


def test_a_waiting_job_shrinks_the_elastic_job_by_what_it_lacks() -> None:
    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)
    rigid = ev.JobSpec(name="rigid", user="bo", gpus=4, command=("python", "x.py"), nodes=1)
    log = drive([ev.JobSubmitted(id="s2", source="test", job="r", spec=rigid, intake_source="t")], log)
    log = _at(log, 1100.0)
    state = _state(log)
    assert state.jobs["r"].status == "placed"  # n2 was free: it started, nothing to shrink
    other = ev.JobSpec(name="other", user="bo", gpus=2, command=("python", "x.py"))
    log = _at(drive([ev.JobSubmitted(id="s3", source="test", job="o", spec=other, intake_source="t")], log), 1200)
    assert _state(log).jobs["o"].status == "pending"  # n1 has 1 GPU free, it needs 2
    (proposal,) = _decide(log)
    assert (proposal.gpus, proposal.generation) == (2, 1) and "o waits" in proposal.reason


def test_throughput_is_predicted_from_what_was_measured_and_the_gradients_to_all_reduce() -> None:
    state = _state(_completed(_propose(started(), 3), 1, 3, 2, rate=100.0))
    job, measured = state.jobs["j"], state.throughput["j"]
    assert predicted_throughput(job, 2, None, PARAMS, measured) == 100.0  # measured
    assert predicted_throughput(job, 3, None, PARAMS, measured) == 150.0  # no gradients known: linear from there
    moderate = JobModel(grad_bytes=int(4e8))  # all-reduce: a third of the measured step at 2 workers
    compute_2 = 24 / 100 - allreduce_s(int(4e8), 2, PARAMS)
    step_3 = compute_2 * 2 / 3 + allreduce_s(int(4e8), 3, PARAMS)
    assert abs(predicted_throughput(job, 3, moderate, PARAMS, measured) - 24 / step_3) < 1e-9
    assert predicted_throughput(job, 3, moderate, PARAMS, measured) / 3 < 100 / 2  # less per GPU at 3
    # Where the all-reduce outweighs the compute saved, a grow gains nothing: no proposal.
    heavy = JobModel(grad_bytes=int(1e9))
    assert predicted_throughput(job, 3, heavy, PARAMS, measured) < 100
    eager = msgspec.structs.replace(PARAMS, min_interval_s=0)
    state.models = {"j": heavy}
    assert decide(state, eager) == []
    state.models = {"j": moderate}
    assert [p.gpus for p in decide(state, eager)] == []  # at its largest size


def test_a_profile_gives_the_compute_per_sample_before_anything_was_measured() -> None:
    model = job_model({"batch_size": 32, "step_s": 0.064, "layers": [{"grad_bytes": 1000}, {"grad_bytes": 24}]})
    assert model == JobModel(compute_per_sample_s=0.002, grad_bytes=1024)
    assert job_model({"layers": []}) is None
    state = _state(started())
    rate = predicted_throughput(state.jobs["j"], 2, model, PARAMS, {})
    assert abs(rate - 24 / (0.002 * 12 + allreduce_s(1024, 2, PARAMS))) < 1e-6


def test_the_decider_proposes_on_triggers_and_folds_its_own_proposals() -> None:
    decider = ElasticDecider(PARAMS)
    state = decider.initial_state()
    log = started()
    for record in log:
        decider.evolve(state, record.seq, record.event)
    assert [p.gpus for p in decider.decide(state, log[-1].event)] == [3]  # JobStarted is a trigger
    proposal = _e(ev.RescaleProposed, job="j", attempt=0, generation=0, gpus=3, at=state.now)
    decider.evolve(state, log[-1].seq + 1, proposal)
    assert decider.decide(state, log[-1].event) == []  # answered by the scheduler, not proposed twice
    assert decider.decode_state(decider.encode_state(state)) == state
    assert SPEC.elastic == ELASTIC


def test_the_parameters_in_force_are_the_log_s_latest_elastic_configured() -> None:
    decider = ElasticDecider()  # defaults: min_interval_s 60
    state = decider.initial_state()
    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)
    log = _completed(_propose(log, 1, generation=1), 2, 1, 3)
    log = _at(log, 1010.0)  # 10 s after the last rescale
    for record in log:
        decider.evolve(state, record.seq, record.event)
    assert decider.decide(state, log[-1].event) == []  # within the default interval and hold
    configured = _e(ev.ElasticConfigured, params={"min_interval_s": 5.0, "hold_after_shrink_s": 0.0}, at=1010.0)
    decider.evolve(state, log[-1].seq + 1, configured)
    assert decider.params_for(state).min_interval_s == 5.0
    assert [p.gpus for p in decider.decide(state, configured)] == [2]  # (3 measured no faster than 2)
    with pytest.raises(ValueError, match="known parameters"):
        params_from({"min_interval": 5.0})


def test_parameters_it_cannot_apply_are_refused_and_change_nothing() -> None:
    decider = ElasticDecider()
    state = decider.initial_state()
    bad = _e(ev.ElasticConfigured, params={"min_interval": 5.0}, at=1.0)
    decider.evolve(state, 1, bad)
    (refusal,) = decider.decide(state, bad)
    assert isinstance(refusal, ev.CommandRefused) and refusal.command == "ElasticConfigured"
    assert "known parameters" in refusal.reason and state.params is None
    old = msgspec.structs.replace(bad, unchecked=True)  # recorded before commands were checked
    decider.evolve(state, 2, old)
    assert decider.decide(state, old) == [] and decider.params_for(state) == ElasticParams(), "the default, as then"


def test_a_job_is_grown_only_once_it_has_run_grow_after_start_s() -> None:
    settled = msgspec.structs.replace(PARAMS, grow_after_start_s=30.0)
    log = started()  # the job started at t=0
    assert decide(_state(_at(log, 10.0)), settled) == []  # its first generation still forms and trains
    (proposal,) = decide(_state(_at(log, 31.0)), settled)
    assert proposal.gpus == 3
    assert [p.gpus for p in decide(_state(_at(log, 10.0)), PARAMS)] == [3]  # 0, the default: at once


def test_the_rules_in_force_are_the_log_s_recorded_ones_else_those_its_proposals_were_made_by() -> None:
    decider = ElasticDecider()
    state = decider.initial_state()
    assert decider.rules_for(state) == ev.ELASTIC_RULES  # a new log: this service's own
    stored_v1 = b'{"type":"RescaleProposed","v":1,"id":"elastic:9:0","job":"j","attempt":0,"generation":0,"gpus":3}'
    old = ev.decode(stored_v1)
    assert old.rules == 1, "a proposal stored before rules were versioned was made by the first"
    decider.evolve(state, 1, old)
    assert decider.rules_for(state) == 1, "a log of older rules that never recorded them audits by them"
    decider.evolve(state, 2, _e(ev.ElasticConfigured, params={}))
    assert decider.rules_for(state) == ev.ELASTIC_RULES
    decider.evolve(state, 3, old)
    assert decider.rules_for(state) == ev.ELASTIC_RULES, "what the log records wins over what it learned"
    stored_v2 = b'{"type":"ElasticConfigured","v":2,"id":"c","params":{}}'
    assert ev.decode(stored_v2).rules == 1


def test_a_waiting_job_gets_its_shrinks_at_once_whatever_the_minimum_interval() -> None:
    """Rules 2: a shrink for a waiting job does not wait out the interval since the last rescale (a
    rigid job never waits on an elastic job's hysteresis); a grow does."""
    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)  # grew to 3 at t=1000
    rigid = ev.JobSpec(name="rigid", user="bo", gpus=6, command=("python", "x.py"))  # 5 free
    log = _at(drive([ev.JobSubmitted(id="s2", source="test", job="r", spec=rigid, intake_source="t")], log), 1010)
    state = _state(log)
    assert state.jobs["r"].status == "pending" and len(state.jobs["j"].workers) == 3
    (proposal,) = _decide(log)
    assert proposal.gpus < 3 and "r waits" in proposal.reason and proposal.rules == ev.ELASTIC_RULES
    assert _decide(log, rules=1) == [], "rules 1 waited out the interval"


def test_the_timer_is_due_when_a_hold_ends_and_not_before() -> None:
    """The elastic timer ticks when time alone can change a decision: a job's minimum interval
    since its last rescale ends (or a proposal may be retried), never in between."""
    from services.elastic.policy import next_due

    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)  # grew to 3 GPUs at t=1000
    assert next_due(_state(log), PARAMS) is None, "at its largest size: nothing to wait for"
    log = _completed(_propose(_at(log, 1010.0), 2, generation=1), 2, 2, 3)  # shrunk to 2 at t=1010
    state = _state(log)
    # The later of its minimum interval since that rescale and its hold after a shrink.
    assert next_due(state, PARAMS) == 1010.0 + max(PARAMS.min_interval_s, PARAMS.hold_after_shrink_s)
    later = _state(_at(log, 1010.0 + PARAMS.hold_after_shrink_s + 1))
    assert next_due(later, PARAMS) is None, "nothing more waits on time: events decide from here"


def test_a_job_that_is_stopping_is_neither_grown_nor_shrunk() -> None:
    """A cancelled elastic job runs until its parts end: a grow would start workers (and take GPUs)
    for a job that is going away, a shrink would stand it still for GPUs it gives back anyway."""
    log = drive([_e(ev.JobCancelRequested, job="j", reason="enough")], _at(started(), 1000.0))
    job = _state(log).jobs["j"]
    assert job.status == "running" and job.stopping()  # (its parts have not ended yet)
    assert _decide(log) == []
    assert _decide(log, rules=2), "the rules before grew it: a log of them is re-derived as it was decided"
    rigid = ev.JobSpec(name="rigid", user="bo", gpus=8, command=("python", "x.py"))  # 6 free: it waits
    log = _at(drive([ev.JobSubmitted(id="s2", source="test", job="r", spec=rigid, intake_source="t")], log), 1010)
    assert _state(log).jobs["r"].status == "pending"
    assert _decide(log) == []


def test_no_elastic_job_shrinks_for_a_job_its_dependency_or_its_array_s_limit_holds_back() -> None:
    """Rules 4: the scheduler does not start a job whose dependency is not met yet, nor an array's
    element beyond its ``max_running``, whatever GPUs are free. Shrinking for it only stood the
    elastic job still and left the GPUs it gave back idle (kept for the held job) until the hold
    lifted, possibly hours later."""
    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)  # j on 3 of n1's GPUs, 1 free there
    pre = ev.JobSpec(name="pre", user="bo", gpus=4, command=("python", "x.py"))  # takes n2
    after_pre = ev.JobSpec(
        name="post", user="bo", gpus=2, command=("python", "x.py"), depends_on=ev.Dependencies(afterok=("pre",))
    )
    log = drive(
        [
            ev.JobSubmitted(id="s-pre", source="test", job="pre", spec=pre, intake_source="t"),
            ev.JobSubmitted(id="s-post", source="test", job="post", spec=after_pre, intake_source="t"),
        ],
        log,
    )
    log = _at(log, 1100.0)
    assert _state(log).jobs["post"].status == "pending" and _state(log).jobs["pre"].status in ("placed", "running")
    assert _decide(log) == [], "post cannot start before pre completes: nothing to shrink for"
    (old,) = _decide(log, rules=3)
    assert old.gpus == 2 and "post waits" in old.reason, "a log of the rules before is re-derived as decided"

    # An array element beyond the array's max_running is held the same way.
    member = ev.ArrayMember(array="sweep", index=1, size=2, max_running=1)
    running = ev.JobSpec(
        name="sweep", user="bo", gpus=1, command=("python", "x.py"), array_of=msgspec.structs.replace(member, index=0)
    )
    held = msgspec.structs.replace(running, gpus=2, array_of=member)
    fill = msgspec.structs.replace(pre, gpus=3)  # n2 keeps 1 free GPU, n1 1: sweep_1 lacks one
    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)
    log = drive(
        [
            ev.JobSubmitted(id="s-fill", source="test", job="fill", spec=fill, intake_source="t"),
            ev.JobSubmitted(id="s-0", source="test", job="sweep_0", spec=running, intake_source="t"),
            ev.JobSubmitted(id="s-1", source="test", job="sweep_1", spec=held, intake_source="t"),
        ],
        log,
    )
    log = _at(log, 1100.0)
    state = _state(log)
    assert state.jobs["sweep_0"].status != "pending" and state.jobs["sweep_1"].status == "pending"
    assert _decide(log) == []
    assert [p.gpus for p in _decide(log, rules=3)] == [2]


def test_the_timer_is_due_when_a_hold_ends_while_a_job_waits_that_idle_gpus_cannot_help() -> None:
    """Rules 2 lend GPUs no waiting job can use even while jobs wait: the timer must still tick when
    a job's hold ends, or the job stayed small beside idle GPUs until some unrelated event came."""
    from services.elastic import spec as elastic_spec
    from services.elastic.policy import next_due

    log = _completed(_propose(_at(started(), 1000.0), 3), 1, 3, 2)  # grew to 3 GPUs at t=1000
    log = _completed(_propose(_at(log, 1010.0), 2, generation=1), 2, 2, 3, rate=150.0)  # shrunk to 2: 3 was faster
    team = _e(ev.VcConfigured, vc="team", gpu_quota=1, can_borrow=False)
    small = ev.JobSpec(name="small", user="bo", gpus=1, command=("python", "x.py"), vc="team")
    log = drive(
        [
            team,
            ev.JobSubmitted(id="s-a", source="test", job="a", spec=small, intake_source="t"),
            ev.JobSubmitted(id="s-b", source="test", job="b", spec=small, intake_source="t"),
        ],
        log,
    )
    state = _state(log)
    assert state.queue == ["b"], "b waits for its VC's quota, which a's GPU fills"
    ends = 1010.0 + max(PARAMS.min_interval_s, PARAMS.hold_after_shrink_s)
    assert next_due(state, PARAMS) == ends
    assert elastic_spec.SPEC.timer.due(state) == ends, "the service's timer, by the rules in force"  # type: ignore[union-attr]
    (grow,) = decide(_state(_at(log, ends)), PARAMS)
    assert grow.gpus == 3 and "idle" in grow.reason


def test_an_all_reduce_bandwidth_that_is_not_positive_is_refused_instead_of_crashing_the_service() -> None:
    """``gpuherd elastic set --param bandwidth_bytes_per_s=0`` was applied, and the first decision
    on a job with gradients divided by it: the service crashed on it at every restart."""
    decider = ElasticDecider()
    state = _state(started())
    state.models = {"j": JobModel(compute_per_sample_s=0.002, grad_bytes=int(1e8))}
    for bad in ({"bandwidth_bytes_per_s": 0.0}, {"bandwidth_bytes_per_s": -1e9}, {"latency_s": -1.0}):
        command = _e(ev.ElasticConfigured, params=bad, at=state.now)
        decider.evolve(state, state.seq + 1, command)
        (refusal,) = decider.decide(state, command)
        assert isinstance(refusal, ev.CommandRefused) and next(iter(bad)) in refusal.reason, refusal.reason
        assert state.params is None
    with pytest.raises(ValueError, match="finite"):
        params_from({"min_interval_s": math.inf})  # (the log's JSON cannot even hold it)


def test_a_proposal_or_a_profile_folded_after_its_job_ended_leaves_nothing_behind() -> None:
    """A proposal decided before the job's end can be appended after it (the scheduler appended
    the end meanwhile), and a profile can be relayed late: the service kept an entry for the
    ended job forever, in its state and every snapshot."""
    decider = ElasticDecider()
    log = drive([_e(ev.JobFinished, job="j", attempt=0, outcome="completed", at=50.0)], started())
    state = _state(log)
    assert "j" not in state.jobs
    late = [
        _e(ev.RescaleProposed, job="j", attempt=0, generation=0, gpus=3, at=50.0),
        _e(
            ev.ProfileReported,
            job="j",
            attempt=0,
            node="n1",
            rank=0,
            profile={"batch_size": 32, "step_s": 0.064, "layers": [{"grad_bytes": 1024}]},
            at=50.0,
        ),
    ]
    for event in late:
        decider.evolve(state, state.seq + 1, event)
    assert state.proposed == {} and state.models == {}
