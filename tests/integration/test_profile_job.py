"""A running job profiles its own steps on request, through NATS and a cpu agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import open_log
from gpuherd.train.profile import StepProfile
from tests.integration.procs import Services, wait_scheduler_ready, wait_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


async def test_a_running_job_answers_a_profile_request(local_nats, tmp_path) -> None:
    services = Services(local_nats.url, tmp_path, agents=1, gpus=1, executor="cpu")
    services.start_all()
    log = await open_log(local_nats.url, name="test")
    client = await Client.connect(local_nats.url, source="test")
    try:
        await wait_state(log, lambda s: "n1" in s.nodes, 30)
        await wait_scheduler_ready(log)
        command = ["python", "examples/train_cnn.py", "--steps", "100000", "--batch-size", "8", "--log-every", "1000"]
        job = await client.submit(
            {"name": "cnn", "user": "u", "gpus": 1, "command": command, "workdir": str(ROOT), "intake_id": "cnn"}
        )
        await wait_state(log, lambda s: s.jobs[job].status == "running", 60)
        start = await log.last_seq() + 1
        request = await client.request_profile(job, steps=2)

        async def answer() -> ev.ProfileReported:
            async for record in log.read(start, follow=True):
                if isinstance(record.event, ev.ProfileReported) and record.event.request == request:
                    return record.event
            raise AssertionError("log ended")

        reported = await asyncio.wait_for(answer(), 120)
        assert (reported.job, reported.node, reported.rank) == (job, "n1", 0)
        profile = StepProfile.from_dict(reported.profile)
        assert profile.model == "SmallResNet" and profile.batch_size == 8 and profile.repeats == 2
        convs = [layer for layer in profile.layers if layer.kind == "Conv2d"]
        assert len(convs) == 9 and all(layer.flops > 0 and layer.time_s > 0 for layer in convs)
        assert profile.peaks is not None and profile.peaks.matmul_flops > 0

        await client.cancel(job, "done")
        await wait_state(log, lambda s: s.jobs[job].status == "cancelled", 60)
        assert services.crashed() == []
    finally:
        await client.close()
        await log.close()
        services.stop_all()
