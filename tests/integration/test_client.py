"""The submitters' client against a real nats-server: what it says about storage, its reply
subscription, and the job ids it lets into subjects."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import msgspec
import nats
import pytest

from gpuherd import events as ev
from gpuherd.client import MAX_REASON_CHARS, Client
from gpuherd.errors import SubmissionError
from gpuherd.log import INTAKE_PREFIX, REPLY_HEADER
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.natsd import NatsServer

GOOD = {"name": "t", "user": "u", "gpus": 1, "duration_s": 1}


async def _stream_names(url: str) -> list[str]:
    nc = await nats.connect(url)
    try:
        return [info.config.name for info in await nc.jetstream().streams_info()]
    finally:
        await nc.close()


def _subscriptions_of(server: NatsServer, connection_name: str) -> list[str]:
    """The subjects the server holds subscriptions on for a connection (its monitoring endpoint)."""
    with urllib.request.urlopen(f"{server.monitor_url}/connz?subs=1", timeout=5) as answer:
        connections = json.load(answer)["connections"]
    return [s for c in connections if c.get("name") == connection_name for s in c.get("subscriptions_list", [])]


async def _unanswered(client: Client) -> str:
    """What the client says of a submission that gets no verdict within a second."""
    with pytest.raises(SubmissionError, match="no verdict within") as unanswered:
        await client.submit(GOOD, timeout=1, attempt_timeout=0.3)
    return str(unanswered.value)


async def test_a_submission_nothing_can_store_is_reported_as_not_stored(local_nats: NatsServer) -> None:
    """A fresh server with no streams and no scheduler: nothing takes the submission, and the
    client says it was not stored instead of calling it stored."""
    client = await Client.connect(local_nats.url, source="nostream")
    try:
        with pytest.raises(SubmissionError) as refused:
            await client.submit(GOOD, timeout=2, attempt_timeout=0.5)
    finally:
        await client.close()
    message = str(refused.value)
    assert message.startswith("not stored") and "HERD_INTAKE does not exist" in message, message
    assert "is stored" not in message, message
    assert await _stream_names(local_nats.url) == [], "the test needs a server without streams"


async def test_a_submission_published_before_anything_takes_it_is_judged_once_something_does(
    local_nats: NatsServer,
) -> None:
    """``gpuherd up`` returns before the scheduler has made the intake stream: the first publishes
    are refused (nothing takes them), and the attempts go on until one is taken and answered."""
    client = await Client.connect(local_nats.url, source="early")
    scheduler = await nats.connect(local_nats.url)

    async def judge(msg: Any) -> None:  # a scheduler's reply, without its stream
        await scheduler.publish(msg.headers[REPLY_HEADER], msgspec.json.encode({"ok": True, "job_id": "jearly"}))

    async def start_late() -> None:
        await asyncio.sleep(1.0)
        await scheduler.subscribe(f"{INTAKE_PREFIX}.early", cb=judge)

    try:
        late = asyncio.create_task(start_late())
        assert await client.submit(GOOD, timeout=10, attempt_timeout=0.3) == "jearly"
        await late
    finally:
        await client.close()
        await scheduler.close()


async def test_an_answer_that_is_no_verdict_is_not_taken_for_one(local_nats: NatsServer) -> None:
    """A publish's reply subject is the verdict's inbox, so JetStream may answer there too (the chaos
    suite saw it while the intake stream elected a leader): the client raised ValidationError on
    it. It now waits on for the verdict, and says what answered if none comes."""
    client = await Client.connect(local_nats.url, source="jsanswers")
    stream = await nats.connect(local_nats.url)
    refusal = {"error": {"code": 503, "err_code": 10008, "description": "JetStream system temporarily unavailable"}}
    answered: list[int] = []

    async def refuse_then_judge(msg: Any) -> None:  # the stream's refusal, then (the next copy) a verdict
        answered.append(1)
        if len(answered) == 1:
            await stream.publish(msg.reply, msgspec.json.encode(refusal))
        else:
            await stream.publish(msg.headers[REPLY_HEADER], msgspec.json.encode({"ok": True, "job_id": "jlater"}))

    try:
        await stream.subscribe(f"{INTAKE_PREFIX}.jsanswers", cb=refuse_then_judge)
        assert await client.submit(GOOD, timeout=10, attempt_timeout=0.3) == "jlater"
        silent = await Client.connect(local_nats.url, source="jsrefuses")

        async def only_refuse(msg: Any) -> None:
            await stream.publish(msg.reply, msgspec.json.encode(refusal))

        refusing = await stream.subscribe(f"{INTAKE_PREFIX}.jsrefuses", cb=only_refuse)
        try:
            message = await _unanswered(silent)
        finally:
            await refusing.unsubscribe()
            await silent.close()
        assert "temporarily unavailable" in message, message
    finally:
        await client.close()
        await stream.close()


async def test_without_a_verdict_the_client_does_not_claim_the_submission_is_stored(local_nats: NatsServer) -> None:
    """The intake stream exists but no scheduler runs: the stream does not acknowledge what it
    stores, so the client cannot know whether it did, and must not say it did."""
    log_ = await JetStreamLog.open(local_nats.url, persistent=False)
    client = await Client.connect(local_nats.url, source="noscheduler")
    try:
        message = await _unanswered(client)
    finally:
        await client.close()
        await log_.close()
    assert "is stored" not in message and "not confirmed" in message, message
    assert "same intake_id" in message, message


async def test_two_submissions_at_once_on_a_new_client_share_one_reply_subscription(local_nats: NatsServer) -> None:
    """Both submissions find no reply subscription yet; if subscribing waits (a connection whose
    write buffer is full: ``pending_size=1`` makes every command wait for the flusher), the second
    must not subscribe again, or every verdict is handled twice and one subscription leaks."""
    scheduler = await nats.connect(local_nats.url)

    async def judge(msg: Any) -> None:  # a scheduler's reply, without its stream
        job_id = "j" + msgspec.json.decode(msg.data)["intake_id"][:11]
        await scheduler.publish(msg.headers[REPLY_HEADER], msgspec.json.encode({"ok": True, "job_id": job_id}))

    await scheduler.subscribe(f"{INTAKE_PREFIX}.racing", cb=judge)
    await scheduler.flush()
    submitter = await nats.connect(local_nats.url, name="racing-submitter", pending_size=1)
    client = Client(submitter, source="racing")
    try:
        jobs = await asyncio.gather(*(client.submit(GOOD, timeout=10) for _ in range(2)))
        assert len(set(jobs)) == 2
        await submitter.flush()
        reply_subscriptions = [
            s for s in _subscriptions_of(local_nats, "racing-submitter") if s.startswith(client._reply_prefix)
        ]
        assert reply_subscriptions == [f"{client._reply_prefix}.*"]
    finally:
        await client.close()
        await scheduler.close()


async def test_a_reason_too_long_for_the_log_is_refused_before_anything_is_appended(local_nats: NatsServer) -> None:
    """``gpuherd cancel`` and ``drain`` took a reason of any length into the log (the dashboard's
    edge bounds its own; the CLI's went through unbounded)."""
    log_ = await JetStreamLog.open(local_nats.url, persistent=False)
    await log_.append([_submitted("jlong")])
    client = await Client.connect(local_nats.url, source="long-reason")
    too_long = "x" * (MAX_REASON_CHARS + 1)
    try:
        with pytest.raises(SubmissionError, match=f"at most {MAX_REASON_CHARS} characters"):
            await client.cancel("jlong", too_long)
        with pytest.raises(SubmissionError, match=f"at most {MAX_REASON_CHARS} characters"):
            await client.cancel_jobs(["jlong"], too_long)
        with pytest.raises(SubmissionError, match=f"at most {MAX_REASON_CHARS} characters"):
            await client.drain("n1", too_long)
        await client.cancel("jlong", "x" * MAX_REASON_CHARS)  # (the longest it takes)
    finally:
        await client.close()
    commands = [r.event for r in await log_.read_all() if not isinstance(r.event, ev.JobSubmitted)]
    await log_.close()
    assert [(type(c).__name__, len(c.reason)) for c in commands] == [("JobCancelRequested", MAX_REASON_CHARS)]


def _submitted(job: str) -> ev.JobSubmitted:
    return ev.JobSubmitted(
        id=f"s-{job}",
        at=time.time(),
        source="test",
        job=job,
        spec=ev.JobSpec(**GOOD),
        intake_source="test",
        intake_seq=1,
    )


@pytest.mark.parametrize("job_id", ["*", ">", "jreal.x", "j real"])
async def test_a_job_id_that_is_no_subject_token_is_refused(local_nats: NatsServer, job_id: str) -> None:
    """``herd.job.*`` matches every job's subject: a wildcard passed the existence check and a
    JobCancelRequested for job '*' was stored on the subject ``herd.job.*``."""
    log_ = await JetStreamLog.open(local_nats.url, persistent=False)
    await log_.append([_submitted("jreal")])
    client = await Client.connect(local_nats.url, source="wild")
    try:
        with pytest.raises(SubmissionError, match="not a NATS subject token"):
            await client.cancel(job_id, "a wildcard")
        with pytest.raises(SubmissionError, match="not a NATS subject token"):
            await client.cancel_jobs(["jreal", job_id], "a wildcard among them")
        with pytest.raises(SubmissionError, match="not a NATS subject token"):
            await client.request_profile(job_id)
        # A name that cannot be a job's id is no job (``gpuherd cancel`` then looks for an array or a workflow).
        assert not await client.job_exists(job_id)
        assert await client.job_exists("jreal")
    finally:
        await client.close()
    commands = [r.event for r in await log_.read_all() if not isinstance(r.event, ev.JobSubmitted)]
    await log_.close()
    assert commands == [], commands
