"""The cpu executor with real processes (no NATS): life cycle, failure, stop, adoption, fencing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuherd import events as ev
from services.nodeagent.executors import TaskExit, TaskKey, TaskLaunch
from services.nodeagent.executors.cpu import CpuExecutor

pytestmark = pytest.mark.timeout(60)


def executor(tmp_path: Path, *, fence_after_s: float = 30.0, kill_grace_s: float = 2.0) -> CpuExecutor:
    alive = tmp_path / "alive"
    alive.touch()
    ex = CpuExecutor(
        tmp_path, gpus=4, island=2, alive_file=alive, fence_after_s=fence_after_s, kill_grace_s=kill_grace_s
    )
    ex.node = "n1"
    return ex


def launch(job: str, code: str, *, procs: int = 1, attempt: int = 0, resume: bool = False) -> TaskLaunch:
    spec = ev.JobSpec(name=job, user="u", gpus=procs, command=(sys.executable, "-c", code), env={"GREETING": "hi"})
    return TaskLaunch(
        key=TaskKey(job, attempt),
        spec=spec,
        gpus=tuple(range(procs)),
        procs=procs,
        world_size=procs,
        rendezvous=ev.Rendezvous("127.0.0.1", 29999),
        resume=resume,
    )


async def exit_of(ex: CpuExecutor, timeout: float = 30.0) -> TaskExit:
    """The next task end the executor queued (as the agent's exits loop takes them)."""
    return await asyncio.wait_for(ex.exits.get(), timeout)


def pids_of_job(job: str) -> list[int]:
    """Processes (anywhere on this machine) whose environment names the job: our orphan detector."""
    needle = f"GPUHERD_JOB_ID={job}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def kill_processes_of_job(job: str) -> None:
    """A test's cleanup, also when it failed: nothing of the job may outlive it."""
    for pid in pids_of_job(job):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_each_rank_gets_its_env_and_output_is_kept(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    code = (
        "import os; print(' '.join(os.environ[k] for k in ('RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE',"
        "'MASTER_ADDR','MASTER_PORT','GPUHERD_JOB_ID','GPUHERD_VIRTUAL_GPUS','GREETING')),"
        " repr(os.environ['CUDA_VISIBLE_DEVICES']))"
    )
    await ex.start(launch("env1", code, procs=2))
    done = await exit_of(ex)
    assert done.outcome == "completed" and done.exit_code == 0
    out = ex.output(TaskKey("env1", 0))
    assert out["rank-0.log"].strip() == "0 2 0 2 127.0.0.1 29999 env1 0,1 hi ''"
    assert out["rank-1.log"].strip() == "1 2 1 2 127.0.0.1 29999 env1 0,1 hi ''"
    assert ex.running() == set()


async def test_one_failing_rank_stops_the_others_and_reports_its_output(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    code = (
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '1':\n"
        "    print('rank one gives up', file=sys.stderr); sys.exit(5)\n"
        "time.sleep(60)"
    )
    await ex.start(launch("fail1", code, procs=2))
    done = await exit_of(ex)
    assert done.outcome == "failed" and done.exit_code == 5
    assert "local rank 1 exited with code 5" in done.reason
    assert "rank one gives up" in done.output_tail
    await wait_until(lambda: not pids_of_job("fail1"))


async def test_a_command_that_does_not_exist_fails_with_a_reason(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    bad = launch("nocmd", "")
    bad = TaskLaunch(key=bad.key, spec=ev.JobSpec(name="x", user="u", gpus=1, command=("/no/such/binary",)), gpus=(0,))
    await ex.start(bad)
    done = await exit_of(ex)
    assert done.outcome == "failed" and "cannot start '/no/such/binary'" in done.reason


async def test_a_working_directory_that_does_not_exist_is_named_as_the_reason(tmp_path: Path) -> None:
    ex = executor(tmp_path)
    missing = str(tmp_path / "no-such-dir")
    spec = ev.JobSpec(name="x", user="u", gpus=1, command=(sys.executable, "-c", "print(1)"), workdir=missing)
    await ex.start(TaskLaunch(key=TaskKey("nowd", 0), spec=spec, gpus=(0,)))
    done = await exit_of(ex)
    # Not "cannot start '.../python': No such file or directory", which sends users after the interpreter.
    assert done.outcome == "failed" and f"working directory {missing!r} does not exist" in done.reason
    assert f"working directory {missing!r}" in done.output_tail


async def test_stop_terminates_the_whole_process_group_including_grandchildren(tmp_path: Path) -> None:
    ex = executor(tmp_path, kill_grace_s=1.0)
    # The rank ignores SIGTERM and leaves a grandchild behind: only SIGKILL of the group ends both.
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('ready', flush=True); time.sleep(60)"
    )
    await ex.start(launch("stop1", code))
    await wait_until(lambda: "ready" in ex.output(TaskKey("stop1", 0)).get("rank-0.log", ""))
    assert len(pids_of_job("stop1")) == 2
    stopped = await ex.stop(TaskKey("stop1", 0), "cancelled on request")
    assert stopped is not None and stopped.outcome == "stopped" and stopped.reason == "cancelled on request"
    assert pids_of_job("stop1") == []
    assert ex.exits.empty(), "a stopped task is not reported as exited"


async def test_a_new_executor_adopts_a_running_task_and_sees_it_end(tmp_path: Path) -> None:
    first = executor(tmp_path)
    await first.start(launch("adopt1", "import time; time.sleep(1.5); print('done')"))
    await wait_until(lambda: bool(pids_of_job("adopt1")))
    await first.shutdown()  # an agent restart: the shim keeps running
    second = executor(tmp_path)
    assert await second.recover() == {TaskKey("adopt1", 0)}
    await second.start(launch("adopt1", "raise SystemExit(9)", resume=True))  # must not start twice
    done = await exit_of(second)
    assert done.outcome == "completed" and "done" in done.output_tail


async def test_a_task_that_ended_while_no_agent_ran_is_reported_from_its_exit_record(tmp_path: Path) -> None:
    first = executor(tmp_path)
    await first.start(launch("gone1", "import sys; sys.exit(4)"))
    await first.shutdown()
    await wait_until(lambda: (tmp_path / "jobs" / "gone1" / "attempt-0" / "exit.json").exists())
    second = executor(tmp_path)
    await second.recover()
    await second.start(launch("gone1", "", resume=True))
    done = await exit_of(second)
    assert done.outcome == "failed" and done.exit_code == 4


async def test_the_shim_fences_the_task_when_the_agent_goes_silent(tmp_path: Path) -> None:
    ex = executor(tmp_path, fence_after_s=1.0, kill_grace_s=0.5)
    await ex.start(launch("fence1", "import time; time.sleep(60)"))
    os.utime(tmp_path / "alive", (time.time() - 100, time.time() - 100))  # the agent stopped touching it
    done = await exit_of(ex, timeout=20)
    assert done.outcome == "stopped" and done.reason.startswith("fenced")
    assert pids_of_job("fence1") == []


SHIM = "services.nodeagent.shim"


async def test_an_upgraded_agent_adopts_a_task_whose_shim_the_previous_version_started(tmp_path: Path) -> None:
    """The previous version's shim outlived its agent: it is played here by a process with a shim's
    command line that writes the task's files as that version did (untyped dicts)."""
    folder = tmp_path / "jobs" / "old1" / "attempt-0"
    folder.mkdir(parents=True)
    proc = {"argv": [sys.executable, "-c", "pass"], "env": {}, "log": str(folder / "rank-0.log")}
    task = {"job": "old1", "attempt": 0, "procs": [proc], "cwd": None, "alive_file": str(tmp_path / "alive"),
            "fence_after_s": 30.0, "kill_grace_s": 2.0, "elastic": False, "agent_addr": "", "node": "n1"}  # fmt: skip
    (folder / "task.json").write_text(json.dumps(task))
    (folder / "rank-0.log").write_text("trained by the old version\n")
    exit_record = {"codes": [0], "failure": None, "failed_rank": None, "stopped": None, "ended_at": time.time()}
    record = f"open({str(folder / 'exit.json')!r}, 'w').write({json.dumps(exit_record)!r})"
    shim = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(1.5); {record}", SHIM, str(folder)])
    try:
        await wait_until(lambda: SHIM.encode() in Path(f"/proc/{shim.pid}/cmdline").read_bytes())  # (exec'd)
        info = {"pid": shim.pid, "pgid": None, "pids": [], "started_at": time.time(), "standby": None,
                "attached": [], "launched_at": time.time()}  # fmt: skip
        (folder / "shim.json").write_text(json.dumps(info))
        ex = executor(tmp_path)
        assert await ex.recover() == {TaskKey("old1", 0)}
        done = await exit_of(ex)
        assert done.outcome == "completed" and "trained by the old version" in done.output_tail
    finally:
        shim.kill()
        shim.wait()


async def test_recover_kills_the_processes_of_a_task_whose_shim_was_killed_while_no_agent_ran(tmp_path: Path) -> None:
    """Nothing supervises them any more (no shim to stop or fence them): whatever the log says of
    the task, the next agent's recover ends them, and the task reads as ended if it is resumed."""
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('ready', flush=True); time.sleep(60)"
    )
    try:
        first = executor(tmp_path)
        await first.start(launch("orphan1", code))
        await wait_until(lambda: len(pids_of_job("orphan1")) == 2)  # the rank and its child
        await first.shutdown()
        shim = json.loads((tmp_path / "jobs/orphan1/attempt-0/shim.json").read_text())["pid"]
        os.kill(shim, signal.SIGKILL)
        await wait_until(lambda: not Path(f"/proc/{shim}").exists())  # (reaped)
        second = executor(tmp_path)
        assert await second.recover() == set(), "a dead shim is not adopted"
        assert pids_of_job("orphan1") == [], "its rank and the rank's child were killed"
        await second.start(launch("orphan1", "raise SystemExit(9)", resume=True))  # the log still places it here
        done = await exit_of(second)
        assert done.outcome == "stopped" and "shim died" in done.reason
    finally:
        kill_processes_of_job("orphan1")


async def test_recover_waits_for_the_killed_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for killed processes to be gone (up to seconds for one stuck in the kernel) runs in a
    thread: on the agent's loop it stopped its heartbeats, and the node's other tasks fenced."""
    from services.nodeagent.executors import process

    real = process._kill_leftovers
    killing, loop_ran, seen = threading.Event(), threading.Event(), []

    def slow_kill(task_dir: Path, info: object) -> int:
        killing.set()
        seen.append((threading.current_thread() is threading.main_thread(), loop_ran.wait(timeout=10)))
        return real(task_dir, info)  # type: ignore[arg-type]

    async def the_loop_runs_meanwhile() -> None:
        while not killing.is_set():
            await asyncio.sleep(0.01)
        loop_ran.set()

    try:
        first = executor(tmp_path)
        await first.start(launch("orphan2", "print('ready', flush=True); import time; time.sleep(60)"))
        await wait_until(lambda: len(pids_of_job("orphan2")) == 1)
        await first.shutdown()
        shim = json.loads((tmp_path / "jobs/orphan2/attempt-0/shim.json").read_text())["pid"]
        os.kill(shim, signal.SIGKILL)
        await wait_until(lambda: not Path(f"/proc/{shim}").exists())
        monkeypatch.setattr(process, "_kill_leftovers", slow_kill)
        meanwhile = asyncio.create_task(the_loop_runs_meanwhile())
        assert await executor(tmp_path).recover() == set()
        await meanwhile
        assert seen == [(False, True)], "killed in a thread, while the loop went on"
        assert pids_of_job("orphan2") == []
    finally:
        kill_processes_of_job("orphan2")


def spawn_at_pid(pid: int, argv: list[str]) -> subprocess.Popen[bytes] | None:
    """A new process given ``pid``, as the kernel gives a freed pid once pids wrap around: the pid
    namespace's last pid is set just below it before the fork (root only). None if it cannot be."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    for _ in range(50):  # another fork on the machine may take the pid between the write and ours
        try:
            last_pid.write_text(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(argv, start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.parametrize("stranger", ["an unrelated program", "the shim of attempt 10"])
async def test_stopping_an_adopted_task_never_signals_a_process_that_reused_its_shim_s_pid(
    tmp_path: Path, stranger: str
) -> None:
    """The adopted shim died and the kernel gave its pid to another process before the executor's
    watcher looked again: the stop must not send that process the shim's SIGTERM."""
    folder = tmp_path / "jobs" / "reuse1" / "attempt-1"
    folder.mkdir(parents=True)
    proc = {"argv": [sys.executable, "-c", "pass"], "env": {}, "log": str(folder / "rank-0.log")}
    task = {"job": "reuse1", "attempt": 1, "procs": [proc], "alive_file": str(tmp_path / "alive"),
            "fence_after_s": 30.0, "kill_grace_s": 2.0}  # fmt: skip
    (folder / "task.json").write_text(json.dumps(task))
    # The shim a previous agent started, played by a process with a shim's command line.
    shim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", SHIM, str(folder)])
    other: subprocess.Popen[bytes] | None = None
    try:
        await wait_until(lambda: SHIM.encode() in Path(f"/proc/{shim.pid}/cmdline").read_bytes())  # (exec'd)
        (folder / "shim.json").write_text(json.dumps({"pid": shim.pid, "started_at": time.time()}))
        ex = executor(tmp_path)
        assert await ex.recover() == {TaskKey("reuse1", 1)}
        # From here to the stop nothing awaits: the executor's watcher cannot see the shim go.
        shim.kill()
        shim.wait()
        argv = ["sleep", "30"]
        if stranger == "the shim of attempt 10":  # its folder's name begins with this task's folder's
            argv = [sys.executable, "-c", "import time; time.sleep(30)", SHIM, str(folder.parent / "attempt-10")]
        other = spawn_at_pid(shim.pid, argv)
        if other is None:
            pytest.skip("this machine does not let a test choose the next pid (ns_last_pid)")
        stopped = await ex.stop(TaskKey("reuse1", 1), "cancelled on request")
        assert stopped is not None and stopped.outcome == "stopped"
        assert other.poll() is None, f"{stranger} that reused the shim's pid was signalled"
    finally:
        for process in (shim, other):
            if process is not None:
                process.kill()
                process.wait()


async def test_an_elastic_task_s_output_tail_is_the_failed_worker_s_after_a_grow(tmp_path: Path) -> None:
    """The task started with the worker of GPU 2 and grew onto GPU 0: the worker the reason names
    (the first to die, in launch order) is the one whose output the tail shows, not the log that
    sorts first by GPU."""
    code = (
        "import os, pathlib, sys, time\n"
        "gpu = os.environ['GPUHERD_GPU']\n"
        "print(f'worker of gpu {gpu} is up', flush=True)\n"
        "go = pathlib.Path(os.environ['GPUHERD_TASK_DIR']) / 'go'\n"
        "while not go.exists(): time.sleep(0.05)\n"
        "if gpu == '0': time.sleep(0.5)  # dies second\n"
        "print(f'worker of gpu {gpu} gives up', flush=True)\n"
        "sys.exit(3 if gpu == '2' else 4)\n"
    )
    spec = ev.JobSpec(name="el1", user="u", gpus=1, command=(sys.executable, "-c", code))
    key = TaskKey("el1", 0)
    folder = tmp_path / "jobs" / "el1" / "attempt-0"
    ex = executor(tmp_path)
    try:
        await ex.start(TaskLaunch(key=key, spec=spec, gpus=(2,), procs=1, elastic=True))
        await wait_until(lambda: "is up" in ex.output(key).get("worker-2.log", ""))
        assert ex.grow(key, TaskLaunch(key=key, spec=spec, gpus=(0,), procs=1, elastic=True))
        await wait_until(lambda: "is up" in ex.output(key).get("worker-0.log", ""))
        (folder / "go").touch()
        done = await exit_of(ex)
        assert done.outcome == "failed" and done.exit_code == 3 and "local rank 0 exited with code 3" in done.reason
        assert "worker of gpu 2 gives up" in done.output_tail
        assert "gpu 0" not in done.output_tail, "the tail is the failed worker's, not the grown one's"
    finally:
        kill_processes_of_job("el1")
