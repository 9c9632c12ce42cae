"""A workflow with an out-of-range number is refused for that number, with its path, and the audit
re-judges such verdicts of every rules version the same."""

from __future__ import annotations

from typing import Any

import msgspec

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission, Verdict, judge, recheck
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


def refused(state: SchedulerState, data: dict[str, Any] | bytes, *, seq: int) -> ev.JobRejected:
    """The rejection, which the audit (``recheck`` on the state it was judged on) gives again."""
    verdict = send(state, data, seq=seq)
    assert isinstance(verdict.event, ev.JobRejected), f"accepted: {verdict.job_ids()} duplicate={verdict.duplicate}"
    assert verdict.events() == [verdict.event], "the rejection is recorded"
    assert recheck(state, verdict.event) is None, "the audit re-judges it the same"
    return verdict.event


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
