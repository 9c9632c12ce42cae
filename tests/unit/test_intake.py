import msgspec
import pytest

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import MAX_SUBMISSION_BYTES, Submission, job_id_for, judge, recheck
from services.scheduler.state import SchedulerState
from tests.helpers import node

_scheduler = SchedulerDecider()


def apply(state: SchedulerState, seq: int, event: ev.Event) -> SchedulerState:
    return _scheduler.evolve(state, seq, event)


def cluster() -> SchedulerState:
    state = _scheduler.initial_state()
    for seq, e in enumerate([node("n1", 8), node("n2", 8), ev.VcConfigured(id="vc", vc="vision")], 1):
        apply(state, seq, e)
    return state


def verdict(
    data: bytes | dict, state: SchedulerState | None = None, *, source: str = "teamA", seq: int = 7, msg_id=None
):
    raw = data if isinstance(data, bytes) else msgspec.json.encode(data)
    return judge(state or cluster(), Submission(source=source, seq=seq, data=raw, at=5.0, msg_id=msg_id))


GOOD = {"name": "resnet", "user": "ana", "gpus": 4, "duration_s": 60}
CMD = {"name": "train", "user": "ana", "gpus": 1, "command": ["python", "train.py"]}


def test_valid_spec_becomes_job_submitted() -> None:
    v = verdict(GOOD | {"intake_id": "abc"})
    assert isinstance(v.event, ev.JobSubmitted)
    assert v.event.job == v.job_id == job_id_for("teamA", "abc")
    assert v.event.spec.vc == "default" and v.event.spec.gpus == 4
    assert v.event.id == "scheduler:intake:teamA:abc" and v.event.cause == "intake:teamA:7"
    assert v.event.based_on == 3 and v.event.subject() == f"herd.job.{v.job_id}"
    assert msgspec.json.decode(v.reply()) == {"ok": True, "job_id": v.job_id, "duplicate": False}


def test_default_intake_id_is_the_message_id_else_the_sequence() -> None:
    assert verdict(GOOD, msg_id="m-1").event.spec.intake_id == "m-1"
    assert verdict(GOOD, seq=42).event.spec.intake_id == "seq-42"


def test_same_intake_id_twice_is_one_job() -> None:
    state = cluster()
    first = verdict(GOOD | {"intake_id": "x"}, state)
    apply(state, 4, first.event)
    again = verdict(GOOD | {"intake_id": "x"}, state, seq=8)
    assert again.duplicate and again.job_id == first.job_id
    changed = verdict(GOOD | {"intake_id": "x", "name": "changed"}, state, seq=9).event
    assert isinstance(changed, ev.JobRejected) and "used by an earlier submission with another spec" in changed.reason
    other_source = verdict(GOOD | {"intake_id": "x"}, state, source="teamB")
    assert not other_source.duplicate and other_source.job_id != first.job_id


BAD = [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "invalid job spec: Expected `object`"),
    ({"name": "x", "user": "u", "gpus": "four", "duration_s": 1}, "Expected `int`, got `str` - at `$.gpus`"),
    ({"name": "x", "gpus": 1, "duration_s": 1}, "missing required field `user`"),
    (GOOD | {"gpu": 1}, "unknown field `gpu`"),
    (GOOD | {"gpus": 0}, "`gpus` must be at least 1, got 0"),
    (GOOD | {"memory": {"extra_mb": 0}}, "`memory.extra_mb` must be positive"),
    (GOOD | {"memory": {"extra_mb": 100, "min_mb": 200}}, "`memory.min_mb` must lie within 0..extra_mb (100)"),
    (GOOD | {"memory": {"extra_mb": 100, "tiers": []}}, "`memory.tiers` must name each accepted tier once"),
    (GOOD | {"memory": {"extra_mb": 100, "tiers": ["disk"]}}, "Invalid enum value 'disk' - at `$.memory.tiers[0]`"),
    (GOOD | {"gpus": -2}, "`gpus` must be at least 1, got -2"),
    (GOOD | {"gpus": 17}, "asks for 17 GPUs but the whole cluster has 16 (2 nodes)"),
    (GOOD | {"vc": "nlp"}, "unknown virtual cluster 'nlp'; known: default, vision"),
    (GOOD | {"nodes": 3}, "`gpus` (4) must divide evenly over `nodes` (3)"),
    (GOOD | {"gpus": 12, "nodes": 1}, "asks for 12 GPUs per node but the largest node has 8"),
    (GOOD | {"nodes": 4}, "asks for 4 nodes but the cluster has 2"),
    ({"name": "x", "user": "u", "gpus": 1}, "give `command`"),
    (GOOD | {"duration_s": 0}, "`duration_s` must be positive"),
    (GOOD | {"command": []}, "`command` must be a non-empty list"),
    (GOOD | {"name": " "}, "`name` must not be empty"),
    (GOOD | {"elastic": {"min": 4, "max": 2}}, "`elastic` needs 1 <= min <= max"),
    (GOOD | {"elastic": {"min": 1, "max": 2}}, "must lie within elastic min..max"),
    (GOOD | {"elastic": {"min": 1, "max": 10**12}}, "`elastic.max` (1000000000000) is more GPUs than any job may take"),
    (GOOD | {"intake_id": "has space"}, "`intake_id` must be 1-128 characters"),
    (GOOD | {"priority": True}, "Expected `int`, got `bool`"),
    (CMD, "no registered node can run this job (a `command` needs a cpu or nvml agent)"),
    (GOOD | {"max_retries": -1}, "`max_retries` must be between 0 and 100"),
    (GOOD | {"procs_per_node": 2}, "`procs_per_node` needs a `command`"),
    (CMD | {"env": {"RANK": "3"}}, "not set by gpuherd itself (RANK)"),
    (CMD | {"env": {"1BAD": "x"}}, "`env` names must be identifiers"),
    (GOOD | {"workdir": " "}, "`workdir` must not be empty"),
]


@pytest.mark.parametrize(("data", "reason"), BAD, ids=[r for _, r in BAD])
def test_bad_input_is_rejected_with_a_reason(data, reason) -> None:
    v = verdict(data)
    assert isinstance(v.event, ev.JobRejected)
    assert reason in v.event.reason
    assert v.event.id == "scheduler:rejected:teamA:7" and v.event.intake_seq == 7
    assert v.event.payload_excerpt, "the submission is recorded with its rejection"
    assert msgspec.json.decode(v.reply()) == {"ok": False, "error": v.event.reason}


def test_oversized_payload_is_rejected() -> None:
    big = msgspec.json.encode(GOOD | {"name": "x" * MAX_SUBMISSION_BYTES})
    v = verdict(big)
    assert isinstance(v.event, ev.JobRejected)
    assert f"the limit is {MAX_SUBMISSION_BYTES} bytes" in v.event.reason
    assert len(v.event.payload_excerpt) <= 256


def test_no_nodes_yet_is_an_actionable_rejection() -> None:
    v = verdict(GOOD, SchedulerState())
    assert "no GPU nodes have registered yet" in v.event.reason


def test_bad_source_token() -> None:
    v = verdict(GOOD, source="a.b")
    assert isinstance(v.event, ev.JobRejected) and "herd.intake.<source>" in v.event.reason
    assert "the source 'a.b' (from the subject herd.intake.a.b) is not one" in v.event.reason
    assert v.event.subject() == "herd.rejected._invalid"
    # The audit gives the same verdict again (judged under the recorded `_invalid`, a valid source, it
    # once said "would now be accepted"), also of a rejection by the rules before 11, which did not
    # name the source.
    assert recheck(cluster(), v.event) is None
    before = msgspec.structs.replace(v.event, intake_rules=10, reason=v.event.reason.split(": ", 1)[1])
    assert before.reason.startswith("publish to herd.intake.<source>")
    assert recheck(cluster(), before) is None
    assert recheck(cluster(), msgspec.structs.replace(before, intake_rules=11)) is not None  # not rules 11's reason
    # A system may name itself `_invalid` (it matches the pattern): its submissions are judged as any.
    assert isinstance(verdict(GOOD, source="_invalid").event, ev.JobSubmitted)


def test_a_command_job_is_judged_against_the_nodes_that_run_processes() -> None:
    state = cluster()
    apply(state, 4, node("cpu1", 4, executor="cpu", ports=(29500, 29599)))
    assert isinstance(verdict(CMD | {"gpus": 4}, state).event, ev.JobSubmitted)
    too_big = verdict(CMD | {"gpus": 5}, state).event
    assert isinstance(too_big, ev.JobRejected)
    assert too_big.reason == "asks for 5 GPUs but the nodes that can run it have 4 (1 nodes)"


def test_a_job_larger_than_its_vc_quota_that_may_not_borrow_is_refused_as_it_could_never_start() -> None:
    state = cluster()
    apply(state, 4, ev.VcConfigured(id="small", vc="small", gpu_quota=4, can_borrow=False))
    v = verdict(GOOD | {"vc": "small", "gpus": 8}, state)
    assert isinstance(v.event, ev.JobRejected)
    assert "quota of 4 and may not borrow" in v.event.reason and "could never start" in v.event.reason
    assert isinstance(verdict(GOOD | {"vc": "small", "gpus": 4}, state).event, ev.JobSubmitted)
    apply(state, 5, ev.VcConfigured(id="lend", vc="small", gpu_quota=4, can_borrow=True))
    assert isinstance(verdict(GOOD | {"vc": "small", "gpus": 8}, state).event, ev.JobSubmitted), "it may borrow"


def test_recorded_verdicts_are_judged_again_by_the_rules_they_were_judged_by() -> None:
    state = cluster()
    apply(state, 4, ev.VcConfigured(id="small", vc="small", gpu_quota=4, can_borrow=False))
    accepted = verdict(GOOD | {"intake_id": "a"}, state).event
    assert recheck(state, accepted) is None
    big = msgspec.structs.replace(accepted, spec=msgspec.structs.replace(accepted.spec, vc="small", gpus=8))
    assert "would now be rejected" in recheck(state, big)
    assert recheck(state, msgspec.structs.replace(big, intake_rules=1)) is None, "accepted by the first rules"
    unbounded = msgspec.structs.replace(accepted.spec, elastic=ev.Elastic(min=1, max=10**12))
    assert "would now be rejected" in recheck(state, msgspec.structs.replace(accepted, spec=unbounded))
    assert recheck(state, msgspec.structs.replace(accepted, spec=unbounded, intake_rules=3)) is None
    apply(state, 5, accepted)
    assert "taken already" in recheck(state, accepted)
    rejected = verdict(b"not json", state).event
    assert isinstance(rejected, ev.JobRejected) and recheck(state, rejected) is None
    forged = msgspec.structs.replace(rejected, reason="too many GPUs")
    assert "another reason" in recheck(state, forged)
    wrongly = msgspec.structs.replace(
        rejected, payload_excerpt=msgspec.json.encode(GOOD).decode(), payload_size=len(msgspec.json.encode(GOOD))
    )
    assert recheck(state, wrongly) == "would now be accepted"
    cut = msgspec.structs.replace(forged, payload_size=10_000)  # only the start was kept: not judged again
    assert recheck(state, cut) is None


def test_a_number_a_snapshot_cannot_hold_is_refused() -> None:
    # Snapshots are msgpack, which holds 64-bit integers: one beyond would stop every snapshot of the state.
    for extra, field in [
        ({"priority": 2**64}, "priority"),
        ({"priority": -(2**63) - 1}, "priority"),
        ({"memory": {"extra_mb": 10**30}}, "memory.extra_mb"),
        ({"array": {"count": 2, "max_running": 10**30}}, "array.max_running"),
    ]:
        v = verdict(GOOD | extra)
        assert isinstance(v.event, ev.JobRejected), extra
        assert f"`{field}` is out of range" in v.event.reason
    accepted = verdict(GOOD | {"intake_id": "p"}).event
    huge = msgspec.structs.replace(accepted, spec=msgspec.structs.replace(accepted.spec, priority=2**64))
    assert "would now be rejected" in recheck(cluster(), huge)
    assert recheck(cluster(), msgspec.structs.replace(huge, intake_rules=4)) is None, "accepted by the rules before"
    state = cluster()
    v = verdict(GOOD | {"priority": 2**63 - 1}, state)
    assert isinstance(v.event, ev.JobSubmitted)
    apply(state, 10, v.event)
    assert _scheduler.decode_state(_scheduler.encode_state(state)).jobs[v.event.job].spec.priority == 2**63 - 1


def test_a_gang_split_over_more_nodes_than_can_hold_its_share_is_refused() -> None:
    state = cluster()  # two nodes of 8 GPUs
    for seq, small in enumerate([node("s1", 2), node("s2", 2)], 4):
        apply(state, seq, small)
    v = verdict(GOOD | {"gpus": 16, "nodes": 4}, state)
    assert isinstance(v.event, ev.JobRejected), "only 2 nodes have 4 GPUs: it could never start"
    assert v.event.reason == "asks for 4 nodes of 4 GPUs but only 2 nodes have that many"
    assert isinstance(verdict(GOOD | {"gpus": 8, "nodes": 4}, state).event, ev.JobSubmitted), "2 GPUs on each of 4"
    fits = verdict(GOOD | {"gpus": 8, "nodes": 4, "intake_id": "g"}, state).event
    gang = msgspec.structs.replace(fits, spec=msgspec.structs.replace(fits.spec, gpus=16))
    assert "would now be rejected" in recheck(state, gang)
    assert recheck(state, msgspec.structs.replace(gang, intake_rules=4)) is None, "accepted by the rules before"
