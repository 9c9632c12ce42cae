"""Real jobs through NATS on cpu agents: single-process and 2-node DDP training, a failing
command, cancel, and an agent SIGKILLed mid-job."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.fold.invariants import violations
from gpuherd.log import open_log
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import Services, wait_state
from tests.integration.test_process_executor import pids_of_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def job(name: str, gpus: int, command: list[str], **extra) -> dict:
    return {"name": name, "user": "test", "gpus": gpus, "command": command, "intake_id": name, **extra}


async def logs_of(log, node: str, job_id: str, attempt: int = 0) -> dict[str, str]:
    raw = await log.request(f"{node}.logs", msgspec.json.encode({"job": job_id, "attempt": attempt}))
    answer = json.loads(raw)
    assert answer["ok"], answer
    return answer["attempts"][str(attempt)]


def records_of(records, kind: type) -> list:
    return [r.event for r in records if isinstance(r.event, kind)]


@pytest.mark.long
async def test_real_jobs_on_cpu_agents(local_nats, tmp_path) -> None:
    services = Services(local_nats.url, tmp_path, agents=2, gpus=4, executor="cpu", lost_after=10.0)
    services.start_all()
    log = await open_log(local_nats.url, name="test")
    client = await Client.connect(local_nats.url, source="test")
    try:
        await wait_state(log, lambda s: len(s.nodes) == 2, 30)
        mlp = await client.submit(
            job("mlp", 1, ["python", "examples/train_mlp.py", "--steps", "30", "--log-every", "10"], workdir=str(ROOT))
        )
        ddp = await client.submit(
            job(
                "ddp",
                2,
                ["python", "examples/train_cnn.py", "--steps", "6", "--batch-size", "8", "--log-every", "3"],
                nodes=2,
                workdir=str(ROOT),
            )
        )
        gang_fails = await client.submit(
            job(
                "gang-fails",
                2,
                ["python", "examples/train_cnn.py", "--steps", "50", "--batch-size", "8", "--fail-at-step", "2"],
                nodes=2,
                max_retries=1,
                workdir=str(ROOT),
            )
        )
        failing = await client.submit(
            job("fails", 1, ["python", "-c", "import sys; print('bad things happened', file=sys.stderr); sys.exit(3)"])
        )
        sleeper = await client.submit(
            job("sleeper", 1, ["python", "-c", "import time; print('up', flush=True); time.sleep(120)"])
        )

        state = await wait_state(log, lambda s: s.jobs[sleeper].status == "running", 60)
        sleeper_node = state.jobs[sleeper].nodes[0]
        for _ in range(100):
            if "up" in (await logs_of(log, sleeper_node, sleeper)).get("rank-0.log", ""):
                break
            await asyncio.sleep(0.1)
        assert pids_of_job(sleeper), "the sleeper's process runs"
        await client.cancel(sleeper, "test")

        state = await wait_state(
            log,
            lambda s: all(
                s.jobs[j].status in ("completed", "failed", "cancelled")
                for j in (mlp, ddp, failing, sleeper, gang_fails)
            ),
            180,
        )
        records = await log.read_all()
        finished = {r.event.job: r.event for r in records if isinstance(r.event, ev.JobFinished)}

        assert finished[mlp].outcome == "completed", finished[mlp]
        assert finished[mlp].metrics is not None and finished[mlp].metrics["step"] == 30
        assert 0 < finished[mlp].metrics["loss"] < 2.3, "the MLP learned something"

        assert finished[ddp].outcome == "completed", finished[ddp]
        started = {r.event.node for r in records if isinstance(r.event, ev.JobStarted) and r.event.job == ddp}
        assert started == {"n1", "n2"}
        placed = next(r.event for r in records if isinstance(r.event, ev.JobPlaced) and r.event.job == ddp)
        assert placed.rendezvous is not None and placed.locality == "rack"
        rank1_node = placed.allocations[1].node
        rank1 = (await logs_of(log, rank1_node, ddp))["rank-1.log"]
        assert f"job {ddp} attempt 0: rank 1/2 on cpu (gloo)" in rank1 and "final loss" in rank1

        assert finished[failing].outcome == "failed" and finished[failing].exit_code == 3
        assert "bad things happened" in finished[failing].output_tail

        # Rank 0 fails at step 2; rank 1 (on the other node) is stopped with it; one retry, then failed.
        assert finished[gang_fails].outcome == "failed" and "after 1 retries" in finished[gang_fails].reason
        assert "failing on purpose at step 2" in finished[gang_fails].output_tail
        gang_ends = [r.event for r in records if isinstance(r.event, ev.TaskEnded) and r.event.job == gang_fails]
        # The other rank is stopped by its agent, or dies first of the broken collective: either way it ends.
        assert sorted(e.attempt for e in gang_ends) == [0, 0, 1, 1]
        assert {e.outcome for e in gang_ends} <= {"failed", "stopped"}
        assert all(any(e.outcome == "failed" and e.attempt == a for e in gang_ends) for a in (0, 1))
        assert [e.attempt for e in records_of(records, ev.JobRequeued) if e.job == gang_fails] == [0]
        assert pids_of_job(gang_fails) == []

        assert finished[sleeper].outcome == "cancelled"
        assert pids_of_job(sleeper) == [], "cancel leaves no process behind"
        assert violations(records) == []
        assert audit(records, SchedulerDecider()).ok
        assert services.crashed() == [], services.logs()
    finally:
        await client.close()
        services.stop_all()
        await log.close()


async def test_sigkilled_agent_job_is_requeued_and_completed_elsewhere_never_twice(local_nats, tmp_path) -> None:
    services = Services(
        local_nats.url, tmp_path, agents=2, gpus=2, executor="cpu", lost_after=5.0, fence_after=1.5, kill_grace=1.0
    )
    services.start_all()
    log = await open_log(local_nats.url, name="test")
    client = await Client.connect(local_nats.url, source="test")
    code = "import time; print('working', flush=True); time.sleep(4); print('done', flush=True)"
    try:
        await wait_state(log, lambda s: len(s.nodes) == 2, 30)
        job_id = await client.submit(job("survivor", 2, [sys.executable, "-c", code]))
        state = await wait_state(log, lambda s: s.jobs[job_id].status == "running", 60)
        first_node = state.jobs[job_id].nodes[0]
        first_dir = tmp_path / "agents" / first_node / "jobs" / job_id / "attempt-0"
        for _ in range(100):
            if pids_of_job(job_id):
                break
            await asyncio.sleep(0.1)
        services.kill(f"agent-{first_node.removeprefix('n')}")  # the shims outlive the agent ...

        state = await wait_state(log, lambda s: s.jobs[job_id].status == "completed", 90)
        assert state.jobs[job_id].attempt == 1
        second_node = next(n for n in ("n1", "n2") if n != first_node)
        second_dir = tmp_path / "agents" / second_node / "jobs" / job_id / "attempt-1"
        first_exit = json.loads((first_dir / "exit.json").read_text())
        second_start = json.loads((second_dir / "shim.json").read_text())["started_at"]
        # ... until they fence themselves, which is before the scheduler may declare the node lost.
        assert first_exit["stopped"].startswith("fenced"), first_exit
        assert first_exit["ended_at"] < second_start, "attempt 1 started before attempt 0 was gone"
        records = await log.read_all()
        lost = next(r.event for r in records if isinstance(r.event, ev.NodeLost))
        assert lost.node == first_node and lost.at > first_exit["ended_at"]
        assert violations(records) == []
        assert audit(records, SchedulerDecider()).ok
    finally:
        await client.close()
        services.stop_all()
        await log.close()
