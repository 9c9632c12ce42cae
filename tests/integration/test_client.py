"""The submitters' client against a real nats-server: the job ids it lets into subjects."""

from __future__ import annotations

import time

import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.errors import SubmissionError
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.natsd import NatsServer

GOOD = {"name": "t", "user": "u", "gpus": 1, "duration_s": 1}


@pytest.mark.parametrize("job_id", ["*", ">", "jreal.x", "j real"])
async def test_a_job_id_that_is_no_subject_token_is_refused(local_nats: NatsServer, job_id: str) -> None:
    """``herd.job.*`` matches every job's subject: a wildcard passed the existence check and a
    JobCancelRequested for job '*' was stored on the subject ``herd.job.*``."""
    log_ = await JetStreamLog.open(local_nats.url, persistent=False)
    submitted = ev.JobSubmitted(
        id="s1",
        at=time.time(),
        source="test",
        job="jreal",
        spec=ev.JobSpec(**GOOD),
        intake_source="test",
        intake_seq=1,
    )
    await log_.append([submitted])
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
