"""An elastic job through NATS on cpu agents: it grows onto another node, shrinks, loses a worker
to SIGKILL and goes on with the survivor, and ends with every rescale reported and audited."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.fold import ClusterState
from gpuherd.fold.invariants import violations
from gpuherd.log import EventLog, open_log
from gpuherd.runtime.audit import audit
from gpuherd.runtime.runner import append_reliably
from services.elastic.decide import ElasticDecider
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import Services, wait_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def cluster(
    url: str, tmp_path: Path, *, executor: str, gpus: int, elastic_params: str | None = None
) -> AsyncIterator[tuple[Services, EventLog, Client]]:
    """Scheduler and two agents (and the elastic service, given its parameters), a log reader and
    a client; all stopped afterwards."""
    services = Services(url, tmp_path, agents=2, gpus=gpus, executor=executor, lost_after=10.0)
    if elastic_params is not None:
        services.specs["elastic"] = ["-m", "services.elastic", "--nats-url", url, "--params", elastic_params]
        services.specs["elastic"] += ["--tick", "0.5"]
    services.start_all()
    log = await open_log(url, name="test")
    client = await Client.connect(url, source="test")
    try:
        await wait_state(log, lambda s: len(s.nodes) == 2, 30)
        yield services, log, client
        assert not services.crashed(), services.logs()
    finally:
        await client.close()
        await log.close()
        services.stop_all()


def elastic_cnn(*, gpus: int, steps: int) -> dict:
    """examples/train_cnn.py as an elastic job of 1 to 3 workers (a global batch of 24 in micro-batches of 4)."""
    command = ["python", "examples/train_cnn.py", "--steps", str(steps), "--samples", "960", "--log-every", "25"]
    return {
        "name": "elastic-cnn",
        "user": "test",
        "gpus": gpus,
        "command": [*command, "--global-batch", "24", "--micro-batch", "4"],
        "elastic": {"min": 1, "max": 3, "global_batch": 24, "micro_batch": 4},
        "workdir": str(ROOT),
    }


def _records(records, kind: type) -> list:
    return [r.event for r in records if isinstance(r.event, kind)]


async def _propose(log, state: ClusterState, job_id: str, gpus: int) -> None:
    job = state.jobs[job_id]
    proposal = ev.RescaleProposed(
        id=f"test:propose:{job_id}:{job.generation}",
        at=time.time(),
        source="test",
        job=job_id,
        attempt=job.attempt,
        generation=job.generation,
        gpus=gpus,
        reason="test",
    )
    await append_reliably(log, [proposal])


async def _wait(log, services: Services, predicate, timeout: float) -> ClusterState:
    """wait_state, and on failure the job's events and the services' logs (what went wrong where)."""
    try:
        return await wait_state(log, predicate, timeout)
    except AssertionError as exc:
        events = [f"{r.seq} {type(r.event).__name__} {r.event}"[:300] for r in await log.read_all()]
        raise AssertionError(f"{exc}\n" + "\n".join(events[-40:]) + "\n" + services.logs()) from None


def _settled(job_id: str, generation: int):
    """The job runs ``generation`` and its rescale has ended."""
    return lambda s: s.jobs[job_id].generation == generation and s.jobs[job_id].rescale is None


def _worker_pid(tmp_path: Path, node: str, job_id: str, gpu: int) -> int:
    """The pid of the worker of ``node/gpu`` that the task started with (from the shim's records)."""
    task = tmp_path / "agents" / node / "jobs" / job_id / "attempt-0"
    procs = json.loads((task / "task.json").read_text())["procs"]
    pids = json.loads((task / "shim.json").read_text())["pids"]
    return pids[next(i for i, proc in enumerate(procs) if proc["gpu"] == gpu)]


@pytest.mark.long
async def test_an_elastic_job_grows_shrinks_and_survives_a_dead_worker(local_nats, tmp_path) -> None:
    # 2 GPUs per node so that a grow to 3 must go to the other node.
    async with cluster(local_nats.url, tmp_path, executor="cpu", gpus=2) as (services, log, client):
        job_id = await client.submit(elastic_cnn(gpus=2, steps=400))
        state = await _wait(log, services, lambda s: s.jobs[job_id].status == "running", 60)
        assert state.jobs[job_id].nodes == ["n1"] or state.jobs[job_id].nodes == ["n2"]
        home = state.jobs[job_id].nodes[0]
        first_log = tmp_path / "agents" / home / "jobs" / job_id / "attempt-0" / "worker-0.log"
        for _ in range(200):  # the proposal comes once the job trains (not while its workers start)
            if first_log.exists() and "step 1 " in first_log.read_text():
                break
            await asyncio.sleep(0.1)

        await _propose(log, state, job_id, 3)  # grow: one more worker, on the other node
        state = await _wait(log, services, _settled(job_id, 1), 90)
        assert len(state.jobs[job_id].workers) == 3 and len(state.jobs[job_id].nodes) == 2

        await _propose(log, state, job_id, 2)  # shrink: the newest worker (on the other node) leaves
        state = await _wait(log, services, _settled(job_id, 2), 90)
        assert state.jobs[job_id].nodes == [home] and state.jobs[job_id].held == 2

        os.kill(_worker_pid(tmp_path, home, job_id, 1), signal.SIGKILL)  # not rank 0's: a worker dies
        state = await _wait(log, services, _settled(job_id, 3), 90)
        assert state.jobs[job_id].workers == (f"{home}/0",)

        state = await _wait(log, services, lambda s: s.jobs[job_id].status in ("completed", "failed"), 180)
        records = await log.read_all()
        job = state.jobs[job_id]
        assert job.status == "completed", (job.reason, services.logs())
        assert job.final_metrics is not None and job.final_metrics["step"] == 400
        resized = _records(records, ev.JobResized)
        assert [(r.generation, r.kind, len(r.allocations[0].gpus)) for r in resized][:1] == [(1, "grow", 2)]
        assert [r.kind for r in resized] == ["grow", "shrink", "recover"]
        completed = [r for r in _records(records, ev.RescaleCompleted) if r.job == job_id]
        assert [(c.generation, c.world_before, c.world) for c in completed] == [(1, 2, 3), (2, 3, 2), (3, 2, 1)]
        for done in completed:
            assert list(done.times) == list(ev.RESCALE_PHASES)  # every phase, the grow onto n2 too
            phases = done.durations()
            assert all(v >= 0 for v in phases.values()) and {"pause_s", "total_s"} <= set(phases), phases
        lost = _records(records, ev.WorkerLost)
        assert [(w.node, w.gpu, w.exit_code) for w in lost] == [(home, 1, -9)]
        assert violations(records) == []
        report = audit(records, SchedulerDecider())
        assert report.ok, report.mismatches


@pytest.mark.long
async def test_the_elastic_service_lends_idle_gpus_and_takes_them_back_for_a_waiting_job(local_nats, tmp_path) -> None:
    params = '{"min_interval_s": 2, "hold_after_shrink_s": 600, "retry_s": 5}'
    async with cluster(local_nats.url, tmp_path, executor="cpu", gpus=2, elastic_params=params) as (
        services,
        log,
        client,
    ):
        elastic = await client.submit(elastic_cnn(gpus=1, steps=100_000))
        # Nothing waits: the service grows it into idle GPUs, to 3 (the largest size that keeps the batch).
        grown = lambda s: len(s.jobs[elastic].workers) == 3 and s.jobs[elastic].rescale is None  # noqa: E731
        state = await _wait(log, services, grown, 120)
        rigid = await client.submit(
            {"name": "rigid", "user": "test", "gpus": 2, "command": ["python", "-c", "import time; time.sleep(2)"]}
        )
        # It waits for 2 GPUs (1 is free): the elastic job shrinks to 2 and the rigid job runs and ends.
        state = await _wait(log, services, lambda s: s.jobs[rigid].status == "completed", 120)
        records = await log.read_all()
        proposals = [p for p in _records(records, ev.RescaleProposed) if p.job == elastic]
        assert [p.gpus for p in proposals][:1] == [3] and 2 in [p.gpus for p in proposals]
        assert "rigid" not in proposals[0].reason and rigid in next(p.reason for p in proposals if p.gpus == 2)
        assert (
            state.jobs[elastic].status == "running" and len(state.jobs[elastic].workers) == 2
        )  # held after the shrink
        assert violations(records) == []
        assert audit(records, SchedulerDecider()).ok
        assert any(isinstance(r.event, ev.ElasticConfigured) for r in records)  # --params, recorded
        assert audit(records, ElasticDecider()).ok  # audited with the parameters the log recorded
        await client.cancel(elastic)
        await _wait(log, services, lambda s: s.jobs[elastic].status == "cancelled", 60)


async def test_an_elastic_sim_job_resizes_and_gives_gpus_back(local_nats, tmp_path) -> None:
    """On sim agents there are no workers to switch: the leading agent reports each rescale done."""
    async with cluster(local_nats.url, tmp_path, executor="sim", gpus=4) as (services, log, client):
        spec = {"name": "sim-elastic", "user": "test", "gpus": 2, "duration_s": 30, "elastic": {"min": 1, "max": 6}}
        job_id = await client.submit(spec)
        state = await _wait(log, services, lambda s: s.jobs[job_id].status == "running", 30)
        await _propose(log, state, job_id, 6)  # onto the second node too
        state = await _wait(log, services, _settled(job_id, 1), 30)
        assert len(state.jobs[job_id].nodes) == 2 and state.jobs[job_id].held == 6
        await _propose(log, state, job_id, 1)
        state = await _wait(log, services, _settled(job_id, 2), 30)
        assert state.jobs[job_id].held == 1 and state.free_gpus() == 7
        await client.cancel(job_id)
        state = await _wait(log, services, lambda s: s.jobs[job_id].status == "cancelled", 30)
        assert state.free_gpus() == 8 and violations(await log.read_all()) == []
