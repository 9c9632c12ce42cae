"""Chaos on a real 3-node JetStream cluster: SIGKILL every service (the report relay too), an agent
and a NATS server at random moments, several times, while sim and cpu agents run a workload.

At the end every accepted job has exactly one terminal state, no GPU was ever double-booked
(checked from the log), the audit finds no decision it would not make again, and the recovery
time of each fault is printed. ``CHAOS_ROUNDS`` (default 1; ``make chaos``: 3) is how many faults
of each kind; ``CHAOS_SEED`` picks the moments.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from apps import registry
from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.fold.invariants import unfinished, violations
from gpuherd.log import open_log
from gpuherd.metrics import http_get
from gpuherd.natsd import NatsCluster, free_port
from gpuherd.runtime.audit import audit
from services.elastic.decide import ElasticDecider
from services.memory.decide import MemoryDecider
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import Services, wait_state

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("CHAOS_ROUNDS", "1"))
SEED = int(os.environ.get("CHAOS_SEED", "2026"))
JOBS_PER_ROUND = 40
# The scheduler first; the report relay last (the agents' reports go through it, and a report it
# held when killed is appended by its agent).
SERVICES = (*sorted(registry.required(), key=lambda name: name != "scheduler"), "relay")
AGENTS = ("agent-1", "agent-2", "agent-3")  # two sim nodes, one cpu node
LOST_AFTER_S = 6.0


async def http_ok(port: int, path: str = "/readyz") -> bool:
    try:
        return (await http_get(port, path, timeout=2.0))[0] == 200
    except (OSError, TimeoutError, ValueError, IndexError):
        return False


async def until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("not recovered")
        await asyncio.sleep(0.1)


def build(cluster: NatsCluster, tmp_path: Path) -> tuple[Services, dict[str, int]]:
    services = Services(cluster.url, tmp_path, agents=3, gpus=4, lost_after=LOST_AFTER_S)
    services.env["GPUHERD_REPLICAS"] = "3"
    for name in SERVICES[1:]:
        services.specs[name] = ["-m", f"services.{name}", "--nats-url", cluster.url]
    cpu = services.specs["agent-3"]
    cpu[cpu.index("--executor") + 1] = "cpu"
    cpu[cpu.index("--gpus") + 1] = "2"
    cpu[cpu.index("--island") + 1] = "1"
    ports = {}
    for name, spec in services.specs.items():
        ports[name] = free_port()
        spec += ["--metrics-port", str(ports[name])]
    return services, ports


async def workload(url: str, rng: random.Random, n: int) -> list[str]:
    """Submissions spread over the faults: sim jobs, and real processes for the cpu node."""
    client = await Client.connect(url, source="chaos", persistent=True)
    accepted = []
    try:
        for i in range(n):
            spec: dict = {"name": f"c{i}", "user": rng.choice(["ann", "bob"]), "intake_id": f"c{i}"}
            if i % 5 == 4:
                spec |= {"gpus": 1, "command": ["python", "-c", "import time; time.sleep(1.0)"]}
            else:
                spec |= {"gpus": rng.choice([1, 1, 2, 4]), "duration_s": rng.uniform(0.3, 2.0)}
            accepted.append(await client.submit(spec, timeout=120))
            await asyncio.sleep(rng.uniform(0.05, 0.4))
        return accepted
    finally:
        await client.close()


@pytest.mark.long
async def test_chaos(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    cluster = NatsCluster(tmp_path / "nats").start()
    services, ports = build(cluster, tmp_path)
    recoveries: list[tuple[str, float]] = []
    log = None
    try:
        services.start_all()
        log = await open_log(cluster.url, name="chaos", replicas=3)
        await wait_state(log, lambda s: len(s.nodes) == 3, 60)
        for name in services.specs:
            await until(lambda name=name: http_ok(ports[name]), 60)
        submitter = asyncio.create_task(workload(cluster.url, rng, JOBS_PER_ROUND * ROUNDS))

        locks = {name: asyncio.Lock() for name in [*services.specs, *(srv.server_name for srv in cluster.servers)]}

        async def kill_process(name: str, down_s: float) -> None:
            async with locks[name]:  # one fault at a time per process: a second start would be a twin
                await _kill_process(name, down_s)

        async def _kill_process(name: str, down_s: float) -> None:
            killed = time.monotonic()
            services.kill(name)
            await asyncio.sleep(down_s)
            services.start(name)
            await until(lambda: http_ok(ports[name]), 90)
            recoveries.append((f"SIGKILL {name} (down {down_s:.1f}s)", time.monotonic() - killed))

        async def kill_nats(index: int, down_s: float) -> None:
            async with locks[cluster.servers[index].server_name]:
                await _kill_nats(index, down_s)

        async def _kill_nats(index: int, down_s: float) -> None:
            server = cluster.servers[index]
            killed = time.monotonic()
            server.kill()
            await asyncio.sleep(down_s)
            server.start()

            async def whole() -> bool:  # the log's stream has a leader and every replica is current again
                try:
                    info = await log.js.stream_info("HERD")
                except Exception:
                    return False
                peers = info.cluster.replicas or [] if info.cluster else []
                return info.cluster is not None and len(peers) == 2 and all(p.current and not p.offline for p in peers)

            await until(whole, 90)
            recoveries.append((f"SIGKILL {server.server_name} (down {down_s:.1f}s)", time.monotonic() - killed))

        faults = [*SERVICES, "agent", "nats"] * ROUNDS
        rng.shuffle(faults)
        pending = []
        for fault in faults:
            await asyncio.sleep(rng.uniform(0.5, 3.0))
            if fault == "nats":
                # One NATS server down at a time: the cluster keeps a quorum (2 of 3), as it is built to.
                while any(locks[srv.server_name].locked() for srv in cluster.servers):
                    await asyncio.sleep(0.1)
                pending.append(asyncio.create_task(kill_nats(rng.randrange(3), rng.uniform(0.5, 3.0))))
            elif fault == "agent":
                # Sometimes back within the scheduler's patience, sometimes declared lost (jobs requeued).
                up = [a for a in AGENTS if not locks[a].locked()] or list(AGENTS)
                pending.append(asyncio.create_task(kill_process(rng.choice(up), rng.uniform(0.2, 9.0))))
            else:
                pending.append(asyncio.create_task(kill_process(fault, 0.0)))
            await asyncio.sleep(0)
        await asyncio.gather(*pending)
        accepted = await asyncio.wait_for(submitter, 240)
        await wait_state(
            log,
            lambda s: (
                all(s.jobs[j].status in ("completed", "failed", "cancelled") for j in accepted if j in s.jobs)
                and all(j in s.jobs for j in accepted)
            ),
            240,
        )
        assert services.crashed() == [], services.logs()
        records = await log.read_all()
    finally:
        services.stop_all()
        if log is not None:
            await log.close()
        cluster.stop()

    print(f"\nchaos: {len(faults)} faults, {len(accepted)} accepted jobs, seed {SEED}")
    print(f"{'fault':<42} {'recovered in':>12}")
    for what, seconds in sorted(recoveries):
        print(f"{what:<42} {seconds:>11.1f}s")

    assert violations(records) == [], "a GPU was double-booked or a job ended twice"
    assert unfinished(records) == []
    submitted = {r.event.job for r in records if isinstance(r.event, ev.JobSubmitted)}
    assert set(accepted) <= submitted, "an accepted job is missing from the log"
    terminal = Counter(r.event.job for r in records if isinstance(r.event, ev.JobFinished))
    assert all(terminal[j] == 1 for j in accepted), {j: terminal[j] for j in accepted if terminal[j] != 1}
    outcomes = Counter(r.event.outcome for r in records if isinstance(r.event, ev.JobFinished))
    print(f"outcomes: {dict(outcomes)}")
    for decider in (SchedulerDecider(), ElasticDecider(), MemoryDecider()):
        report = audit(records, decider)
        assert report.ok, (decider.name, report.mismatches[:5])
    assert len(recoveries) == len(faults)
