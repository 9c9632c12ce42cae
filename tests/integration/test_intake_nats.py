"""Submissions over real NATS: replies, recorded rejections, idempotent intake ids, trace context."""

from __future__ import annotations

import asyncio
import collections
import time
import uuid

import msgspec
import nats
import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.errors import SubmissionError
from gpuherd.log import open_log
from tests.integration.procs import Services, wait_scheduler_ready, wait_state

pytestmark = pytest.mark.slow


@pytest.fixture
async def cluster(local_nats, tmp_path):
    services = Services(local_nats.url, tmp_path, agents=2, gpus=4)
    services.start_all()
    log = await open_log(local_nats.url, name="test")
    await wait_state(log, lambda s: len(s.nodes) == 2, 30)
    await wait_scheduler_ready(log)
    yield services, log
    services.stop_all()
    await log.close()


GOOD = {"name": "t", "user": "u", "gpus": 2, "duration_s": 0.5}
BAD = {
    b"{oops": "not valid JSON",
    msgspec.json.encode({"name": "t", "user": "u", "gpus": "2", "duration_s": 1}): "Expected `int`, got `str`",
    msgspec.json.encode({"name": "t", "gpus": 1, "duration_s": 1}): "missing required field `user`",
    msgspec.json.encode(GOOD | {"colour": "red"}): "unknown field `colour`",
    msgspec.json.encode(GOOD | {"gpus": 0}): "`gpus` must be at least 1",
    msgspec.json.encode(GOOD | {"gpus": -1}): "`gpus` must be at least 1",
    msgspec.json.encode(GOOD | {"gpus": 9}): "the whole cluster has 8",
    msgspec.json.encode(GOOD | {"vc": "nope"}): "unknown virtual cluster 'nope'",
    msgspec.json.encode(GOOD | {"name": "x" * 70_000}): "the limit is 65536 bytes",
}


async def test_every_bad_input_gets_a_reason_and_is_recorded(cluster) -> None:
    services, log = cluster
    client = await Client.connect(services.url, source="teamA")
    try:
        for data, reason in BAD.items():
            verdict = await client.submit_raw(data, timeout=20)
            assert not verdict.ok and reason in (verdict.error or ""), (reason, verdict)
    finally:
        await client.close()
    state = await wait_state(log, lambda s: s.rejected == len(BAD), 10)
    rejected = [r.event for r in await log.read_all() if isinstance(r.event, ev.JobRejected)]
    assert len(rejected) == len(BAD) and not state.jobs
    assert all(e.intake_source == "teamA" and e.payload_excerpt for e in rejected)


async def test_plain_nats_request_gets_the_verdict(cluster) -> None:
    services, log = cluster
    nc = await nats.connect(services.url)
    try:
        reply = await nc.request("herd.intake.teamB", msgspec.json.encode(GOOD | {"intake_id": "r1"}), timeout=10)
        answer = msgspec.json.decode(reply.data)
        assert answer["ok"] and answer["job_id"].startswith("j"), answer
        again = msgspec.json.decode(
            (await nc.request("herd.intake.teamB", msgspec.json.encode(GOOD | {"intake_id": "r1"}), timeout=10)).data
        )
        assert again == {"ok": True, "job_id": answer["job_id"], "duplicate": True}
        bad = msgspec.json.decode((await nc.request("herd.intake.teamB", b"[]", timeout=10)).data)
        assert bad["ok"] is False and "Expected `object`" in bad["error"]
        # Fire-and-forget publishing works too: the stream keeps it, the scheduler judges it.
        await nc.publish("herd.intake.teamB", msgspec.json.encode(GOOD | {"intake_id": "p1"}))
    finally:
        await nc.close()
    await wait_state(log, lambda s: len(s.jobs) == 2 and s.rejected == 1, 15)


async def test_same_intake_id_is_one_job_and_client_errors_are_specific(cluster) -> None:
    services, log = cluster
    client = await Client.connect(services.url, source="teamC")
    try:
        intake_id = uuid.uuid4().hex
        first = await client.submit(GOOD | {"intake_id": intake_id})
        second = await client.submit(GOOD | {"intake_id": intake_id})
        assert first == second
        with pytest.raises(SubmissionError, match="unknown virtual cluster"):
            await client.submit(GOOD | {"vc": "ghost"})
    finally:
        await client.close()
    state = await wait_state(log, lambda s: s.jobs and all(j.status == "completed" for j in s.jobs.values()), 20)
    assert list(state.jobs) == [first]


async def test_trace_context_runs_from_intake_to_job_start(cluster) -> None:
    services, log = cluster
    trace_id = uuid.uuid4().hex
    traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    nc = await nats.connect(services.url)
    try:
        await nc.request(
            "herd.intake.teamD",
            msgspec.json.encode(GOOD | {"intake_id": "traced"}),
            headers={"traceparent": traceparent},
            timeout=10,
        )
    finally:
        await nc.close()
    await wait_state(log, lambda s: any(j.status == "completed" for j in s.jobs.values()), 20)
    records = await log.read_all()
    traced = {type(r.event).__name__ for r in records if r.trace and r.trace.split("-")[1] == trace_id}
    assert {"JobSubmitted", "JobPlaced", "JobStarted"} <= traced


async def test_submit_while_scheduler_down_is_judged_when_it_returns(cluster) -> None:
    services, log = cluster
    services.kill("scheduler")
    nc = await nats.connect(services.url)
    try:
        await nc.publish("herd.intake.teamE", msgspec.json.encode(GOOD | {"intake_id": "late"}))
        await nc.flush()
    finally:
        await nc.close()
    await asyncio.sleep(1)
    services.start("scheduler")
    await wait_state(
        log, lambda s: any(j.spec.intake_id == "late" and j.status == "completed" for j in s.jobs.values()), 30
    )


async def test_a_submission_retried_while_the_scheduler_is_away_is_stored_once_and_makes_one_job(cluster) -> None:
    """The client's retries carry one message id: the intake stream drops the copies, and a spec
    without an intake id gets that id, so even a copy that got through would be the same job."""
    services, log = cluster
    stored_before = (await log.js.stream_info("HERD_INTAKE")).state.messages
    services.kill("scheduler")
    client = await Client.connect(services.url, source="teamR")
    try:
        with pytest.raises(SubmissionError, match="no verdict"):
            await client.submit_raw(msgspec.json.encode(GOOD | {"name": "retried"}), timeout=1.5, attempt_timeout=0.1)
        services.start("scheduler")
        after = await client.submit(GOOD | {"name": "after"}, timeout=60)  # judged after every copy before it
    finally:
        await client.close()
    state = await wait_state(log, lambda s: after in s.jobs, 30)
    assert [j.spec.name for j in state.jobs.values()].count("retried") == 1
    intake = await log.js.stream_info("HERD_INTAKE")
    assert intake.state.messages - stored_before == 2, "the retries were dropped as duplicates"


async def test_a_verdict_whose_reply_was_lost_reaches_the_client_through_a_new_copy(cluster) -> None:
    """A NATS server failing over between the scheduler and the client loses the reply, and the
    retries of the same message id are dropped as copies: after ``resend_after_s`` the client
    stores the submission again under a new message id, and the scheduler answers that copy as a
    duplicate of the job it made (a chaos run once waited 120 s for such a verdict)."""
    services, log = cluster
    client = await Client.connect(services.url, source="teamL")
    lost: list[str] = []

    async def loses_the_first_reply(msg) -> None:  # the client's reply subscription, with a loss
        if not lost:
            lost.append(msg.subject)
            return
        await client._on_reply(msg)

    client._reply_sub = await client.nc.subscribe(f"{client._reply_prefix}.*", cb=loses_the_first_reply)
    try:
        job = await client.submit(GOOD | {"intake_id": "lost-1"}, timeout=30, attempt_timeout=0.3, resend_after_s=2.0)
    finally:
        await client.close()
    assert lost, "no reply was lost: the test did not test the loss"
    state = await wait_state(log, lambda s: job in s.jobs, 10)
    assert [j.spec.intake_id for j in state.jobs.values()].count("lost-1") == 1


async def test_the_scheduler_says_which_jobs_it_knows_and_where_they_stand(cluster) -> None:
    """``herd.ctl.scheduler.job``: the client's quick check before a cancel (a job accepted in a
    batch is stored in a page on another job's subject, which the server's subject index misses),
    and a way for other systems to follow a job over NATS: its status, attempt, nodes and times."""
    services, log = cluster
    client = await Client.connect(services.url, source="teamA")
    try:
        jobs = await asyncio.gather(*(client.submit(GOOD | {"name": f"k{i}"}, timeout=20) for i in range(4)))
        await wait_state(log, lambda s: all(job in s.jobs for job in jobs), 20)
        for job in jobs:
            answer = msgspec.json.decode(await log.request("scheduler.job", job.encode(), timeout=5))
            assert answer["ok"] and answer["known"] and answer["job"] == job
            assert answer["status"] in {"pending", "placed", "running", "completed"}
            assert answer["gpus"] == GOOD["gpus"] and answer["submitted_at"] > 0
            assert await client.job_exists(job)
        # Followed until it ends, as another system would: placed on a node, then its outcome.
        seen: set[str] = set()
        deadline = asyncio.get_running_loop().time() + 60
        while (status := await client.job_status(jobs[0]))["status"] != "completed":
            seen.add(status["status"])
            if status["status"] in {"placed", "running"}:
                assert status["nodes"] and status["attempt"] == 0
            assert asyncio.get_running_loop().time() < deadline, f"never completed: {status}"
            await asyncio.sleep(0.1)
        assert status["known"] and status["finished_at"] is not None
        unknown = msgspec.json.decode(await log.request("scheduler.job", b"j-nobody", timeout=5))
        assert unknown == {"ok": True, "known": False, "job": "j-nobody"}
        assert not await client.job_exists("j-nobody")
        assert (await client.job_status("j-nobody"))["known"] is False
        with pytest.raises(SubmissionError):
            await client.job_status("j.*")  # a wildcard is no job's id
    finally:
        await client.close()


async def test_a_retry_under_one_msg_id_never_takes_a_later_request_s_verdict(cluster) -> None:
    """A plain request retried under its Nats-Msg-Id is stored once (the stream drops the copy). The
    dropped copy's inbox was kept, and the next requests of the same bytes got their verdicts one
    behind: each later sender waited in vain while its job was made."""
    services, log = cluster
    nc = await nats.connect(services.url)
    body = msgspec.json.encode(GOOD | {"name": f"r-{uuid.uuid4().hex[:8]}"})  # (no intake_id: each copy a job)
    msg_id = uuid.uuid4().hex
    try:
        first = msgspec.json.decode(
            (await nc.request("herd.intake.teamE", body, timeout=10, headers={"Nats-Msg-Id": msg_id})).data
        )
        assert first["ok"], first
        with pytest.raises(nats.errors.TimeoutError):  # (dropped by the stream after its verdict went out)
            await nc.request("herd.intake.teamE", body, timeout=2, headers={"Nats-Msg-Id": msg_id})
        later = [msgspec.json.decode((await nc.request("herd.intake.teamE", body, timeout=10)).data) for _ in range(2)]
    finally:
        await nc.close()
    assert all(answer["ok"] for answer in later), later
    assert len({first["job_id"], *(answer["job_id"] for answer in later)}) == 3  # three jobs, each told its own
    await wait_state(log, lambda s: all(a["job_id"] in s.jobs for a in (first, *later)), 15)


async def _batches_stored(log, first_seq: int) -> list[str | None]:
    """The Nats-Batch-Id of every intake message stored from ``first_seq`` on (None: stored alone)."""
    last = (await log.js.stream_info("HERD_INTAKE")).state.last_seq
    ids = []
    for seq in range(first_seq, last + 1):
        msg = await log.js.get_msg("HERD_INTAKE", seq)
        ids.append((msg.headers or {}).get("Nats-Batch-Id"))
    return ids


async def test_submissions_started_together_are_stored_as_atomic_batches_each_with_its_own_verdict(cluster) -> None:
    """A client's submissions started in one turn of the event loop go to the intake stream as one
    atomic batch (one disk sync for all): each is still its own message, judged and answered alone."""
    services, log = cluster
    first = (await log.js.stream_info("HERD_INTAKE")).state.last_seq + 1
    client = await Client.connect(services.url, source="teamB")
    try:
        specs = [GOOD | {"name": f"b{i}", "intake_id": f"batch-{i}"} for i in range(24)]
        specs[5] = specs[5] | {"gpus": 0}  # one bad submission in the batch: rejected, alone
        verdicts = await asyncio.gather(*(client.submit_raw(msgspec.json.encode(s), timeout=30) for s in specs))
    finally:
        await client.close()
    assert [v.ok for v in verdicts] == [i != 5 for i in range(24)], verdicts
    assert "`gpus` must be at least 1" in (verdicts[5].error or "")
    assert len({v.job_id for v in verdicts if v.ok}) == 23
    batches = await _batches_stored(log, first)
    assert len(batches) == 24, "one message per submission"
    sizes = collections.Counter(batches)
    assert None not in sizes and max(sizes.values()) > 1, f"no batch held more than one submission: {sizes}"
    state = await wait_state(log, lambda s: sum(j.spec.name.startswith("b") for j in s.jobs.values()) == 23, 30)
    assert state.rejected >= 1


async def test_a_stream_that_takes_no_batches_still_stores_every_submission_by_its_retry(cluster) -> None:
    """An intake stream set up before batches (no ``allow_atomic``) drops a batch without a word, as
    it says nothing of what it stores: each submission is stored by its retry, which goes alone, and
    the client sends submissions alone for a while."""
    services, log = cluster
    config = (await log.js.stream_info("HERD_INTAKE")).config
    config.allow_atomic = False
    await log.js.update_stream(config)
    first = (await log.js.stream_info("HERD_INTAKE")).state.last_seq + 1
    client = await Client.connect(services.url, source="teamO")
    try:
        specs = [GOOD | {"name": f"o{i}", "intake_id": f"old-{i}"} for i in range(6)]
        verdicts = await asyncio.gather(
            *(client.submit_raw(msgspec.json.encode(s), timeout=30, attempt_timeout=0.5) for s in specs)
        )
        assert all(v.ok for v in verdicts), verdicts
        assert client._alone_until > time.monotonic(), "the client goes on batching into a stream that drops them"
        started = time.monotonic()
        alone = await client.submit_raw(msgspec.json.encode(GOOD | {"name": "o-alone"}), timeout=30, attempt_timeout=5)
        assert alone.ok and time.monotonic() - started < 5, "sent alone, the next submission waits for no retry"
    finally:
        await client.close()
    assert set(await _batches_stored(log, first)) == {None}, "a batch was stored where none can be"
    await wait_state(log, lambda s: sum(j.spec.name.startswith("o") for j in s.jobs.values()) == 7, 30)
