"""Memory leases end to end through NATS: scheduler, memory broker and a cpu agent; a job that
declares ``memory`` trains with MemoryTiers on what it was leased; a job placed on a lender makes
the broker revoke, the runtime moves its blocks to host and gives the share back; the job's end
reclaims the lease."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd import jobenv
from gpuherd.client import Client
from gpuherd.log import open_log
from tests.integration.procs import Services, wait_state

ROOT = Path(__file__).resolve().parents[2]
# A newly placed job's need stays unknown for 20 s: its GPUs lend nothing meanwhile, so placing one on
# a lender revokes whatever it lent (with no warm-up a started job's need is its use, 0 here).
BROKER = {"owner_warmup_s": 20, "min_share_mb": 16, "lease_term_s": 6, "revoke_deadline_s": 60}


def _of(records, kind: type) -> list:
    return [r.event for r in records if isinstance(r.event, kind)]


async def _records(log) -> list:
    head = await log.last_seq()
    return await log.read_all() if head else []


async def _wait_for(log, kind: type, timeout: float) -> list:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (found := _of(await _records(log), kind)):
        assert asyncio.get_running_loop().time() < deadline, f"no {kind.__name__} in {timeout} s"
        await asyncio.sleep(0.3)
    return found


@pytest.mark.long
@pytest.mark.timeout(180)
async def test_a_job_trains_on_leased_memory_gives_back_a_revoked_share_and_its_lease_is_reclaimed(
    nats_url: str, tmp_path: Path
) -> None:
    services = Services(nats_url, tmp_path, agents=1, gpus=4, executor="cpu", agent_args=("--telemetry", "1"))
    services.specs["memory"] = ["-m", "services.memory", "--nats-url", nats_url, "--tick", "0.5"]
    services.specs["memory"] += ["--params", json.dumps(BROKER)]
    services.start_all()
    log = await open_log(nats_url, name="test")
    client = await Client.connect(nats_url, source="test")
    try:
        await wait_state(log, lambda s: len(s.nodes) == 1 and s.nodes["n1"].host_memory_mb > 0, 30)
        command = ["python", "examples/train_offload.py", "--steps", "40", "--min-seconds", "25", "--batch", "8"]
        offload = await client.submit(
            {
                "name": "offload",
                "user": "test",
                "gpus": 1,
                "command": command,
                "workdir": str(ROOT),
                "memory": {"extra_mb": 96, "tiers": ["nvlink", "pcie"]},
            }
        )
        state = await wait_state(log, lambda s: any(x.status == "active" for x in s.leases.values()), 60)
        (lease,) = state.leases.values()
        assert lease.job == offload and lease.granted_mb == 96
        lenders = lease.lenders()
        assert [s.tier for s in lease.shares] == ["nvlink"]  # islands of 2: its one peer covers it

        task_dir = tmp_path / "agents" / "n1" / "jobs" / offload / "attempt-0"
        written = json.loads((task_dir / jobenv.MEMORY_LEASES_FILE).read_text())
        assert written["leases"][lease.lease]["gpu"] == lease.gpu

        # Once the job's runtime uses the share, a job takes the rest of the node, lenders included.
        output = task_dir / "rank-0.log"
        deadline = asyncio.get_running_loop().time() + 60
        while "opened lease:nvlink" not in (output.read_text() if output.exists() else ""):
            assert asyncio.get_running_loop().time() < deadline, "the job never opened its leased pool"
            await asyncio.sleep(0.3)
        sleeper = ["python", "-c", "import time; time.sleep(3)"]
        await client.submit({"name": "rest", "user": "test", "gpus": 3, "command": sleeper, "workdir": str(ROOT)})
        await _wait_for(log, ev.MemoryLeaseReleased, 60)
        await wait_state(log, lambda s: s.jobs[offload].status == "completed", 90)
        # The broker reclaims on its next pass after the job's end is in the log, not in the same append.
        await wait_state(log, lambda s: s.leases == {}, 30)
        records = await _records(log)
        revoked = _of(records, ev.MemoryLeaseRevoked)
        assert revoked and all("placed" in r.reason or "expired" in r.reason for r in revoked)
        released = _of(records, ev.MemoryLeaseReleased)
        assert released and released[0].source == "agent.n1" and set(released[0].gpus) <= set(lenders)
        assert _of(records, ev.MemoryLeaseRenewed)  # the 6 s term was renewed while it ran
        (reclaimed,) = _of(records, ev.MemoryLeaseReclaimed)
        assert "ended" in reclaimed.reason and not reclaimed.deadline_missed
        assert _of(records, ev.GpuMemoryReported)
        assert "released lease:nvlink" in output.read_text()
        assert not services.crashed(), services.logs()
    finally:
        await client.close()
        await log.close()
        services.stop_all()
