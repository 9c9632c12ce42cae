"""The task shim: one small supervisor process per task (a job attempt's part on this node).

The agent starts ``python -m services.nodeagent.shim TASK_DIR`` in a session of
its own; the shim starts the job's processes in one process group, waits, and
writes how they ended to ``TASK_DIR/exit.json``. Everything the agent needs
to find the task again lives in ``TASK_DIR``, so an agent restart loses
nothing: the new agent adopts a live shim, or reads the exit record of one
that finished while no agent was there.

Three rules make "nothing runs twice at the same time" hold:
- one rank failing stops the other ranks of the task (they would hang in a collective), except
  in an elastic task: there each process is a worker, a dead one is reported to the agent (the
  job goes on with the survivors), workers that leave at a rescale exit on their own, and the
  agent adds workers by leaving ``grow-*.json`` files in the task folder. A worker the agent took
  from its warm pool (``pool.py``: its spec names its ``pid``) already runs: the shim watches it
  rather than starting it (it is the agent's child, in a process group of its own, which the
  shim signals with its own);
- on SIGTERM the shim sends SIGTERM to the whole process group, waits the
  grace period, then SIGKILLs the group (so no grandchild survives either);
- **fencing**: the agent touches ``alive_file`` after every heartbeat the log
  accepted. If it goes stale for ``fence_after_s`` (agent dead, or cut off from
  the log) the shim stops the task itself. The scheduler declares a node lost
  only after a longer silence, so by then nothing of the task is left to run
  next to its requeued attempt.

This module imports only the standard library, msgspec and the task folder's Structs
(``taskfiles.py``, which both sides use): it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from gpuherd import jobenv
from gpuherd.control import WorkerExit, encode_message
from gpuherd.train.standby import WARM_CUDA
from services.nodeagent import taskfiles
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

POLL_S = 0.1
STANDBY_REFILL_DELAY_S = 2.0  # after the task's workers started, or the last standby was taken


class Shim:
    def __init__(self, task_dir: Path) -> None:
        self.dir = task_dir
        spec = taskfiles.read(task_dir / taskfiles.TASK_FILE, TaskDescription)
        if spec is None:
            raise SystemExit(f"no {taskfiles.TASK_FILE} in {task_dir}")
        self.procs_spec: list[ProcLaunch] = list(spec.procs)
        self.cwd = spec.cwd
        self.alive_file = Path(spec.alive_file)
        self.fence_after_s = spec.fence_after_s
        self.kill_grace_s = spec.kill_grace_s
        self.stop_reason: str | None = None
        self.checkpoint_grace_s = 0.0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pgid: int | None = None
        self.elastic = spec.elastic
        self.agent_addr = spec.agent_addr
        self.job, self.attempt, self.node = spec.job, spec.attempt, spec.node
        self.reported: set[int] = set()  # elastic: indices of procs whose death the agent was told of
        self.deaths: list[WorkerDeath] = []
        self.standby: subprocess.Popen[bytes] | None = None  # elastic: the next worker, torch already imported
        self.standby_cuda: str | None = None
        self.attached: list[Attached] = []  # elastic: workers from the agent's warm pool
        self.standby_due: float | None = None  # monotonic: when to start the next standby
        self.started_at = 0.0
        self.start_ticks = 0  # when this process started (clock ticks since boot), written in shim.json

    def on_signal(self, signum: int, frame: object) -> None:
        if self.stop_reason is not None:
            return
        request = StopRequest()  # stays empty when stopped by hand rather than by the agent
        with contextlib.suppress(ValueError):
            request = taskfiles.read(self.dir / taskfiles.STOP_FILE, StopRequest) or request
        self.checkpoint_grace_s = request.checkpoint_grace_s
        self.stop_reason = request.reason or f"stopped by the agent ({signal.Signals(signum).name})"

    def launch(self, specs: list[ProcLaunch] | None = None) -> str | None:
        """Start every rank in one new process group (or watch it, one the agent's warm pool already
        started); the reason if one could not start."""
        if specs is not None and not specs:
            return None
        for rank, proc in enumerate(self.procs_spec if specs is None else specs, len(self.procs) if specs else 0):
            if proc.pid is not None:
                assert proc.exit_file is not None, "a pooled worker comes with its exit record's path"
                worker = Attached(proc.pid, proc.pid_start, Path(proc.exit_file))
                self.attached.append(worker)
                self.procs.append(worker)  # type: ignore[arg-type] - polled and waited like a child
                if specs is not None:
                    self.procs_spec.append(proc)
                continue
            with open(proc.log, "ab", buffering=0) as log:
                try:
                    child = subprocess.Popen(
                        proc.argv,
                        env=proc.env,
                        cwd=self.cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        process_group=self._group(),
                    )
                except Exception as exc:  # (ValueError for a NUL byte, TypeError, ...): a failed start, not a dead shim
                    reason = launch_failure(proc.argv[0], self.cwd, exc)
                    log.write(f"gpuherd: {reason}\n".encode())
                    return f"local rank {rank}: {reason}"
            if self.pgid is None:
                self.pgid = child.pid
            self.procs.append(child)
            if specs is not None:
                self.procs_spec.append(proc)
        return None

    def grow(self) -> None:
        """Elastic: start the workers the agent asked for (each request file is taken once)."""
        for request in sorted(self.dir.glob(taskfiles.GROW_PATTERN)):
            taken = request.with_suffix(".json.started")
            try:
                request.rename(taken)
                grown = taskfiles.read(taken, GrowRequest)
            except (OSError, ValueError):
                continue
            specs = grown.procs if grown is not None else []
            pooled = [spec for spec in specs if spec.pid is not None]  # already running: watch them
            self.launch(pooled)
            rest = self.hand_to_standby([spec for spec in specs if spec.pid is None])
            before = len(self.procs)
            failure = self.launch(rest)
            if failure is not None:
                gpu = rest[len(self.procs) - before].gpu  # the worker that could not start
                if gpu is not None:
                    self.tell_agent(WorkerExit(job=self.job, attempt=self.attempt, gpu=gpu, code=127, reason=failure))
        self.write_info()

    def start_standby(self) -> None:
        """Elastic: keep one interpreter with torch imported for the next worker a grow adds
        (``gpuherd.train.standby``): a grow then skips the seconds a new process takes to start."""
        template = self.procs_spec[0] if self.procs_spec else None
        if template is None or not is_python_script(template.argv) or self.stop_reason is not None:
            return
        env = dict(template.env)
        if env.get(jobenv.CUDA_VISIBLE_DEVICES):
            # Each worker is bound to its own GPU, and the next one's is not known yet: a CUDA
            # context made now would sit on the first worker's GPU, and the worker the standby
            # becomes would run there too. The context is made by the worker instead.
            env.pop(WARM_CUDA, None)
        # The devices the standby's CUDA context is made for (None: it makes none).
        self.standby_cuda = env.get(jobenv.CUDA_VISIBLE_DEVICES, "*") if env.get(WARM_CUDA) == "1" else None
        with open(self.dir / "standby.log", "ab", buffering=0) as log:
            try:
                self.standby = subprocess.Popen(
                    [template.argv[0], "-m", "gpuherd.train.standby"],
                    env=env,
                    cwd=self.cwd,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    process_group=self._group(),
                )
            except Exception:  # (as in ``launch``: a standby that cannot start is only not there)
                self.standby = None
                return
            if self.pgid is None:
                self.pgid = self.standby.pid  # every worker came from the pool: the standby leads the group

    def hand_to_standby(self, specs: list[ProcLaunch]) -> list[ProcLaunch]:
        """Give the first new worker to the standby (it becomes that worker); the rest start as new
        processes. Returns the specs still to launch."""
        standby, self.standby = self.standby, None
        if (
            standby is None
            or standby.poll() is not None
            or not specs
            or not is_python_script(specs[0].argv)
            or not self._standby_fits(specs[0])
        ):
            if standby is not None and standby.poll() is None:
                self.standby = standby  # not used this time
            return specs
        first, rest = specs[0], specs[1:]
        assert standby.stdin is not None
        try:
            launch = StandbyLaunch(argv=first.argv, env=first.env, cwd=self.cwd, log=first.log)
            standby.stdin.write(msgspec.json.encode(launch) + b"\n")
            standby.stdin.close()
        except OSError:
            return specs
        self.procs.append(standby)
        self.procs_spec.append(first)
        # The next standby imports torch a little later, not while the worker it just became does.
        self.standby_due = time.monotonic() + STANDBY_REFILL_DELAY_S
        return rest

    def _standby_fits(self, worker: ProcLaunch) -> bool:
        """A standby that made its CUDA context can only become a worker that sees the same GPUs."""
        return self.standby_cuda is None or worker.env.get(jobenv.CUDA_VISIBLE_DEVICES, "*") == self.standby_cuda

    def keep_standby(self) -> None:
        """Elastic: start the next standby once it is due (a while after the last one was taken)."""
        if self.standby is None and self.standby_due is not None and time.monotonic() >= self.standby_due:
            self.standby_due = None
            self.start_standby()
            self.write_info()

    def report_dead_workers(self) -> None:
        """Elastic: tell the agent of each worker that died (exit code other than 0)."""
        for index, proc in enumerate(self.procs):
            code = proc.poll()
            if code not in (None, 0) and index not in self.reported:
                self.reported.add(index)
                spec = self.procs_spec[index]
                gpu = spec.gpu
                death = WorkerDeath(
                    gpu=gpu, code=code, reason=f"worker {describe_exit(code)}", generation=spec.generation
                )
                self.deaths.append(death)
                # For an agent that missed the message:
                taskfiles.write(self.dir / taskfiles.DEAD_WORKERS_FILE, self.deaths)
                if gpu is not None:
                    exit_ = WorkerExit(job=self.job, attempt=self.attempt, gpu=gpu, code=code, reason=death.reason)
                    self.tell_agent(exit_)

    def tell_agent(self, message: WorkerExit) -> None:
        """One datagram to the agent's control socket (lost if no agent listens: the exit record
        keeps the codes for the next one)."""
        scheme, _, name = self.agent_addr.partition(":")
        if scheme != "unix-abstract" or not name:
            return
        message = msgspec.structs.replace(message, node=self.node, at=time.time())
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(encode_message(message), b"\0" + name.encode())

    def _group(self) -> int:
        """The process group for the next child: the task's, or a new one it will lead."""
        return 0 if self.pgid is None else self.pgid

    def write_info(self) -> None:
        info = ShimInfo(
            pid=os.getpid(),
            pgid=self.pgid,
            pids=[p.pid for p in self.procs],
            started_at=self.started_at,
            start_ticks=self.start_ticks,
            standby=self.standby.pid if self.standby is not None and self.standby.poll() is None else None,
            attached=[(w.pid, w.start_ticks) for w in self.attached],  # each leads a group of its own
            launched_at=time.time(),
        )
        taskfiles.write(self.dir / taskfiles.SHIM_FILE, info)

    def signal_group(self, sig: int) -> None:
        groups = [self.pgid] if self.pgid is not None else []
        # A pooled worker's group, while the worker lives (once it is gone its pid may be reused).
        groups += [w.pid for w in self.attached if w.poll() is None]
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)

    def fenced(self) -> bool:
        """Whether the agent has been out of contact for ``fence_after_s``: timed on the monotonic
        clock from when the shim last saw the alive file change, so a step of the wall clock (NTP,
        a skewed host) neither hides a silent agent (a step back) nor fences a live one (a step
        forward). Only the first look judges by the file's wall-clock age (a stale file at start)."""
        try:
            mtime: float | None = self.alive_file.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        now = time.monotonic()
        if not hasattr(self, "_alive_seen"):
            wall_age = float("inf") if mtime is None else max(0.0, time.time() - mtime)
            self._alive_seen, self._alive_changed = mtime, now - min(wall_age, 10 * self.fence_after_s)
        elif mtime != self._alive_seen:
            self._alive_seen, self._alive_changed = mtime, now
        age = now - self._alive_changed if mtime is not None else float("inf")
        if age > self.fence_after_s:
            self.stop_reason = f"fenced: the agent was out of contact with the log for {age:.1f}s"
            return True
        return False

    def checkpoint(self, grace_s: float) -> None:
        """Preemption: SIGUSR1 asks the ranks to save a checkpoint and exit; wait up to ``grace_s``."""
        self.signal_group(signal.SIGUSR1)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)

    def stop_all(self, grace_s: float) -> None:
        self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)
        self.signal_group(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def kill_leftovers(self) -> None:
        """SIGKILL what the task's processes left outside its process group (a grandchild that
        started a session of its own): its environment still names the task's folder."""
        for _ in range(3):  # (one being forked while its parent was killed shows up in the next pass)
            leftovers = task_processes(self.dir)
            if not leftovers:
                return
            for pid in leftovers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.started_at = started_at = time.time()
        # With the pid, names this process: an agent never signals a process its pid was given to later.
        self.start_ticks = process_start_ticks(os.getpid()) or 0
        info = ShimInfo(pid=os.getpid(), started_at=started_at, start_ticks=self.start_ticks)
        taskfiles.write(self.dir / taskfiles.SHIM_FILE, info)
        failure = self.launch() if self.stop_reason is None else None
        if self.elastic and failure is None:
            # Its standby imports torch once the workers have started, not while they do.
            self.standby_due = time.monotonic() + STANDBY_REFILL_DELAY_S
        self.write_info()
        first_failure: tuple[int, int] | None = None  # (local rank, exit code)
        not_started: int | None = None  # the process that could not start (its log says why)
        if failure is not None:
            not_started = len(self.procs)
            self.stop_all(self.kill_grace_s)
        else:
            while True:
                if self.elastic:
                    self.grow()
                    self.report_dead_workers()
                    self.keep_standby()
                codes = [p.poll() for p in self.procs]
                if all(c is not None for c in codes) and not (
                    self.elastic and any(self.dir.glob(taskfiles.GROW_PATTERN))
                ):
                    if self.elastic:
                        # The last worker may have died after the report above: a death the agent
                        # is not told of fails the whole attempt where the job would go on.
                        self.report_dead_workers()
                    break
                bad = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
                if bad is not None and not self.elastic:
                    first_failure = bad
                    self.stop_all(self.kill_grace_s)
                    break
                if self.stop_reason is not None:
                    if self.checkpoint_grace_s > 0:
                        self.checkpoint(self.checkpoint_grace_s)
                    self.stop_all(self.kill_grace_s)
                    break
                if self.fenced():
                    self.stop_all(min(self.kill_grace_s, 2.0))
                    break
                time.sleep(POLL_S)
            self.signal_group(signal.SIGKILL)  # whatever the ranks left behind (workers, helpers)
        self.kill_leftovers()
        codes = [p.returncode for p in self.procs]
        # An elastic task's dead workers were each reported (the job went on without them): the
        # task fails only if every worker died.
        judged = [
            r
            for r in range(len(codes))
            if not (self.elastic and r in self.reported and len(self.reported) < len(codes))
        ]
        if failure is None and first_failure is None:
            first_failure = next(((r, codes[r]) for r in judged if codes[r] != 0), None)
        if failure is None and first_failure is not None and self.stop_reason is None:
            rank, code = first_failure
            failure = f"local rank {rank} {describe_exit(code)}"
        record = ExitRecord(
            codes=codes,
            failure=failure,
            failed_rank=not_started if first_failure is None else first_failure[0],
            stopped=self.stop_reason,
            ended_at=time.time(),
            logs=[spec.log for spec in self.procs_spec],  # (aligned with ``self.procs``: each started in that order)
        )
        taskfiles.write(self.dir / taskfiles.EXIT_FILE, record)
        return 0


def is_python_script(argv: list[str]) -> bool:
    """``python script.py ...``: what a standby (``gpuherd.train.standby``) can become."""
    return len(argv) >= 2 and argv[1].endswith(".py") and not argv[1].startswith("-")


def process_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first; the start time,
    clock ticks since boot, at 19), or None if the process is gone or not ours to read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def task_processes(task_dir: Path) -> dict[int, int]:
    """The live processes whose environment names ``task_dir`` (the executor gives every rank
    ``GPUHERD_TASK_DIR``; what a rank starts inherits it): pid -> process group. It names the
    task's processes however long ago the pids in its files were written (they may be reused)."""
    needle = f"{jobenv.TASK_DIR}={task_dir}".encode()
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue  # gone meanwhile, or not ours to read
        fields = process_stat(entry.name)
        if fields is not None and fields[0] != "Z":
            found[int(entry.name)] = int(fields[2])
    return found


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot): with the pid, it names one process."""
    fields = process_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def process_alive(pid: int, start_ticks: int) -> bool:
    """Whether the process that started at ``start_ticks`` as ``pid`` still runs (not a zombie)."""
    fields = process_stat(pid)
    return fields is not None and fields[0] != "Z" and (not start_ticks or fields[19] == str(start_ticks))


EXIT_RECORD_GRACE_S = 2.0  # a pooled worker that is gone: how long its exit record may take to appear


class Attached:
    """A worker the agent's warm pool started: watched like a child (``poll``, ``wait``,
    ``returncode``), though it is not one. Its exit code comes from its exit record (written by the
    worker when its script ends, or by the agent when it reaps it); a worker gone without one
    (killed while no agent was there to see) counts as killed by SIGKILL."""

    def __init__(self, pid: int, start_ticks: int, exit_file: Path) -> None:
        self.pid, self.start_ticks, self.exit_file = pid, start_ticks, exit_file
        self.returncode: int | None = None
        self._gone_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if process_alive(self.pid, self.start_ticks):
            return None
        with contextlib.suppress(OSError, ValueError):  # (ValueError: being written)
            record = taskfiles.read(self.exit_file, WorkerExitRecord)
            if record is not None:
                self.returncode = record.code
                return self.returncode
        now = time.monotonic()
        self._gone_at = self._gone_at or now
        if now - self._gone_at < EXIT_RECORD_GRACE_S:
            return None
        self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode


def launch_failure(program: str, cwd: str | None, exc: Exception) -> str:
    """Why a process could not start. A working directory it cannot enter fails the start with the
    program's error and the directory as the file name: name the directory, not the program. What
    is no OSError (``ValueError: embedded null byte``) is named with its type."""
    if not isinstance(exc, OSError):
        return f"cannot start {program!r}: {type(exc).__name__}: {exc}"
    if cwd is not None and exc.filename == cwd:
        problem = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be entered ({exc.strerror})"
        return f"cannot start {program!r}: its working directory {cwd!r} {problem} on this node"
    return f"cannot start {program!r}: {exc.strerror or exc}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not start"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m services.nodeagent.shim TASK_DIR")
    raise SystemExit(Shim(Path(sys.argv[1])).run())


if __name__ == "__main__":
    main()
