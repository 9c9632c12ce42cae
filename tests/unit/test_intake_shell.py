"""The scheduler's intake shell on the in-memory log: record, reply, survive a judging failure."""

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.errors import LogError, LogUnavailable
from gpuherd.log import Delivery, MemoryLog
from gpuherd.log.base import REPLY_HEADER
from gpuherd.log.jetstream import _refusal
from gpuherd.state import ClusterState, apply
from services.scheduler import service
from tests.helpers import node


def delivery(data: bytes, seq: int = 1) -> Delivery:
    return Delivery(
        seq=seq, subject="herd.intake.teamA", data=data, headers={REPLY_HEADER: "inbox.1"}, at=5.0, deliveries=1
    )


def cluster() -> ClusterState:
    return apply(ClusterState(), 1, node("n1", 4))


async def test_valid_submission_is_recorded_and_answered() -> None:
    log = MemoryLog()
    spec = {"name": "a", "user": "u", "gpus": 2, "duration_s": 1, "intake_id": "x"}
    verdict = await service.handle_submission(log, cluster(), delivery(msgspec.json.encode(spec)))
    [record] = await log.read_all()
    assert isinstance(record.event, ev.JobSubmitted) and record.event.job == verdict.job_id
    assert log.replies == [("inbox.1", verdict.reply())]
    again = await service.handle_submission(log, cluster(), delivery(msgspec.json.encode(spec), seq=2))
    assert again.duplicate and again.job_id == verdict.job_id and await log.last_seq() == 1


async def test_a_judging_bug_becomes_a_recorded_rejection(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(service, "judge", broken)
    log = MemoryLog()
    verdict = await service.handle_submission(log, cluster(), delivery(b'{"name": "a"}'))
    [record] = await log.read_all()
    assert isinstance(record.event, ev.JobRejected)
    assert "failed to judge this submission (KeyError" in record.event.reason
    assert msgspec.json.decode(log.replies[0][1]) == {"ok": False, "error": verdict.event.reason}


@pytest.mark.parametrize(("code", "kind"), [(503, LogUnavailable), (500, LogUnavailable), (400, LogError)])
def test_server_refusals_are_retryable_only_when_transient(code: int, kind: type) -> None:
    error = _refusal("append", {"code": code, "err_code": 10008, "description": "jetstream unavailable"})
    assert type(error) is kind and "jetstream unavailable" in str(error)
