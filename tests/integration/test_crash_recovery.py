"""SIGKILL of services and agents, and a nats-server restart, in the middle of a workload.

At the end every accepted job has completed exactly once, no GPU was ever
double-booked, no attempt was placed twice, and the audit finds every
recorded decision would be made again.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from gpuherd.client import Client
from gpuherd.fold.invariants import unfinished, violations
from gpuherd.log import open_log
from gpuherd.natsd import NatsServer
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import Services, wait_state

pytestmark = pytest.mark.slow

JOBS = 40


async def submit_workload(url: str, rng: random.Random, n: int = JOBS) -> list[str]:
    client = await Client.connect(url, source="crash", persistent=True)
    try:
        ids = []
        for i in range(n):
            spec = {
                "name": f"w{i}",
                "user": "u",
                "gpus": rng.choice([1, 1, 2, 4]),
                "duration_s": rng.uniform(0.2, 1.2),
                "intake_id": f"w{i}",
            }
            ids.append(await client.submit(spec, timeout=60))
        return ids
    finally:
        await client.close()


async def check_history(url: str, job_ids: list[str]) -> list:
    log = await open_log(url, name="check")
    try:
        records = await log.read_all()
    finally:
        await log.close()
    assert violations(records) == []
    assert unfinished(records) == []
    finished = [r.event for r in records if type(r.event).__name__ == "JobFinished"]
    completed = {e.job for e in finished if e.outcome == "completed"}
    assert completed == set(job_ids)
    report = audit(records, SchedulerDecider())
    assert report.ok, report.mismatches[:5]
    assert report.decisions_checked >= len(job_ids)
    return [r.event for r in records]


async def test_sigkill_scheduler_and_agents_mid_run(local_nats, tmp_path) -> None:
    rng = random.Random(7)
    services = Services(local_nats.url, tmp_path, agents=2, gpus=4, lost_after=4.0)
    services.start_all()
    log = await open_log(local_nats.url, name="test")
    try:
        await wait_state(log, lambda s: len(s.nodes) == 2, 30)
        submitter = asyncio.create_task(submit_workload(local_nats.url, rng))
        for _round in range(3):
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            services.kill("scheduler")
            services.start("scheduler")
        await asyncio.sleep(rng.uniform(0.2, 1.0))
        services.kill("agent-1")  # down briefly: adopts its tasks on return
        await asyncio.sleep(0.5)
        services.start("agent-1")
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        services.kill("agent-2")  # down long enough to be declared lost: its jobs are requeued
        await asyncio.sleep(7)
        services.start("agent-2")
        job_ids = await submitter
        await wait_state(
            log, lambda s: len(s.jobs) == JOBS and all(j.status == "completed" for j in s.jobs.values()), 120
        )
        assert services.crashed() == [], services.logs()
    finally:
        services.stop_all()
        await log.close()
    events = await check_history(local_nats.url, job_ids)
    kinds = [type(e).__name__ for e in events]
    assert any(type(e).__name__ == "NodeLost" and e.node == "n2" for e in events), "agent-2 should have been lost"
    assert kinds.count("NodeRegistered") >= 4, "both killed agents registered again"


async def test_nats_server_restart_mid_run(tmp_path) -> None:
    rng = random.Random(11)
    server = NatsServer(tmp_path / "nats").start()
    services = Services(server.url, tmp_path, agents=2, gpus=4, lost_after=8.0)
    try:
        services.start_all()
        log = await open_log(server.url, name="test")
        await wait_state(log, lambda s: len(s.nodes) == 2, 30)
        submitter = asyncio.create_task(submit_workload(server.url, rng))
        await asyncio.sleep(2.0)
        server.kill()  # SIGKILL: JetStream recovers from its files
        await asyncio.sleep(2.0)
        server = NatsServer(tmp_path / "nats", port=server.port).start()
        job_ids = await submitter
        await wait_state(
            log, lambda s: len(s.jobs) == JOBS and all(j.status == "completed" for j in s.jobs.values()), 120
        )
        await log.close()
        assert services.crashed() == [], services.logs()
    finally:
        services.stop_all()
    try:
        await check_history(server.url, job_ids)
    finally:
        server.stop()
