"""A submission that reuses an intake id: a true duplicate (a retry of the same bytes) is answered
from the jobs the log holds, whatever changed in the cluster since; a submission of another shape or
spec under a used id is refused, and the audit re-judges every such verdict the same. Also: a
workflow with an out-of-range number is refused for that number, with its path; `gpuherd submit` says
when a submission was already submitted."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.client import Verdict as ClientVerdict
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission, Verdict, job_id_for, judge, recheck, workflow_id_for
from services.scheduler.state import SchedulerState
from tests.helpers import node

_scheduler = SchedulerDecider()
SOURCE = "ci"


def cluster() -> SchedulerState:
    state = _scheduler.initial_state()
    for seq, e in enumerate([node("n1", 8), node("n2", 8), ev.VcConfigured(id="vc", vc="vision")], 1):
        _scheduler.evolve(state, seq, e)
    return state


def send(state: SchedulerState, data: dict[str, Any] | bytes, *, seq: int) -> Verdict:
    raw = data if isinstance(data, bytes) else msgspec.json.encode(data)
    return judge(state, Submission(source=SOURCE, seq=seq, data=raw, at=float(seq)))


def fold(state: SchedulerState, verdict: Verdict) -> None:
    for e in verdict.events():
        _scheduler.evolve(state, state.seq + 1, e)


def accepted(state: SchedulerState, data: dict[str, Any], *, seq: int = 1) -> Verdict:
    verdict = send(state, data, seq=seq)
    assert isinstance(verdict.event, ev.JobSubmitted), verdict.event
    fold(state, verdict)
    return verdict


def refused(state: SchedulerState, data: dict[str, Any] | bytes, *, seq: int) -> ev.JobRejected:
    """The rejection, which the audit (``recheck`` on the state it was judged on) gives again."""
    verdict = send(state, data, seq=seq)
    assert isinstance(verdict.event, ev.JobRejected), f"accepted: {verdict.job_ids()} duplicate={verdict.duplicate}"
    assert verdict.events() == [verdict.event], "the rejection is recorded"
    assert recheck(state, verdict.event) is None, "the audit re-judges it the same"
    return verdict.event


def step(name: str, *after: str, gpus: int = 1) -> dict[str, Any]:
    return {"name": name, "gpus": gpus, "duration_s": 10, **({"depends_on": {"afterok": list(after)}} if after else {})}


def nightly(*steps: dict[str, Any]) -> dict[str, Any]:
    return {"workflow": "nightly", "user": "ana", "intake_id": "nightly-42", "steps": list(steps)}


GOOD = {"name": "resnet", "user": "ana", "gpus": 4, "duration_s": 60, "vc": "vision"}

# -- a workflow's intake id reused (defect 1) -------------------------------------------------------------


def test_a_workflow_resubmitted_with_a_step_added_in_front_is_refused_not_half_dropped() -> None:
    state = cluster()
    first = accepted(state, nightly(step("prep"), step("train", "prep")))
    rejected = refused(state, nightly(step("fetch"), step("prep", "fetch"), step("train", "prep")), seq=2)
    assert rejected.reason == (
        "intake id 'nightly-42' was used by an earlier submission of another shape "
        f"(jobs {', '.join(first.job_ids())}); use a new intake id"
    )
    assert rejected.intake_id == "nightly-42"


def test_a_workflow_resubmitted_with_a_step_left_out_or_renamed_is_refused() -> None:
    state = cluster()
    accepted(state, nightly(step("prep"), step("train", "prep"), step("eval", "train")))
    assert "of another shape" in refused(state, nightly(step("prep"), step("train", "prep")), seq=2).reason
    renamed = nightly(step("prep"), step("fit", "prep"), step("eval", "fit"))
    assert "of another shape" in refused(state, renamed, seq=3).reason


def test_a_workflow_resubmitted_as_it_was_is_a_duplicate_listing_its_recorded_steps() -> None:
    state = cluster()
    first = accepted(state, nightly(step("prep"), step("train", "prep")))
    again = send(state, nightly(step("prep"), step("train", "prep")), seq=2)
    assert again.duplicate and again.events() == []
    answer = msgspec.json.decode(again.reply())
    workflow = workflow_id_for(SOURCE, "nightly-42")
    assert answer == {
        "ok": True,
        "job_id": workflow,
        "duplicate": True,
        "job_ids": first.job_ids(),
        "workflow": workflow,
        "steps": {"prep": [f"{workflow}-prep"], "train": [f"{workflow}-train"]},
    }


def test_a_workflow_step_changed_under_a_used_intake_id_is_refused_naming_what_differs() -> None:
    state = cluster()
    accepted(state, nightly(step("prep"), step("train", "prep")))
    rejected = refused(state, nightly(step("prep"), step("train", "prep", gpus=2)), seq=2)
    workflow = workflow_id_for(SOURCE, "nightly-42")
    assert rejected.reason == (
        "intake id 'nightly-42' was used by an earlier submission with another spec "
        f"(step train: `gpus` differs from job {workflow}-train); use a new intake id"
    )


# -- a duplicate is the recorded job, not today's judgement of the new payload (defect 2) ---------------


def test_a_retry_of_the_same_bytes_after_the_vc_limit_was_lowered_is_a_duplicate_of_the_waiting_job() -> None:
    state = cluster()
    data = msgspec.json.encode(GOOD | {"intake_id": "once"})
    first = send(state, data, seq=1)
    fold(state, first)
    _scheduler.evolve(state, state.seq + 1, ev.VcConfigured(id="vc2", vc="vision", max_gpus_per_user=2))
    again = send(state, data, seq=2)
    assert again.duplicate and again.events() == [], again.event
    assert msgspec.json.decode(again.reply()) == {"ok": True, "job_id": first.job_id, "duplicate": True}
    assert state.jobs[job_id_for(SOURCE, "once")].status == "pending"


def test_a_retry_of_a_job_whose_vc_filled_in_a_time_limit_is_a_duplicate_though_the_default_changed() -> None:
    state = cluster()
    _scheduler.evolve(state, state.seq + 1, ev.VcConfigured(id="vc2", vc="vision", default_time_limit_s=600))
    data = GOOD | {"intake_id": "once"}
    accepted(state, data)
    _scheduler.evolve(state, state.seq + 1, ev.VcConfigured(id="vc3", vc="vision", default_time_limit_s=60))
    assert send(state, data, seq=2).duplicate


def test_an_array_resubmitted_with_another_count_is_refused_not_answered_with_ids_that_do_not_exist() -> None:
    state = cluster()
    array = job_id_for(SOURCE, "sweep")
    accepted(state, GOOD | {"gpus": 1, "intake_id": "sweep", "array": {"count": 3}})
    larger = refused(state, GOOD | {"gpus": 1, "intake_id": "sweep", "array": {"count": 5}}, seq=2)
    assert larger.reason == (
        f"intake id 'sweep' was used by an earlier submission of another shape (jobs {array}_0, {array}_1, "
        f"{array}_2); use a new intake id"
    )
    smaller = refused(state, GOOD | {"gpus": 1, "intake_id": "sweep", "array": {"count": 2}}, seq=3)
    assert "of another shape" in smaller.reason
    assert "of another shape" in refused(state, GOOD | {"gpus": 1, "intake_id": "sweep"}, seq=4).reason
    same = send(state, GOOD | {"gpus": 1, "intake_id": "sweep", "array": {"count": 3}}, seq=5)
    assert same.duplicate and same.job_ids() == [f"{array}_{i}" for i in range(3)]


def test_a_single_job_and_an_array_never_share_an_intake_id() -> None:
    state = cluster()
    accepted(state, GOOD | {"intake_id": "solo"})
    assert "of another shape" in refused(state, GOOD | {"intake_id": "solo", "array": {"count": 2}}, seq=2).reason


def test_a_changed_spec_under_a_used_intake_id_is_refused_not_taken_for_a_duplicate() -> None:
    state = cluster()
    first = accepted(state, GOOD | {"intake_id": "x"})
    rejected = refused(state, GOOD | {"intake_id": "x", "name": "changed", "gpus": 2}, seq=2)
    assert rejected.reason == (
        "intake id 'x' was used by an earlier submission with another spec "
        f"(`name`, `gpus` differ from job {first.job_id}); use a new intake id"
    )


def test_a_message_id_taken_as_the_intake_id_is_judged_the_same_by_the_audit() -> None:
    """A submission without an intake id takes its message id (Nats-Msg-Id); the audit, which has no
    headers, judges a refusal under the id the rejection recorded."""
    state = cluster()
    first = judge(state, Submission(source=SOURCE, seq=1, data=msgspec.json.encode(GOOD), at=1.0, msg_id="m-1"))
    fold(state, first)
    changed = msgspec.json.encode(GOOD | {"gpus": 2})
    verdict = judge(state, Submission(source=SOURCE, seq=2, data=changed, at=2.0, msg_id="m-1"))
    assert isinstance(verdict.event, ev.JobRejected) and verdict.event.intake_id == "m-1"
    assert "intake id 'm-1' was used by an earlier submission with another spec" in verdict.event.reason
    assert recheck(state, verdict.event) is None


def test_verdicts_of_the_rules_before_are_re_judged_by_them() -> None:
    """Rules 7 and before judged a same-id submission on the new payload and today's state (and took
    a changed spec for a duplicate): their verdicts keep being re-judged so."""
    state = cluster()
    data = msgspec.json.encode(GOOD | {"intake_id": "once"})
    fold(state, send(state, data, seq=1))
    _scheduler.evolve(state, state.seq + 1, ev.VcConfigured(id="vc2", vc="vision", max_gpus_per_user=2))
    old_reason = (
        "asks for 4 GPUs but VC vision allows 2 per user, so it could never start; ask for fewer GPUs or use another VC"
    )
    by_rules_7 = ev.JobRejected(
        id="scheduler:rejected:ci:2",
        at=2.0,
        source="scheduler",
        based_on=state.seq,
        cause="intake:ci:2",
        intake_source=SOURCE,
        intake_seq=2,
        intake_id="once",
        reason=old_reason,
        payload_excerpt=data.decode(),
        payload_size=len(data),
        intake_rules=7,
    )
    assert recheck(state, by_rules_7) is None, "rules 7 refused the retry for the VC's new limit"
    assert recheck(state, msgspec.structs.replace(by_rules_7, intake_rules=ev.INTAKE_RULES)) == "would now be accepted"


# Text a process can be given (rules 10 refuse a NUL byte in an env value or an array's values).
process_text = st.characters(blacklist_characters="\x00")

options = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.integers(-3, 3),
        "env": st.dictionaries(st.sampled_from(["A", "B_C"]), st.text(process_text, max_size=4), max_size=2),
        "time_limit_s": st.floats(1, 1e5),
        "max_retries": st.integers(0, 3),
        "array": st.fixed_dictionaries({"count": st.integers(1, 3)})
        | st.fixed_dictionaries(
            {
                "values": st.lists(
                    st.text(process_text, max_size=3) | st.integers(-(2**63), 2**63 - 1) | st.floats(0, 9),
                    min_size=1,
                    max_size=3,
                )
            }
        ),
    },
)


@st.composite
def submissions(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):
        return {**GOOD, "gpus": draw(st.integers(1, 2)), "intake_id": "same", **draw(options)}
    names = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    steps = [{"name": name, "gpus": 1, "duration_s": 5, **draw(options)} for name in names]
    for earlier, later in itertools.pairwise(steps):
        later["depends_on"] = {draw(st.sampled_from(["afterok", "afterany"])): [earlier["name"], earlier["name"]]}
    return {"workflow": "w", "user": "ana", "vc": "vision", "intake_id": "same", "steps": steps}


@settings(max_examples=150, deadline=None)
@given(submissions(), st.sampled_from([None, 30.0]))
def test_any_accepted_submission_sent_again_is_its_duplicate_whatever_its_vc_says_now(
    data: dict[str, Any], default_limit: float | None
) -> None:
    state = cluster()
    _scheduler.evolve(state, state.seq + 1, ev.VcConfigured(id="v", vc="vision", default_time_limit_s=default_limit))
    first = accepted(state, data)
    limits = ev.VcConfigured(id="w", vc="vision", max_gpus_per_user=1, max_time_limit_s=10, default_time_limit_s=20)
    _scheduler.evolve(state, state.seq + 1, limits)
    again = send(state, data, seq=2)
    assert again.duplicate and again.events() == [], again.event
    assert again.job_ids() == first.job_ids() and again.reply() == msgspec.json.encode(
        msgspec.json.decode(first.reply()) | {"duplicate": True}
    )


# -- a workflow's out-of-range number (defect 3) ----------------------------------------------------------


def test_a_workflow_with_an_out_of_range_number_is_refused_for_that_number_with_its_path() -> None:
    state = cluster()
    in_a_step = b'{"workflow":"w","steps":[{"name":"a","user":"u","gpus":1,"duration_s":1e999}]}'
    assert refused(state, in_a_step, seq=1).reason == (
        "invalid workflow: Number out of range - at `$.steps[0].duration_s`"
    )
    shared = b'{"workflow":"w","user":"u","duration_s":-1e999,"steps":[{"name":"a","gpus":1}]}'
    assert refused(state, shared, seq=2).reason == "invalid workflow: Number out of range - at `$.duration_s`"
    single = b'{"name":"a","user":"u","gpus":1,"duration_s":1e999}'
    assert refused(state, single, seq=3).reason == "invalid job spec: Number out of range - at `$.duration_s`"


def test_an_out_of_range_workflow_refused_by_the_rules_before_keeps_its_reason_in_the_audit() -> None:
    state = cluster()
    data = b'{"workflow":"w","steps":[{"name":"a","user":"u","gpus":1,"duration_s":1e999}]}'
    rejected = send(state, data, seq=1).event
    assert isinstance(rejected, ev.JobRejected)
    before = "invalid job spec: Object contains unknown field `workflow`"
    assert recheck(state, msgspec.structs.replace(rejected, intake_rules=6, reason=before)) is None
    assert "another reason" in (recheck(state, msgspec.structs.replace(rejected, intake_rules=6)) or "")
    shared = b'{"workflow":"w","user":"u","duration_s":1e999,"steps":[{"name":"a","gpus":1}]}'
    rejected = send(state, shared, seq=2).event
    assert isinstance(rejected, ev.JobRejected)
    before = "submission is not valid JSON: Number out of range - at `$[...]`"
    assert recheck(state, msgspec.structs.replace(rejected, intake_rules=6, reason=before)) is None


# -- the CLI ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verdict", "printed"),
    [
        (ClientVerdict(ok=True, job_id="jabc", duplicate=True), "already submitted as jabc"),
        (ClientVerdict(ok=True, job_id="jabc"), "submitted jabc"),
        (
            ClientVerdict(ok=True, job_id="jarr", duplicate=True, job_ids=["jarr_0", "jarr_1"], array="jarr"),
            "already submitted as array jarr: 2 jobs jarr_0 .. jarr_1",
        ),
        (
            ClientVerdict(ok=True, job_id="wf", duplicate=True, job_ids=["wf-a"], workflow="wf", steps={"a": ["wf-a"]}),
            "already submitted as workflow wf: a wf-a",
        ),
    ],
)
def test_submit_says_when_a_submission_was_already_submitted(
    verdict: ClientVerdict, printed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from apps.cli import jobs

    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(GOOD))
    monkeypatch.setattr(jobs, "client_call", lambda *args, **kwargs: verdict)
    options = {"depends": None, "time_limit": None, "keep_on_invalid_dep": False, "array": None}
    options |= {"array_values": None, "max_running": None, "json": False, "timeout": 1.0, "source": "cli"}
    assert jobs.cmd_submit(argparse.Namespace(file=str(spec), **options)) == 0
    assert capsys.readouterr().out.strip() == printed
