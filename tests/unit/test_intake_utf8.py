"""Intake rules 9: a submission that is not valid UTF-8 is rejected for that, with where the bad byte
is, whatever its shape (msgspec raises ``UnicodeDecodeError``, which is no ``msgspec.DecodeError``,
for a bad byte inside a string; the fuzzer found intake failing on ``"\\xcd"\\xcd``). Stored bytes
that are not UTF-8 are not an event (``EventDecodeError``), and the audit does not re-judge a
rejection whose kept excerpt had to replace bytes."""

from __future__ import annotations

import re

import pytest

from gpuherd import events as ev
from gpuherd.errors import EventDecodeError
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission, judge, recheck
from services.scheduler.state import SchedulerState
from tests.helpers import node

_scheduler = SchedulerDecider()

NOT_UTF8 = [
    b'"\xcd"\xcd',  # what the fuzzer found: a string, then garbage
    b'["\xcd"]',
    b'{"workflow": "\xcd"}',
    b'{"steps": [{"name": "\xcd", "gpus": 1, "command": "x"}]}',
    b'{"workflow": 1e999, "x": "\xcd"}',
    b'{"name": "\xcd", "gpus": 1, "duration_s": 10}',
    b'{"name": "ok", "gpus": 1, "duration_s": 10, "user": "\xff\xfe"}',
]


def cluster() -> SchedulerState:
    state = _scheduler.initial_state()
    for seq, e in enumerate([node("n1", 8), ev.VcConfigured(id="vc", vc="vision")], 1):
        _scheduler.evolve(state, seq, e)
    return state


@pytest.mark.parametrize("data", NOT_UTF8)
def test_a_submission_that_is_not_utf8_is_rejected_for_that(data: bytes) -> None:
    state = cluster()
    verdict = judge(state, Submission(source="ci", seq=7, data=data, at=1.0))
    assert isinstance(verdict.event, ev.JobRejected)
    assert verdict.event.reason.startswith("submission is not valid JSON: not UTF-8"), verdict.event.reason
    assert f"at byte {data.index(next(b for b in data if b >= 0x80).to_bytes(1, 'big'))}" in verdict.event.reason
    assert verdict.event.intake_rules >= 9
    assert recheck(state, verdict.event) is None, "the audit does not re-judge what it cannot read back"


@pytest.mark.parametrize("data", NOT_UTF8)
def test_the_live_decider_answers_with_that_reason_not_a_failure(data: bytes) -> None:
    state = cluster()
    answer = _scheduler.take(state, Submission(source="ci", seq=7, data=data, at=1.0))
    (event,) = answer.events
    assert isinstance(event, ev.JobRejected)
    assert "failed to judge" not in event.reason, event.reason


def test_a_valid_utf8_submission_with_other_scripts_is_judged_as_before() -> None:
    state = cluster()
    data = '{"name": "résumé-训练", "user": "zoë", "gpus": 1, "duration_s": 10, "vc": "vision"}'.encode()
    verdict = judge(state, Submission(source="ci", seq=7, data=data, at=1.0))
    assert isinstance(verdict.event, ev.JobSubmitted), verdict.event


@pytest.mark.parametrize("data", [b'{"type": "\xcd"}', b'{"type": "JobRejected", "reason": "\xcd"}', b'"\xcd"'])
def test_stored_bytes_that_are_not_utf8_are_no_event(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        ev.decode(data)


def test_the_audit_does_not_rejudge_an_old_rejection_whose_excerpt_replaced_bytes() -> None:
    """Before rules 9 the live decider's safety net rejected these ("failed to judge"); the excerpt
    kept U+FFFD for the bad byte, so the bytes it judged cannot be read back."""
    state = cluster()
    data = b'"\xcd"\xcd'
    excerpt = data.decode("utf-8", errors="replace")
    old = ev.JobRejected(
        id="r1",
        intake_source="ci",
        intake_seq=7,
        reason="the scheduler failed to judge this submission (UnicodeDecodeError: ...); please report it",
        payload_excerpt=excerpt,
        payload_size=len(excerpt.encode()),  # (a size that matches the excerpt by chance)
        intake_rules=8,
    )
    assert recheck(state, old) is None


def test_a_bad_byte_in_the_intake_id_does_not_stop_the_scheduler() -> None:
    """The core asks every submission for its intake key before judging it; a bad byte there made
    ``next_batch`` raise, and the scheduler read the same submission again after each restart."""
    from gpuherd.runtime.core import DecisionCore

    core = DecisionCore(_scheduler, cluster())
    good = b'{"name": "a", "user": "u", "gpus": 1, "duration_s": 10, "vc": "vision", "intake_id": "a"}'
    for seq, data in enumerate([b'{"intake_id": "\xcd"}', good], 1):
        core.offer(Submission(source="ci", seq=seq, data=data, at=1.0))
    verdicts = []
    while core.waiting:  # (one that has no intake key is decided alone)
        for decided in core.next_batch():
            verdicts += decided.outputs
            for e in decided.outputs:
                core.state = _scheduler.evolve(core.state, core.state.seq + 1, e)
    assert [type(e) for e in verdicts] == [ev.JobRejected, ev.JobSubmitted]
    assert "not UTF-8" in verdicts[0].reason


# -- the other edges where bytes come from outside ----------------------------------------------------


def test_a_stored_page_with_a_bad_trace_is_unreadable_not_a_stopped_reader() -> None:
    from types import SimpleNamespace

    from gpuherd.log.jetstream import _unpack

    msg = SimpleNamespace(data=b'{"events":[],"traces":["\xcd"]}', subject="herd.job.x")
    ((event, _),) = _unpack(msg, slots=2, seq=5)
    assert isinstance(event, ev.Unreadable) and "not a page of events" in event.reason


def test_a_control_message_that_is_not_utf8_is_a_message_error() -> None:
    from gpuherd.control import MessageError, decode_message

    with pytest.raises(MessageError):
        decode_message(b'{"kind": "metrics", "job": "\xcd"}')


def test_a_task_file_that_is_not_utf8_is_unreadable(tmp_path) -> None:
    from gpuherd.control import WorkerExit
    from services.nodeagent.taskfiles import UnreadableTaskFile, read

    path = tmp_path / "worker-0.exit"
    path.write_bytes(b'{"job": "\xcd"}')
    with pytest.raises(UnreadableTaskFile, match=re.escape("worker-0.exit")):
        read(path, WorkerExit)


@pytest.mark.parametrize("name", ["job.json", "job.yaml"])
def test_a_job_file_that_is_not_utf8_is_a_submission_error(tmp_path, name: str) -> None:
    from gpuherd.client import load_data_file
    from gpuherd.errors import SubmissionError

    path = tmp_path / name
    path.write_bytes(b'{"name": "\xcd"}')
    with pytest.raises(SubmissionError, match=re.escape(f"{name}: not valid")):
        load_data_file(path)
