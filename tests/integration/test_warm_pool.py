"""The node's pool of warm workers, with real processes (torch on CPU, gloo; no NATS): a warm
interpreter becomes the worker of a grow onto a node the job did not run on, the pool refills,
and it gives its interpreters back when the host's memory is needed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd.control import AgentMessage, RescaleReport
from gpuherd.jobenv import ElasticPlan
from services.nodeagent.control_socket import ControlSocket, control_address
from services.nodeagent.executors import TaskExit, TaskKey, TaskLaunch
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.pool import WarmPool, available_mb
from services.nodeagent.shim import process_alive
from tests.integration.test_process_executor import pids_of_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
KEY = TaskKey("elastic-cnn", 0)
SPEC = ev.JobSpec(
    name="elastic-cnn",
    user="test",
    gpus=2,
    command=(
        "python",
        "examples/train_cnn.py",
        *("--steps", "100000", "--samples", "960", "--global-batch", "24", "--micro-batch", "4", "--log-every", "1"),
    ),
    elastic=ev.Elastic(min=1, max=3, global_batch=24, micro_batch=4),
    workdir=str(ROOT),
    env={"OMP_NUM_THREADS": "1"},
)


def _executor(folder: Path, node: str, agent_addr: str, *, warm_workers: int) -> CpuExecutor:
    folder.mkdir(parents=True, exist_ok=True)
    alive = folder / "alive"
    alive.touch()
    executor = CpuExecutor(
        folder,
        gpus=2,
        alive_file=alive,
        agent_addr=agent_addr,
        fence_after_s=600.0,
        kill_grace_s=5.0,
        warm_workers=warm_workers,
        warm_min_free_mb=256,
    )
    executor.node = node
    return executor


def _launch(gpus: tuple[int, ...]) -> TaskLaunch:
    return TaskLaunch(key=KEY, spec=SPEC, gpus=gpus, procs=len(gpus), world_size=len(gpus), elastic=True)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        await asyncio.sleep(0.1)


def _log(executor: CpuExecutor, gpu: int) -> str:
    path = executor.task_dir(KEY) / f"worker-{gpu}.log"
    return path.read_text() if path.exists() else ""


@pytest.mark.long
async def test_a_warm_worker_takes_over_a_grow_onto_another_node_and_the_pool_refills(tmp_path: Path) -> None:
    messages: list[AgentMessage] = []
    address = control_address(str(tmp_path), "test")
    control = ControlSocket(address, messages.append)  # the agents' control socket: the workers' reports
    await control.start()
    home = _executor(tmp_path / "a", "a", address, warm_workers=0)
    other = _executor(tmp_path / "b", "b", address, warm_workers=1)
    exits: dict[str, TaskExit] = {}
    warm_pid = refilled = 0

    async def take_exits(node: str, executor: CpuExecutor) -> None:
        exits[node] = await executor.exits.get()

    watchers = [asyncio.create_task(take_exits("a", home)), asyncio.create_task(take_exits("b", other))]
    try:
        pool = other.start_pool()
        assert pool is not None
        await wait_until(lambda: pool.ready() == 1, 120, "a warm worker on node b")
        warm_pid = pool.idle[0].pid
        assert pool.status()["memory_mb"] > 50  # what it holds counts in the node's reports

        await home.start(_launch((0, 1)))
        home.write_plan(KEY, ElasticPlan(0, ("a/0", "a/1"), "127.0.0.1", _port(), "a/0"))
        await wait_until(lambda: "step 3 " in _log(home, 0), 180, "the job training on node a")

        # The scheduler commits a grow onto node b; b's agent starts the job's task there.
        grow = ElasticPlan(1, ("a/0", "a/1", "b/0"), "127.0.0.1", _port(), "a/0", ("b/0",), time.time())
        home.write_plan(KEY, grow)
        await other.start(_launch((0,)))
        other.write_plan(KEY, grow)
        (new_worker,) = json.loads((other.task_dir(KEY) / "task.json").read_text())["procs"]
        assert new_worker["pid"] == warm_pid  # the pool's interpreter is the new worker: nothing started cold

        def completed(generation: int) -> RescaleReport | None:
            done = [m for m in messages if isinstance(m, RescaleReport) and m.event == "completed"]
            return next((m for m in done if m.generation == generation), None)

        await wait_until(lambda: completed(1) is not None, 180, "the grow to 3 workers")
        report = completed(1)
        assert report is not None and (report.world_before, report.world) == (2, 3)
        assert list(report.times) == list(ev.RESCALE_PHASES) and all(report.times.values())
        assert "elastic worker b/0" in _log(other, 0)
        assert process_alive(warm_pid, new_worker["pid_start"])  # training, as the job's third worker

        # The pool refills in the background: a new warm interpreter, not the one taken.
        await wait_until(lambda: pool.ready() == 1 and pool.idle[0].pid != warm_pid, 120, "the pool refilled")
        assert pool.counts.taken == 1
        refilled = pool.idle[0].pid

        # Watched like any worker: it leaves at a shrink, exits 0, and its task completes.
        shrink = ElasticPlan(2, ("a/0", "a/1"), "127.0.0.1", _port(), "a/0", decided_at=time.time())
        home.write_plan(KEY, shrink)
        other.write_plan(KEY, shrink)
        await wait_until(lambda: "b" in exits, 120, "node b's task to end")
        assert exits["b"].outcome == "completed", exits["b"]
        assert json.loads((other.task_dir(KEY) / "worker-0.exit").read_text())["code"] == 0
        await wait_until(lambda: completed(2) is not None, 120, "the shrink to 2 workers")
    finally:
        for watcher in watchers:
            watcher.cancel()
        for executor in (home, other):
            with contextlib.suppress(Exception):
                await executor.stop(KEY, "the test is over")
            await executor.shutdown()
        control.close()
    assert pids_of_job(KEY.job) == []  # nothing of the job is left, pooled workers included
    assert other.pool is None and not process_alive(warm_pid, 0) and not process_alive(refilled, 0)


@pytest.mark.long
@pytest.mark.skipif(available_mb() < 10_000, reason="needs 10 GiB of available memory to take 5 GiB of it")
async def test_the_pool_gives_its_workers_back_when_the_host_needs_the_memory(tmp_path: Path) -> None:
    pool = WarmPool(2, tmp_path, min_free_mb=1024, refill_delay_s=0.0, check_s=0.2)
    hog: subprocess.Popen[bytes] | None = None
    pool.start()
    try:
        await wait_until(lambda: pool.ready() == 2, 180, "two warm workers")
        pids = [w.pid for w in pool.idle]
        assert pool.memory_mb() > 100
        # The host keeps 2.5 GiB less than it has free now; then a process takes 5 GiB of it.
        pool.min_free_mb = available_mb() - 2500
        take = "import sys; memory = b'x' * (5 << 30); print('taken', flush=True); sys.stdin.read()"
        hog = subprocess.Popen(
            [sys.executable, "-c", take],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert hog.stdout is not None and hog.stdout.readline().strip() == b"taken"
        await wait_until(lambda: not pool.idle, 60, "the pool given back")
        assert pool.counts.given_back == 2 and pool.memory_mb() == 0
        await wait_until(lambda: not any(process_alive(pid, 0) for pid in pids), 30, "the warm workers gone")
        for _ in range(5):  # while the memory stays taken, nothing is started again
            await pool.tend()
        assert not pool.idle
        hog.kill()
        hog.wait()
        await wait_until(lambda: pool.ready() >= 1, 180, "the pool refilled once the memory was back")
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
            hog.wait()
        idle = [w.pid for w in pool.idle]
        await pool.close()
    assert not any(process_alive(pid, 0) for pid in idle)


def test_a_warm_worker_becomes_only_a_worker_whose_start_up_environment_it_shares() -> None:
    from services.nodeagent.pool import WarmWorker, _fits, fixed_environment

    base = {"PATH": "/usr/bin", "PYTHONPATH": "/src", "PYTHONUNBUFFERED": "1", "HOME": "/root"}
    unpinned = WarmWorker(proc=None, fixed=fixed_environment(base), pin=None, started=0.0, start_ticks=0)  # type: ignore[arg-type]
    job = base | {"OMP_NUM_THREADS": "2", "GPUHERD_ELASTIC_WORKER": "n1/0", "CUDA_VISIBLE_DEVICES": ""}
    assert _fits(unpinned, job)  # what the job adds is set when it becomes the worker
    assert not _fits(unpinned, job | {"PYTHONPATH": "/other"})  # read once, at start
    assert not _fits(unpinned, job | {"PYTHONHASHSEED": "0"})
    assert not _fits(unpinned, {k: v for k, v in job.items() if k != "PYTHONPATH"})
    pinned_env = {"CUDA_VISIBLE_DEVICES": "GPU-3"}
    pinned = WarmWorker(
        proc=None,  # type: ignore[arg-type]
        fixed=fixed_environment(base) | pinned_env,
        pin=3,
        started=0.0,
        start_ticks=0,
    )
    assert _fits(pinned, job | pinned_env)  # its CUDA context is on the worker's GPU
    assert not _fits(pinned, job | {"CUDA_VISIBLE_DEVICES": "GPU-1"})


def test_an_idle_warm_worker_ends_with_its_agent(tmp_path: Path) -> None:
    """The agent dies (SIGKILL): its idle warm workers see their stdin close and exit."""
    script = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from services.nodeagent.pool import WarmPool\n"
        "async def main():\n"
        "    pool = WarmPool(1, Path(sys.argv[1]), min_free_mb=0, check_s=0.2)\n"
        "    pool.start()\n"
        "    while pool.ready() < 1: await asyncio.sleep(0.1)\n"
        "    print('warm worker', pool.idle[0].pid, flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True
    )
    try:
        assert agent.stdout is not None
        line = b""
        while not line.startswith(b"warm worker "):  # (after the pool's own log lines)
            line = agent.stdout.readline()
            assert line, "the agent ended before its warm worker was ready"
        pid = int(line.split()[-1])
        assert process_alive(pid, 0)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 30
        while process_alive(pid, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
