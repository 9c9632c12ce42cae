"""Submissions sent as atomic batches to a clustered (R3) intake stream: each is stored once,
judged and answered, as on a single server."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import HERD_INTAKE, open_log
from gpuherd.natsd import NatsCluster
from tests.helpers import node, running_scheduler

pytestmark = pytest.mark.slow

GOOD = {"name": "t", "user": "u", "gpus": 1, "duration_s": 60}


async def test_batched_submissions_on_a_clustered_intake_stream_each_get_their_verdict(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "nats", size=3).start()
    log_ = client = None
    try:
        log_ = await asyncio.wait_for(open_log(cluster.url, name="batches", replicas=3), 120)
        assert (await log_.js.stream_info(HERD_INTAKE)).config.num_replicas == 3
        await log_.append([node("n1", 8), node("n2", 8)])
        async with running_scheduler(log_, "a"):
            client = await Client.connect(cluster.url, source="teamC")
            specs = [GOOD | {"name": f"c{i}", "intake_id": f"c{i}"} for i in range(40)]
            verdicts = await asyncio.wait_for(
                asyncio.gather(*(client.submit_raw(msgspec.json.encode(s), timeout=60) for s in specs)), 90
            )
            assert all(v.ok for v in verdicts), [v.error for v in verdicts if not v.ok]
            assert len({v.job_id for v in verdicts}) == 40
            last = (await log_.js.stream_info(HERD_INTAKE)).state.last_seq
            batches: collections.Counter[str | None] = collections.Counter()
            for seq in range(1, last + 1):
                batches[((await log_.js.get_msg(HERD_INTAKE, seq)).headers or {}).get("Nats-Batch-Id")] += 1
            assert sum(batches.values()) == 40, "one stored message per submission, none twice"
            assert None not in batches and max(batches.values()) > 1, batches
            assert client._alone_until == 0.0, "a batch went unanswered"
        jobs = [r.event for r in await log_.read_all() if isinstance(r.event, ev.JobSubmitted)]
        assert sorted(j.spec.intake_id for j in jobs) == sorted(s["intake_id"] for s in specs)
    finally:
        if client is not None:
            await client.close()
        if log_ is not None:
            await log_.close()
        cluster.stop()
