"""An elastic task's shim with real worker processes: every worker that dies is told to the agent
(a ``WorkerExit`` datagram) and written down (``dead-workers.json``), whenever it dies; and only
the death of a GPU's current worker is read back as one."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuherd import control
from gpuherd import events as ev
from services.nodeagent import taskfiles
from services.nodeagent.executors import TaskKey, TaskLaunch
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.shim import Shim
from services.nodeagent.taskfiles import ExitRecord, ProcLaunch, ShimInfo, TaskDescription, WorkerDeath
from tests.integration.test_process_executor import (
    executor,
    exit_of,
    kill_processes_of_job,
    pids_of_job,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def agent_socket() -> Iterator[tuple[str, socket.socket]]:
    """The agent's control socket, as the shim addresses it: (address, socket)."""
    name = f"gpuherd-test-shim-deaths-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    try:
        yield f"unix-abstract:{name}", sock
    finally:
        sock.close()


@contextlib.contextmanager
def shim_handlers_restored() -> Iterator[None]:
    """The shim installs its own SIGTERM/SIGINT handlers: give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_last_worker_dying_between_the_shims_report_and_its_poll_is_still_reported(
    tmp_path: Path, agent_socket: tuple[str, socket.socket]
) -> None:
    address, agent = agent_socket
    go = tmp_path / "die-now"
    # The worker dies once told to: after the shim's report of dead workers, before its own poll.
    code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nraise SystemExit(3)"
    worker = ProcLaunch(argv=[sys.executable, "-c", code], env=dict(os.environ), log=str(tmp_path / "w.log"), gpu=0)
    (tmp_path / "alive").touch()
    description = TaskDescription(
        procs=[worker],
        alive_file=str(tmp_path / "alive"),
        fence_after_s=60.0,
        kill_grace_s=1.0,
        elastic=True,
        job="j",
        agent_addr=address,
        node="n1",
    )
    taskfiles.write(tmp_path / taskfiles.TASK_FILE, description)
    shim = Shim(tmp_path)

    def worker_dies_meanwhile() -> None:  # (stands in for the standby's start, which takes a while)
        if go.exists():
            return
        go.touch()
        deadline = time.monotonic() + 10.0
        while shim.procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    shim.keep_standby = worker_dies_meanwhile  # type: ignore[method-assign]
    try:
        with shim_handlers_restored():
            assert shim.run() == 0
    finally:
        for proc in shim.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    told = control.decode_message(agent.recv(65536))
    assert isinstance(told, control.WorkerExit)
    assert (told.job, told.gpu, told.code) == ("j", 0, 3)
    dead = taskfiles.read(tmp_path / taskfiles.DEAD_WORKERS_FILE, list[WorkerDeath])
    assert dead is not None and [(d.gpu, d.code) for d in dead] == [(0, 3)]
    record = taskfiles.read(tmp_path / taskfiles.EXIT_FILE, ExitRecord)
    assert record is not None and record.codes == [3]


def elastic_launch(job: str, code: str, gpus: tuple[int, ...], *, generation: int) -> TaskLaunch:
    spec = ev.JobSpec(
        name=job, user="u", gpus=2, command=(sys.executable, "-c", code), elastic=ev.Elastic(min=1, max=4)
    )
    return TaskLaunch(
        key=TaskKey(job, 0),
        spec=spec,
        gpus=gpus,
        procs=len(gpus),
        world_size=len(gpus),
        elastic=True,
        generation=generation,
    )


def dead_of(ex: CpuExecutor, key: TaskKey) -> list[tuple[int | None, int]]:
    return [(d.gpu, d.code) for d in ex.workers(key).dead]


async def test_a_worker_grown_back_onto_the_gpu_its_predecessor_died_on_is_not_reported_dead(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    key = TaskKey("regrow", 0)
    healed = tmp_path / "healed"
    # GPU 1's first worker dies; once healed, workers live.
    code = (
        "import os, sys, time\n"
        f"if os.environ['GPUHERD_ELASTIC_WORKER'] == 'n1/1' and not os.path.exists({str(healed)!r}): sys.exit(3)\n"
        "time.sleep(60)"
    )
    try:
        await ex.start(elastic_launch("regrow", code, (0, 1), generation=0))
        await wait_until(lambda: dead_of(ex, key) == [(1, 3)])
        # The job recovered without n1/1, then grew back onto it (generation 2): a new worker, alive.
        healed.touch()
        assert ex.grow(key, elastic_launch("regrow", code, (1,), generation=2))
        task_dir = ex.task_dir(key)
        shim_pids = lambda: (taskfiles.read(task_dir / taskfiles.SHIM_FILE, ShimInfo) or ShimInfo(pid=0)).pids  # noqa: E731
        await wait_until(lambda: len(shim_pids()) == 3)
        assert ex.workers(key).launched == {0, 1}
        assert dead_of(ex, key) == [], "the first worker's death is not the new one's"
        # The new worker's own death counts.
        os.kill(shim_pids()[2], signal.SIGKILL)
        await wait_until(lambda: dead_of(ex, key) == [(1, -signal.SIGKILL)])
        assert [d.generation for d in ex.workers(key).dead] == [2]
    finally:
        await ex.stop(key, "test over")
        kill_processes_of_job("regrow")


async def test_a_task_started_again_on_the_gpu_its_worker_died_on_reads_no_death(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    key = TaskKey("again", 0)
    try:
        await ex.start(elastic_launch("again", "raise SystemExit(3)", (0,), generation=0))
        ended = await exit_of(ex)
        assert ended.outcome == "failed" and dead_of(ex, key) == [(0, 3)]
        # The job recovered without this node, then grew back onto it in the same attempt.
        await ex.start(elastic_launch("again", "import time; time.sleep(60)", (0,), generation=2))
        await wait_until(lambda: bool(pids_of_job("again")))
        assert dead_of(ex, key) == []
    finally:
        await ex.stop(key, "test over")
        kill_processes_of_job("again")


def test_a_death_recorded_by_a_shim_of_the_version_before_counts_as_it_did(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    key = TaskKey("old", 0)
    task_dir = ex.task_dir(key)
    task_dir.mkdir(parents=True)
    worker = ProcLaunch(argv=["python"], env={}, log=str(task_dir / "worker-1.log"), gpu=1, generation=2)
    taskfiles.write(
        task_dir / taskfiles.TASK_FILE,
        TaskDescription(procs=[worker], alive_file="alive", fence_after_s=60.0, kill_grace_s=1.0, elastic=True),
    )
    (task_dir / taskfiles.DEAD_WORKERS_FILE).write_text('[{"gpu":1,"code":3,"reason":"worker exited with code 3"}]')
    assert dead_of(ex, key) == [(1, 3)]
