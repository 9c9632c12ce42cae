"""A submission delivered again after its rejection was stored (the leader that stored it stopped
before its acknowledgement reached the server) is answered from the log, not rejected a second time:
the log deduplicates pages, and the next leader may group verdicts otherwise, so a second rejection
was stored beside the first. Another submission under the same sequence (a recreated intake stream)
is judged as usual."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission
from services.scheduler.state import RECENT_REJECTIONS_KEPT, SchedulerState
from tests.helpers import node

_scheduler = SchedulerDecider()


def cluster() -> SchedulerState:
    state = _scheduler.initial_state()
    for seq, e in enumerate([node("n1", 8), ev.VcConfigured(id="vc", vc="vision")], 1):
        _scheduler.evolve(state, seq, e)
    return state


def take_and_fold(state: SchedulerState, sub: Submission) -> tuple[list[ev.Event], bytes]:
    answer = _scheduler.take(state, sub)
    for e in answer.events:
        _scheduler.evolve(state, state.seq + 1, e)
    return answer.events, answer.reply


def through_a_snapshot(state: SchedulerState) -> SchedulerState:
    return _scheduler.decode_state(_scheduler.encode_state(state))


BAD = b'{"name": "a", "user": "u", "gpus": 99, "duration_s": 10, "vc": "vision"}'


def test_a_rejected_submission_delivered_again_is_answered_without_a_second_rejection() -> None:
    state = cluster()
    first, reply = take_and_fold(state, Submission(source="ci", seq=7, data=BAD, at=1.0))
    assert [type(e) for e in first] == [ev.JobRejected]
    state = through_a_snapshot(state)  # (the next leader may start from a snapshot)
    again, reply_again = take_and_fold(state, Submission(source="ci", seq=7, data=BAD, at=9.0))
    assert again == [], "nothing appended: the log holds the rejection"
    assert reply_again == reply
    assert msgspec.json.decode(reply_again)["ok"] is False
    assert state.rejected == 1


def test_another_submission_under_the_same_sequence_is_judged() -> None:
    state = cluster()
    take_and_fold(state, Submission(source="ci", seq=7, data=BAD, at=1.0))
    good = b'{"name": "a", "user": "u", "gpus": 1, "duration_s": 10, "vc": "vision"}'
    events, _ = take_and_fold(state, Submission(source="ci", seq=7, data=good, at=2.0))
    assert [type(e) for e in events] == [ev.JobSubmitted]
    other_source, _ = take_and_fold(state, Submission(source="web", seq=7, data=BAD, at=3.0))
    assert [type(e) for e in other_source] == [ev.JobRejected]


def test_only_the_latest_rejections_are_kept() -> None:
    state = cluster()
    for seq in range(1, RECENT_REJECTIONS_KEPT + 2):
        _scheduler.evolve(
            state,
            state.seq + 1,
            ev.JobRejected(
                id=f"r{seq}", intake_source="ci", intake_seq=seq, reason="no", payload_excerpt="x", payload_size=1
            ),
        )
    assert len(state.recent_rejections) == RECENT_REJECTIONS_KEPT
    assert 1 not in state.recent_rejections and RECENT_REJECTIONS_KEPT + 1 in state.recent_rejections
