"""The scheduler's intake shell on the in-memory log: submissions decided in the runner's order,
recorded, answered once stored, and a judging failure recorded as a rejection."""

import asyncio

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.errors import LogError, LogUnavailable
from gpuherd.log import REPLY_HEADER, InProcessLog
from gpuherd.log.jetstream import _refusal
from gpuherd.runtime.runner import DeciderRunner
from services.scheduler import intake, service
from services.scheduler.decide import SchedulerDecider
from tests.helpers import node, running_scheduler


async def submit(log: InProcessLog, data: bytes, inbox: str) -> dict:
    """Publish to intake as a plain request would, and wait for the answer sent to ``inbox``."""
    await log.publish_intake("teamA", data, {REPLY_HEADER: inbox})
    for _ in range(500):
        answers = [msgspec.json.decode(reply) for to, reply in log.replies if to == inbox]
        if answers:
            return answers[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no answer on {inbox}")


async def test_a_valid_submission_is_recorded_then_answered_and_its_twin_is_the_same_job() -> None:
    log = InProcessLog()
    await log.append([node("n1", 4)])
    spec = {"name": "a", "user": "u", "gpus": 2, "duration_s": 1, "intake_id": "x"}
    async with running_scheduler(log, stop_within_s=5.0):
        first = await submit(log, msgspec.json.encode(spec), "inbox.1")
        again = await submit(log, msgspec.json.encode(spec), "inbox.2")
    submitted = [r.event for r in await log.read_all() if isinstance(r.event, ev.JobSubmitted)]
    assert [s.job for s in submitted] == [first["job_id"]] and first["ok"] and not first["duplicate"]
    assert again == {"ok": True, "job_id": first["job_id"], "duplicate": True}
    assert submitted[0].cause == "intake:teamA:1" and submitted[0].based_on >= 1


async def test_a_judging_bug_becomes_a_recorded_rejection(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(intake, "judge", broken)
    log = InProcessLog()
    await log.append([node("n1", 4)])
    async with running_scheduler(log, stop_within_s=5.0):
        answer = await submit(log, b'{"name": "a"}', "inbox.1")
    [rejected] = [r.event for r in await log.read_all() if isinstance(r.event, ev.JobRejected)]
    assert "failed to judge this submission (KeyError" in rejected.reason
    assert answer == {"ok": False, "error": rejected.reason}


@pytest.mark.parametrize(("code", "kind"), [(503, LogUnavailable), (500, LogUnavailable), (400, LogError)])
def test_server_refusals_are_retryable_only_when_transient(code: int, kind: type) -> None:
    error = _refusal("append", {"code": code, "err_code": 10008, "description": "jetstream unavailable"})
    assert type(error) is kind and "jetstream unavailable" in str(error)


async def test_a_submission_in_flight_when_the_leadership_is_lost_is_answered_once_it_leads_again() -> None:
    """Fenced out while a verdict was on its way, the scheduler forgets what it was handed (a standby
    starts from the snapshot and the log): leading again, it decides the redelivered message."""
    log = InProcessLog(duplicate_window=0)
    await log.append([node("n1", 4)])
    runner = DeciderRunner(log, SchedulerDecider(), instance="a")
    service.setup(runner, ack_wait_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        spec = {"name": "a", "user": "u", "gpus": 1, "duration_s": 1}
        assert (await submit(log, msgspec.json.encode(spec | {"intake_id": "x"}), "inbox.1"))["ok"]
        # Another instance fenced this one: its next verdict is refused, and it leads again at once.
        fence = ev.LeadershipTaken(id="scheduler:leader:b:1", source="scheduler", service="scheduler", instance="b")
        await log.append([fence])
        answer = await submit(log, msgspec.json.encode(spec | {"intake_id": "y"}), "inbox.2")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert answer["ok"] and not answer["duplicate"]
    submitted = [r.event for r in await log.read_all() if isinstance(r.event, ev.JobSubmitted)]
    assert [s.job for s in submitted].count(answer["job_id"]) == 1
