"""What reaches a node agent from a job's own processes, or from the spec it runs, is checked
before it can stop the agent's work: a process the shim cannot start (a NUL byte in its
arguments, environment or working directory) is a failed launch, not a dead shim."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest

from gpuherd import events as ev
from services.nodeagent import taskfiles
from services.nodeagent.executors import TaskKey, TaskLaunch
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.shim import Shim
from services.nodeagent.taskfiles import ExitRecord, ProcLaunch, TaskDescription

# -- the shim: any exception Popen raises is a launch failure ----------------------------------------


def run_shim(tmp_path: Path, proc: ProcLaunch, cwd: str | None = None) -> ExitRecord:
    alive = tmp_path / "alive"
    alive.touch()
    task = TaskDescription(procs=[proc], alive_file=str(alive), fence_after_s=30.0, kill_grace_s=1.0, cwd=cwd)
    (tmp_path / taskfiles.TASK_FILE).write_bytes(msgspec.json.encode(task))
    assert Shim(tmp_path).run() == 0
    record = taskfiles.read(tmp_path / taskfiles.EXIT_FILE, ExitRecord)
    assert record is not None, "the shim wrote its exit record"
    return record


@pytest.mark.parametrize(
    ("argv", "env", "cwd"),
    [
        (["true"], {"A": "a\0b"}, None),
        (["tr\0ue"], {}, None),
        (["true"], {}, "/tmp\0x"),
    ],
)
def test_a_process_popen_refuses_is_a_failed_launch_with_an_exit_record(
    tmp_path: Path, argv: list[str], env: dict[str, str], cwd: str | None
) -> None:
    log = tmp_path / "rank-0.log"
    record = run_shim(tmp_path, ProcLaunch(argv=argv, env=env, log=str(log)), cwd)
    failure = record.failure or ""
    assert failure.startswith("local rank 0: cannot start") and "ValueError: embedded null byte" in failure
    assert record.failed_rank == 0 and record.codes == [] and record.stopped is None
    assert "embedded null byte" in log.read_text(), "the rank's log says why, for the output tail"


def test_a_process_that_starts_is_run_as_before(tmp_path: Path) -> None:
    record = run_shim(tmp_path, ProcLaunch(argv=["true"], env={"A": "b"}, log=str(tmp_path / "rank-0.log")))
    assert record.failure is None and record.codes == [0]


async def test_the_executor_reports_such_a_task_failed_so_the_job_is_not_requeued(tmp_path: Path) -> None:
    """Before, the shim died on ``ValueError``, the executor found no exit record and reported the
    task ``stopped``, and the scheduler requeued the job at every attempt."""
    alive = tmp_path / "alive"
    alive.touch()
    executor = CpuExecutor(tmp_path, gpus=1, island=0, alive_file=alive, fence_after_s=30.0, kill_grace_s=1.0)
    executor.node = "n1"
    spec = ev.JobSpec(name="t", user="u", gpus=1, command=(sys.executable, "-c", "pass"), env={"A": "a\0b"})
    try:
        await executor.start(TaskLaunch(key=TaskKey("j1", 0), spec=spec, gpus=(0,)))
        ended = await asyncio.wait_for(executor.exits.get(), 30)
    finally:
        await executor.shutdown()
    assert ended.outcome == "failed", ended
    assert "ValueError: embedded null byte" in ended.reason and "embedded null byte" in ended.output_tail
