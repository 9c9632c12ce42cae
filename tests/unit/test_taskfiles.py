"""The task folder's files, typed: the agent and the shim write and read the same Structs, and an
agent of this version reads the files a task started by the previous version holds (an upgraded
agent adopts the shims that outlived the old one), and writes what such a shim reads.

The ``PREVIOUS_*`` values are the dicts the previous version wrote, as it wrote them (``json.dumps``
of untyped dicts; keys absent where it left them out)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from services.nodeagent import taskfiles
from services.nodeagent.executors.base import TaskKey
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.executors.process import exit_from_record
from services.nodeagent.taskfiles import (
    ExitRecord,
    GrowRequest,
    ProcLaunch,
    ShimInfo,
    StandbyLaunch,
    StopRequest,
    TaskDescription,
    WorkerDeath,
    WorkerExitRecord,
)

ENV = {"RANK": "0", "PYTHONUNBUFFERED": "1"}
PREVIOUS_TASK = {
    "job": "e",
    "attempt": 2,
    "procs": [
        {"argv": ["/usr/bin/python3", "train.py"], "env": ENV, "log": "/t/worker-0.log", "gpu": 0},
        {  # a worker the previous agent took from its warm pool
            "argv": ["/usr/bin/python3", "train.py"],
            "env": ENV,
            "log": "/t/worker-1.log",
            "gpu": 1,
            "pid": 4242,
            "pid_start": 987654,
            "exit_file": "/t/worker-1.exit",
        },
    ],
    "cwd": None,
    "alive_file": "/data/alive",
    "fence_after_s": 4.0,
    "kill_grace_s": 10.0,
    "elastic": True,
    "agent_addr": "unix-abstract:gpuherd-n1",
    "node": "n1",
}
PREVIOUS_PLAIN_PROC = {"argv": ["/bin/true"], "env": ENV, "log": "/t/rank-3.log"}  # no gpu, no pid
PREVIOUS_SHIM_AT_START = {"pid": 77, "started_at": 1700000000.5}  # before its processes run
PREVIOUS_SHIM = {
    "pid": 77,
    "pgid": 78,
    "pids": [78, 4242],
    "started_at": 1700000000.5,
    "standby": None,
    "attached": [[4242, 987654]],
    "launched_at": 1700000001.0,
}
PREVIOUS_EXIT = {"codes": [0, -9], "failure": "local rank 1 was killed by SIGKILL", "failed_rank": 1,
                 "stopped": None, "ended_at": 1700000100.0}  # fmt: skip
PREVIOUS_DEAD = [{"gpu": 1, "code": -9, "reason": "worker was killed by SIGKILL"}]


def test_the_previous_version_s_files_decode_as_they_were_written() -> None:
    task = _decode(PREVIOUS_TASK, TaskDescription)
    assert (task.job, task.attempt, task.elastic, task.node, task.cwd) == ("e", 2, True, "n1", None)
    assert (task.alive_file, task.fence_after_s, task.kill_grace_s) == ("/data/alive", 4.0, 10.0)
    cold, pooled = task.procs
    assert (cold.gpu, cold.pid, cold.exit_file) == (0, None, None)
    assert (pooled.gpu, pooled.pid, pooled.pid_start, pooled.exit_file) == (1, 4242, 987654, "/t/worker-1.exit")
    plain = _decode(PREVIOUS_PLAIN_PROC, ProcLaunch)
    assert (plain.argv, plain.gpu, plain.pid, plain.pid_start) == (["/bin/true"], None, None, 0)
    assert _decode(PREVIOUS_SHIM_AT_START, ShimInfo) == ShimInfo(pid=77, started_at=1700000000.5)
    shim = _decode(PREVIOUS_SHIM, ShimInfo)
    assert (shim.pgid, shim.pids, shim.standby, shim.attached) == (78, [78, 4242], None, [(4242, 987654)])
    record = _decode(PREVIOUS_EXIT, ExitRecord)
    assert (record.codes, record.failed_rank, record.stopped) == ([0, -9], 1, None)
    assert _decode(PREVIOUS_DEAD, list[WorkerDeath]) == [WorkerDeath(gpu=1, code=-9, reason=PREVIOUS_DEAD[0]["reason"])]
    assert _decode({"code": 3, "by": "worker"}, WorkerExitRecord) == WorkerExitRecord(code=3, by="worker")
    assert _decode({"reason": "preempted", "checkpoint_grace_s": 30.0}, StopRequest).checkpoint_grace_s == 30.0
    # The oldest task files named neither job nor node: they read with their defaults.
    oldest = {k: v for k, v in PREVIOUS_TASK.items() if k not in ("job", "attempt", "elastic", "agent_addr", "node")}
    assert _decode(oldest, TaskDescription).elastic is False


def test_what_this_version_writes_reads_as_the_previous_version_read_it() -> None:
    """A shim of the previous version, adopted by this agent, reads the grows and stops it writes:
    a worker that runs already is one whose spec has a ``pid`` key, the others have none."""
    cold = ProcLaunch(argv=["python", "train.py"], env=ENV, log="/t/worker-2.log", gpu=2)
    pooled = ProcLaunch(argv=["python", "train.py"], env=ENV, log="/t/worker-3.log", gpu=3, pid=9, pid_start=5,
                        exit_file="/t/worker-3.exit")  # fmt: skip
    first, second = json.loads(_encode(GrowRequest(procs=[cold, pooled])))["procs"]
    assert "pid" not in first and first == {"argv": cold.argv, "env": ENV, "log": cold.log, "gpu": 2}
    assert (second["pid"], second.get("pid_start") or 0, second["exit_file"]) == (9, 5, "/t/worker-3.exit")
    assert json.loads(_encode(StopRequest(reason="for b", checkpoint_grace_s=20.0))) == {
        "reason": "for b",
        "checkpoint_grace_s": 20.0,
    }
    launch = json.loads(_encode(StandbyLaunch(argv=cold.argv, env=ENV, cwd=None, log=cold.log, exit_file="/x")))
    assert launch == {"argv": cold.argv, "env": ENV, "cwd": None, "log": cold.log, "exit_file": "/x"}
    task = TaskDescription(procs=[cold], alive_file="/a", fence_after_s=4.0, kill_grace_s=1.0)
    assert _decode(json.loads(_encode(task)), TaskDescription) == task


def test_an_unreadable_task_file_says_which_and_why(tmp_path: Path) -> None:
    path = tmp_path / taskfiles.SHIM_FILE
    assert taskfiles.read(path, ShimInfo) is None  # not there yet
    path.write_text('{"pid": "seventy-seven"}')
    with pytest.raises(taskfiles.UnreadableTaskFile, match=r"shim\.json.*Expected `int`"):
        taskfiles.read(path, ShimInfo)


def test_an_agent_of_this_version_reads_a_folder_the_previous_version_wrote(tmp_path: Path) -> None:
    executor = CpuExecutor(tmp_path, gpus=4, alive_file=tmp_path / "alive")
    key = TaskKey("e", 2)
    folder = executor.task_dir(key)
    folder.mkdir(parents=True)
    (folder / "task.json").write_text(json.dumps(PREVIOUS_TASK))
    grow = {"procs": [{"argv": ["python", "train.py"], "env": ENV, "log": "/t/worker-3.log", "gpu": 3}]}
    (folder / "grow-0000.json.started").write_text(json.dumps(grow))  # one the shim took
    (folder / "dead-workers.json").write_text(json.dumps(PREVIOUS_DEAD))
    (folder / "shim.json").write_text(json.dumps(PREVIOUS_SHIM))
    workers = executor.workers(key)
    assert workers.launched == {0, 1, 3}
    assert workers.dead == (WorkerDeath(gpu=1, code=-9, reason="worker was killed by SIGKILL"),)
    (folder / "worker-1.log").write_text("step 9\nKilled\n")
    ended = exit_from_record(key, _decode(PREVIOUS_EXIT, ExitRecord), folder, stopping=None)
    assert (ended.outcome, ended.exit_code, ended.reason) == ("failed", 137, "local rank 1 was killed by SIGKILL")
    assert "Killed" in ended.output_tail


def _decode(value: object, kind: type) -> object:
    return msgspec.json.decode(json.dumps(value).encode(), type=kind)


def _encode(value: object) -> bytes:
    return msgspec.json.encode(value)
