"""Executors that run a job's real processes (``cpu`` and ``nvml`` build on this).

Each task gets a folder ``<data>/jobs/<job>/attempt-<n>/`` holding its launch
description (``task.json``), its shim's pid and process group (``shim.json``),
one log file per rank and, once it ended, ``exit.json`` (their types: ``taskfiles.py``).
The folder is the executor's whole memory: after an agent restart, :meth:`recover`
adopts every live shim and reports tasks that ended while no agent was there.

With ``warm_workers`` > 0 the executor keeps a pool of warm interpreters (``pool.py``) and an
elastic task's new workers become them: at the task's start (the job's first generation here,
or a grow onto this node) and at a grow within it (after the task's own standby, which the shim
keeps, has taken the first). Their specs then name their ``pid``: the shim watches them.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec

from gpuherd import jobenv
from gpuherd.aio import off_loop
from gpuherd.control import MessageError, RescaleReport, decode_message
from gpuherd.events import MAX_OUTPUT_TAIL
from gpuherd.jobenv import ElasticPlan
from gpuherd.obs import get_logger
from gpuherd.train.report import LEFT_PATTERN, RESCALE_COMPLETED_FILE, left_file
from services.nodeagent import taskfiles
from services.nodeagent.executors.base import Executor, TaskExit, TaskKey, TaskLaunch, TaskWorkers
from services.nodeagent.pool import WarmPool
from services.nodeagent.shim import process_alive, process_start_ticks
from services.nodeagent.shim import task_processes as _task_processes
from services.nodeagent.taskfiles import (
    ExitRecord,
    GrowRequest,
    ProcLaunch,
    ShimInfo,
    StandbyLaunch,
    StopRequest,
    TaskDescription,
    WorkerDeath,
)

log = get_logger("gpuherd.nodeagent.executor")

TAIL_LINES = 30
SHIM_DIED = "the task's shim died without an exit record"
_PROFILE_FILE = re.compile(r"profile-rank\d+\.json")


@dataclass
class _Task:
    key: TaskKey
    dir: Path
    gpus: tuple[int, ...] = ()
    pid: int | None = None  # its shim's
    pid_start: int = 0  # when that shim started (clock ticks since boot; 0: not known)
    stopping: str | None = None
    watcher: asyncio.Task[None] | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    exit: TaskExit | None = None

    def shim_running(self) -> bool:
        """Whether the task's shim still runs: the very process, not one its pid was given to since."""
        return _is_shim(self.pid, self.dir, self.pid_start)


class ProcessExecutor(Executor):
    """Runs each task under a shim (see ``services/nodeagent/shim.py``)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        alive_file: Path,
        agent_addr: str = "",
        fence_after_s: float = 4.0,
        kill_grace_s: float = 10.0,
        warm_workers: int = 0,
        warm_min_free_mb: int | None = None,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.alive_file = alive_file
        self.agent_addr = agent_addr
        self.fence_after_s = fence_after_s
        self.kill_grace_s = kill_grace_s
        self.warm_workers = warm_workers
        self.warm_min_free_mb = default_min_free_mb() if warm_min_free_mb is None else warm_min_free_mb
        self.pool: WarmPool | None = None
        # This node's GPUs no job holds; the agent sets it from what it folded (warm workers pin to them).
        self.idle_gpus: Callable[[], list[int]] = list
        self._tasks: dict[TaskKey, _Task] = {}
        self._node_gpus: list[int] | None = None

    # -- what differs between cpu and nvml ---------------------------------------------------

    @abc.abstractmethod
    def device_env(self, gpus: tuple[int, ...], local_rank: int, neighbors: tuple[int, ...] = ()) -> dict[str, str]:
        """Environment that binds one process to the task's GPUs; ``neighbors`` (GPUs it may lease
        memory of) are visible after them, so the process's own devices keep their ordinals."""

    def warm_pin(self, pinned: set[int]) -> int | None:
        """The GPU the next warm worker creates its CUDA context on (None: none; any GPU)."""
        return None

    def warm_pin_env(self, gpu: int) -> dict[str, str]:
        """The environment of a warm worker pinned to ``gpu``."""
        return self.device_env((gpu,), 0)

    # -- the warm pool -----------------------------------------------------------------------

    def start_pool(self) -> WarmPool | None:
        """Start keeping ``warm_workers`` warm interpreters (in the running event loop)."""
        if self.pool is None and self.warm_workers > 0:
            self.pool = WarmPool(
                self.warm_workers,
                self.data_dir / "pool",
                min_free_mb=self.warm_min_free_mb,
                pin=self.warm_pin,
                pin_env=self.warm_pin_env,
                pin_free=lambda gpu: gpu in self.idle_gpus(),
            )
            self.pool.start()
        return self.pool

    def _take_warm(self, procs: list[ProcLaunch], task_dir: Path, cwd: str | None) -> list[ProcLaunch]:
        """Hand as many of ``procs`` as it can to warm workers of the pool, in order: ``procs`` with
        each one taken marked (its ``pid``, start time and exit record)."""
        out = list(procs)
        for n, proc in enumerate(procs):
            if self.pool is None:
                break
            exit_file = str(task_dir / f"{Path(proc.log).stem}.exit")
            Path(exit_file).unlink(missing_ok=True)
            launch = StandbyLaunch(argv=proc.argv, env=proc.env, cwd=cwd or os.getcwd(), log=proc.log)
            warm = self.pool.take(msgspec.structs.replace(launch, exit_file=exit_file))
            if warm is None:
                break
            out[n] = msgspec.structs.replace(proc, pid=warm.pid, pid_start=warm.start_ticks, exit_file=exit_file)
        return out

    # -- paths -----------------------------------------------------------------------------

    def task_dir(self, key: TaskKey) -> Path:
        return self.data_dir / "jobs" / key.job / f"attempt-{key.attempt}"

    # -- Executor -------------------------------------------------------------------------------

    def running(self) -> set[TaskKey]:
        return set(self._tasks)

    async def start(self, launch: TaskLaunch) -> None:
        key = launch.key
        if key in self._tasks:
            return
        task_dir = self.task_dir(key)
        if launch.resume and (task_dir / taskfiles.TASK_FILE).exists():
            self._adopt(key, task_dir, launch.gpus)  # never start twice what ran before a restart
            return
        task_dir.mkdir(parents=True, exist_ok=True)
        leftovers = [*task_dir.glob(taskfiles.GROWN_PATTERN), *task_dir.glob("*.exit"), *task_dir.glob(LEFT_PATTERN)]
        done = (
            taskfiles.EXIT_FILE,
            taskfiles.SHIM_FILE,
            taskfiles.STOP_FILE,
            taskfiles.DEAD_WORKERS_FILE,
            RESCALE_COMPLETED_FILE,
        )
        for leftover in (*done, *(p.name for p in leftovers)):
            (task_dir / leftover).unlink(missing_ok=True)  # an elastic job back on this node in the same attempt
        procs = self._procs(launch, task_dir)
        if launch.elastic:
            procs = self._take_warm(procs, task_dir, launch.spec.workdir)
        pooled = [p for p in procs if p.pid is not None]
        taskfiles.write(task_dir / taskfiles.TASK_FILE, self._describe(launch, procs))
        shim_log = open(task_dir / "shim.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.nodeagent.shim",
                str(task_dir),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=shim_log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env=_shim_env(),
            )
        except BaseException:
            for worker in pooled:  # nobody would watch them
                _kill_group(worker.pid, worker.pid_start)  # type: ignore[arg-type]
            raise
        finally:
            shim_log.close()
        # Our child, not reaped yet: its pid is still its own to read the start time of.
        task = _Task(key=key, dir=task_dir, gpus=launch.gpus, pid=proc.pid, pid_start=_start_ticks(proc.pid))
        task.watcher = asyncio.create_task(self._watch_child(task, proc), name=f"task-{key.job}-{key.attempt}")
        self._tasks[key] = task
        log.info(
            "task launched", job=key.job, attempt=key.attempt, procs=launch.procs, warm=len(pooled), dir=str(task_dir)
        )

    async def stop(self, key: TaskKey, reason: str, *, checkpoint_grace_s: float = 0.0) -> TaskExit | None:
        task = self._tasks.get(key)
        if task is None:
            return None
        task.stopping = reason
        if task.pid is not None and not task.ended.is_set():
            request = StopRequest(reason=reason, checkpoint_grace_s=checkpoint_grace_s)
            taskfiles.write(task.dir / taskfiles.STOP_FILE, request)
            # A shim that is gone is never signalled (its pid may be another process's now): its
            # watcher sees it gone and kills what it left.
            if task.shim_running():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(task.pid, signal.SIGTERM)  # the shim stops its ranks: [SIGUSR1,] SIGTERM, grace, SIGKILL
            try:
                await asyncio.wait_for(task.ended.wait(), checkpoint_grace_s + self.kill_grace_s + 5.0)
            except TimeoutError:
                log.warning("shim did not stop; killing it", job=key.job, attempt=key.attempt)
                await self._kill_everything(task)
                await task.ended.wait()
            # What escaped the task's process group (a grandchild in a session of its own) outlives
            # the group's SIGKILL: a shim of the version before left it running.
            leftovers = await _kill_leftovers_off_loop(task.dir, _read(task.dir / taskfiles.SHIM_FILE, ShimInfo))
            if leftovers:
                log.warning("killed processes a stopped task left", job=key.job, attempt=key.attempt, killed=leftovers)
        self._tasks.pop(key, None)
        return task.exit or TaskExit(key=key, outcome="stopped", reason=reason)

    async def recover(self) -> set[TaskKey]:
        """Adopt the live shims a previous agent left (of this version or the one before).
        Reconciliation then stops those the log no longer places here; a shim no agent adopts
        fences itself. A task whose shim died without an exit record (SIGKILL, the OOM killer) has
        nobody left to stop or fence its processes: they are killed here, whatever the log says of
        the task, and an exit record written for it (so a later restart leaves it be, and a task
        the log still places here reads as ended when it is resumed)."""
        adopted: set[TaskKey] = set()
        for shim_file in sorted(self.data_dir.glob(f"jobs/*/attempt-*/{taskfiles.SHIM_FILE}")):
            task_dir = shim_file.parent
            if (task_dir / taskfiles.EXIT_FILE).exists():
                continue
            key = TaskKey(task_dir.parent.name, int(task_dir.name.removeprefix("attempt-")))
            info = _read(shim_file, ShimInfo)
            if info is None:
                continue  # no pid to judge the shim by: if it lives, it fences itself
            if not _is_shim(info.pid, task_dir, info.start_ticks):
                await self._end_orphans(key, task_dir, info)
                continue
            self._adopt(key, task_dir)
            adopted.add(key)
        if adopted:
            log.info("adopted tasks from before the restart", tasks=sorted(f"{k.job}/{k.attempt}" for k in adopted))
        return adopted

    async def shutdown(self) -> None:
        """Leave the shims running: the next agent adopts them, or they fence themselves. Idle warm
        workers are given back."""
        if self.pool is not None:
            await self.pool.close()
            self.pool = None
        for task in self._tasks.values():
            if task.watcher is not None:
                task.watcher.cancel()
        self._tasks.clear()

    def attempts(self, job: str) -> list[int]:
        return sorted(int(p.name.removeprefix("attempt-")) for p in (self.data_dir / "jobs" / job).glob("attempt-*"))

    def rank_pids(self) -> dict[int, list[int]]:
        """GPU index -> the pids of the ranks running on it (from the shims' records)."""
        out: dict[int, list[int]] = {}
        for task in self._tasks.values():
            info = _read(task.dir / taskfiles.SHIM_FILE, ShimInfo)
            for local_rank, pid in enumerate(info.pids if info is not None else ()):
                if task.gpus:
                    out.setdefault(task.gpus[local_rank % len(task.gpus)], []).append(pid)
        return out

    def request_profile(self, key: TaskKey, request: str, steps: int) -> bool:
        task_dir = self.task_dir(key)
        if key not in self.running() or not task_dir.is_dir():
            return False
        text = msgspec.json.encode({"request": request, "steps": steps}).decode()
        self.write_task_file(key, jobenv.PROFILE_REQUEST_FILE, text)
        return True

    def profile_result(self, key: TaskKey, name: str) -> bytes | None:
        if not _PROFILE_FILE.fullmatch(name):
            return None  # only a file the runtime names itself, never a path out of the folder
        try:
            return (self.task_dir(key) / name).read_bytes()
        except OSError:
            return None

    def output(self, key: TaskKey, max_bytes: int = 65536) -> dict[str, str]:
        task_dir = self.task_dir(key)
        logs = [*sorted(task_dir.glob("rank-*.log")), *sorted(task_dir.glob("worker-*.log"))]
        return {p.name: _tail_bytes(p, max_bytes) for p in logs}

    # -- internals -----------------------------------------------------------------------------

    def _describe(self, launch: TaskLaunch, procs: list[ProcLaunch]) -> TaskDescription:
        return TaskDescription(
            job=launch.key.job,
            attempt=launch.key.attempt,
            procs=procs,
            cwd=launch.spec.workdir,
            alive_file=str(self.alive_file),
            fence_after_s=self.fence_after_s,
            kill_grace_s=self.kill_grace_s,
            elastic=launch.elastic,
            agent_addr=self.agent_addr,
            node=self.node,
        )

    def _procs(self, launch: TaskLaunch, task_dir: Path) -> list[ProcLaunch]:
        """One process per rank; for an elastic task, one worker per GPU of ``launch.gpus``."""
        spec = launch.spec
        assert spec.command is not None
        argv = list(spec.command)
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the agent's interpreter: the one gpuherd (and torch) live in
        threads = max(1, (os.cpu_count() or 1) // max(1, launch.procs))
        procs = []
        for local_rank in range(launch.procs):
            rank = launch.rank_offset + local_rank
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", str(threads))  # ranks sharing a node must not oversubscribe it
            env.update(spec.env or {})
            env.update(
                {
                    jobenv.RANK: str(rank),
                    jobenv.WORLD_SIZE: str(launch.world_size),
                    jobenv.LOCAL_RANK: str(local_rank),
                    jobenv.LOCAL_WORLD_SIZE: str(launch.procs),
                    jobenv.GROUP_RANK: str(launch.group_rank),
                    jobenv.JOB_ID: launch.key.job,
                    jobenv.ATTEMPT: str(launch.key.attempt),
                    jobenv.NODE: self.node,
                    jobenv.AGENT_ADDR: self.agent_addr,
                    jobenv.TASK_DIR: str(task_dir),
                    "PYTHONUNBUFFERED": "1",
                }
            )
            if launch.rendezvous is not None:
                env[jobenv.MASTER_ADDR] = launch.rendezvous.addr
                env[jobenv.MASTER_PORT] = str(launch.rendezvous.port)
            log_name = f"rank-{rank}.log"
            own = (launch.gpus[local_rank],) if launch.elastic else launch.gpus
            # A job that leases memory sees its node's other GPUs too (leases come while it runs).
            neighbors = tuple(g for g in self.node_gpus() if g not in own) if spec.memory is not None else ()
            if launch.gpus:
                gpu = launch.gpus[local_rank % len(launch.gpus)]
                env[jobenv.GPU_INDEX] = str(gpu)
                env[jobenv.GPU_ORDER] = ",".join(map(str, own + neighbors))
            if launch.elastic:  # a worker owns one GPU; its rank changes with every rescale
                gpu = launch.gpus[local_rank]
                env.update({jobenv.ELASTIC_WORKER: jobenv.worker_id(self.node, gpu), jobenv.LOCAL_RANK: "0"})
                env.update(self.device_env((gpu,), 0, neighbors))
                log_name = f"worker-{gpu}.log"
            else:
                env.update(self.device_env(launch.gpus, local_rank, neighbors))
            gpu_of_worker = launch.gpus[local_rank] if launch.elastic else None
            generation = launch.generation if launch.elastic else None
            proc = ProcLaunch(
                argv=argv, env=env, log=str(task_dir / log_name), gpu=gpu_of_worker, generation=generation
            )
            procs.append(proc)
        return procs

    # -- elastic tasks ----------------------------------------------------------------------------

    def write_plan(self, key: TaskKey, plan: ElasticPlan) -> bool:
        return self.write_task_file(key, jobenv.ELASTIC_PLAN_FILE, plan.to_json())

    def write_task_file(self, key: TaskKey, name: str, text: str) -> bool:
        task_dir = self.task_dir(key)
        if not task_dir.is_dir():
            return False
        tmp = task_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, task_dir / name)  # a process reads the old file or the whole new one
        return True

    def node_gpus(self) -> list[int]:
        if self._node_gpus is None:
            self._node_gpus = [g.index for g in self.inventory(self.node)]
        return self._node_gpus

    def grow(self, key: TaskKey, launch: TaskLaunch) -> bool:
        task = self._tasks.get(key)
        if task is None or not launch.gpus:
            return False
        task_dir = self.task_dir(key)
        number = len(list(task_dir.glob(taskfiles.GROWN_PATTERN)))
        procs = self._procs(launch, task_dir)
        # The task's own standby (the shim keeps one) takes the first new worker; the pool the rest.
        info = _read(task_dir / taskfiles.SHIM_FILE, ShimInfo)
        first = 1 if info is not None and info.standby is not None and process_alive(info.standby, 0) else 0
        procs = procs[:first] + self._take_warm(procs[first:], task_dir, launch.spec.workdir)
        taskfiles.write(task_dir / f"grow-{number:04d}.json", GrowRequest(procs=procs))
        task.gpus = tuple(sorted({*task.gpus, *launch.gpus}))
        pooled = [p.gpu for p in procs if p.pid is not None]
        if pooled:
            log.info("workers from the warm pool", job=key.job, gpus=pooled)
        return True

    def workers(self, key: TaskKey) -> TaskWorkers:
        task_dir = self.task_dir(key)
        procs = _launched_procs(task_dir)
        launched = frozenset(p.gpu for p in procs if p.gpu is not None)
        dead = _read(task_dir / taskfiles.DEAD_WORKERS_FILE, tuple[WorkerDeath, ...]) or ()
        return TaskWorkers(
            launched=launched,
            dead=_deaths_of_current_workers(dead, procs),
            rescaled=_rescale_completed(task_dir),
            left=_current_workers_that_left(task_dir, procs),
        )

    # -- internals ----------------------------------------------------------------------------------

    def _adopt(self, key: TaskKey, task_dir: Path, gpus: tuple[int, ...] = ()) -> None:
        if key in self._tasks:
            self._tasks[key].gpus = gpus or self._tasks[key].gpus
            return
        info = _read(task_dir / taskfiles.SHIM_FILE, ShimInfo)
        task = _Task(key=key, dir=task_dir, gpus=gpus)
        if info is not None and _is_shim(info.pid, task_dir, info.start_ticks):
            # A shim of a version that did not write its start time: the one running now is it.
            task.pid, task.pid_start = info.pid, info.start_ticks or _start_ticks(info.pid)
        task.watcher = asyncio.create_task(self._watch_adopted(task), name=f"task-{key.job}-{key.attempt}")
        self._tasks[key] = task

    async def _watch_child(self, task: _Task, proc: asyncio.subprocess.Process) -> None:
        await proc.wait()
        await self._ended(task)

    async def _watch_adopted(self, task: _Task) -> None:
        while task.shim_running() and not (task.dir / taskfiles.EXIT_FILE).exists():
            await asyncio.sleep(0.25)
        # The shim exits right after writing exit.json; give it that moment before judging it.
        for _ in range(20):
            if not task.shim_running():
                break
            await asyncio.sleep(0.05)
        await self._ended(task)

    async def _ended(self, task: _Task) -> None:
        record = _read(task.dir / taskfiles.EXIT_FILE, ExitRecord)
        if record is None:
            # The shim died without a word (SIGKILL, OOM killer): make sure its ranks are gone too.
            await self._kill_everything(task)
        task.exit = exit_from_record(task.key, record, task.dir, stopping=task.stopping)
        task.ended.set()
        if task.stopping is None:
            self._tasks.pop(task.key, None)
            self.exits.put_nowait(task.exit)

    async def _kill_everything(self, task: _Task) -> None:
        if task.shim_running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(task.pid, signal.SIGKILL)  # type: ignore[arg-type] - the shim leads a group of its own
        await _kill_leftovers_off_loop(task.dir, _read(task.dir / taskfiles.SHIM_FILE, ShimInfo))

    async def _end_orphans(self, key: TaskKey, task_dir: Path, info: ShimInfo) -> None:
        """The shim of a task from before the restart died without an exit record: kill what it
        left running, and record the task's end for it."""
        if (task_dir / taskfiles.EXIT_FILE).exists():
            return  # it wrote its record just before it ended
        killed = await _kill_leftovers_off_loop(task_dir, info)
        taskfiles.write(task_dir / taskfiles.EXIT_FILE, ExitRecord(stopped=SHIM_DIED, ended_at=time.time()))
        log.warning(
            "the task's shim died while no agent ran; its processes were killed",
            job=key.job,
            attempt=key.attempt,
            killed=killed,
        )


def exit_from_record(key: TaskKey, record: ExitRecord | None, task_dir: Path, *, stopping: str | None) -> TaskExit:
    """How a task ended, from its shim's exit record (None: the shim died without one)."""
    if record is None:
        reason = stopping or SHIM_DIED
        return TaskExit(key=key, outcome="stopped", reason=reason, output_tail=_task_tail(task_dir, None))
    codes, failed_rank = record.codes, record.failed_rank
    tail = _task_tail(task_dir, record)
    if record.failure:
        code = codes[failed_rank] if failed_rank is not None and failed_rank < len(codes) else 127
        return TaskExit(key=key, outcome="failed", exit_code=shell_code(code), reason=record.failure, output_tail=tail)
    if record.stopped or stopping:
        return TaskExit(key=key, outcome="stopped", reason=stopping or record.stopped or "", output_tail=tail)
    return TaskExit(key=key, outcome="completed", exit_code=0, output_tail=tail)


def shell_code(code: int | None) -> int | None:
    """A process killed by signal N reads as 128+N, the way shells report it."""
    return 128 - code if code is not None and code < 0 else code


def _task_tail(task_dir: Path, record: ExitRecord | None) -> str:
    """The last lines of the task's output: its failed process's log, else its first process's."""
    path = _tail_log(task_dir, record)
    if path is None:
        return ""
    text = _tail_bytes(path, 64 * 1024)
    lines = "\n".join(text.splitlines()[-TAIL_LINES:])
    return lines.encode()[-MAX_OUTPUT_TAIL:].decode("utf-8", errors="replace")


def _tail_log(task_dir: Path, record: ExitRecord | None) -> Path | None:
    """The log the output tail comes from. ``failed_rank`` counts the shim's processes in the order
    it started them, grown workers included: the shim names their logs in that order (``logs``).
    A shim of a version before it did: the order the agent asked for them, the shim's but within a
    grow that took pooled workers (rather than the logs sorted by GPU, which a grow onto a lower
    GPU reorders). Only a log of the task's own folder is read, whatever the files say."""
    logs = record.logs if record is not None and record.logs else [p.log for p in _launched_procs(task_dir)]
    if not logs:
        return None
    index = record.failed_rank if record is not None and record.failed_rank is not None else 0
    name = Path(logs[index] if index < len(logs) else logs[0]).name
    return task_dir / name if name.endswith(".log") else None


def _tail_bytes(path: Path, max_bytes: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


T = TypeVar("T")


def _read(path: Path, kind: type[T]) -> T | None:
    """A task file, or None if it is not there; one that is unreadable is logged and read as absent
    (the shim that wrote it may be of another version, or died writing a file it writes in place)."""
    try:
        return taskfiles.read(path, kind)
    except taskfiles.UnreadableTaskFile as exc:
        log.warning("unreadable task file", error=str(exc))
        return None


def _launched_procs(task_dir: Path) -> list[ProcLaunch]:
    """Every process the agent asked the task's shim to run, at its start and at each grow."""
    grown = [p for p in sorted(task_dir.glob(taskfiles.GROWN_PATTERN)) if p.suffix != ".tmp"]
    requests = (_read(path, GrowRequest) for path in [task_dir / taskfiles.TASK_FILE, *grown])
    return [proc for request in requests if request is not None for proc in request.procs]


def _rescale_completed(task_dir: Path) -> RescaleReport | None:
    """The last rescale a worker of the task reported completed, as it left it in the folder (None:
    none, or not a report this agent can read)."""
    try:
        message = decode_message((task_dir / RESCALE_COMPLETED_FILE).read_bytes())
    except (OSError, MessageError):
        return None
    return message if isinstance(message, RescaleReport) else None


def _current_workers_that_left(task_dir: Path, procs: list[ProcLaunch]) -> frozenset[int]:
    """The GPUs whose current worker (its last launched) said it left (``gpuherd.train.report``):
    it left at a generation after the one it started in. A worker started on the GPU since (a grow
    or rollback that named it again) started in that later generation, and has not left."""
    current = {p.gpu: p.generation for p in procs if p.gpu is not None}  # (later launches replace earlier)
    left: set[int] = set()
    for gpu, started_in in current.items():
        try:
            message = decode_message((task_dir / left_file(gpu)).read_bytes())
        except (OSError, MessageError):
            continue
        if isinstance(message, RescaleReport) and message.event == "left" and message.generation > (started_in or 0):
            left.add(gpu)
    return frozenset(left)


def _deaths_of_current_workers(dead: tuple[WorkerDeath, ...], procs: list[ProcLaunch]) -> tuple[WorkerDeath, ...]:
    """Of the deaths the shim recorded, those of each GPU's current worker (its last launched): an
    earlier worker of a GPU the job grew back onto died in a generation the log has moved past, and
    the live worker that replaced it is not lost. A death without a generation (a shim of a version
    before it) counts, as it did."""
    current = {p.gpu: p.generation for p in procs if p.gpu is not None}  # (later launches replace earlier)
    return tuple(d for d in dead if d.generation is None or current.get(d.gpu, d.generation) == d.generation)


def _is_shim(pid: object, task_dir: Path, start_ticks: int = 0) -> bool:
    """Whether ``pid`` is still the shim of ``task_dir``: its command line ends with the shim's
    module and this very folder (not one whose name only begins with it, ``attempt-1`` of
    ``attempt-10``), it is no zombie, and it started at ``start_ticks`` (when known): a pid the
    kernel gave to another process since is not it."""
    if not isinstance(pid, int) or pid <= 1:
        return False
    if not process_alive(pid, start_ticks):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    if argv and argv[-1] == b"":
        argv.pop()  # (cmdline ends with a NUL)
    return argv[-2:] == [b"services.nodeagent.shim", str(task_dir).encode()]


def _start_ticks(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot), or 0 if it is gone."""
    return process_start_ticks(pid) or 0


LEFTOVERS_GONE_S = 5.0  # a process in uninterruptible sleep (a GPU driver call) may take a while to die


async def _kill_leftovers_off_loop(task_dir: Path, info: ShimInfo | None) -> int:
    """``_kill_leftovers`` in a thread: its wait for the killed to be gone (up to
    ``LEFTOVERS_GONE_S``) must not stop the agent's heartbeats and lease renewals, nor hold the
    agent past its exit when it is stopped meanwhile (its SIGKILLs are sent; a restarted agent's
    recovery finds whatever is left)."""
    return await off_loop(functools.partial(_kill_leftovers, task_dir, info), name="kill-leftovers")


def _kill_leftovers(task_dir: Path, info: ShimInfo | None) -> int:
    """SIGKILL what the task's shim started: its ranks' process group (while a process of the task
    is in it: a group whose processes are all gone may be another's by now), every process whose
    environment names the task, and the warm pool's workers it took. Returns how many processes
    were found. It returns once they are gone (or after ``LEFTOVERS_GONE_S``): a SIGKILL takes
    effect when its target next runs, and until it has exited it holds its GPU memory and ports,
    which the task placed next on those GPUs would find taken."""
    found: set[int] = set()
    deadline = time.monotonic() + LEFTOVERS_GONE_S
    # Scan again until none is left: one being forked while its parent was killed shows up in a
    # later pass, and one killed but not yet exited is still listed (and signalled again, harmlessly).
    while processes := _task_processes(task_dir):
        if time.monotonic() > deadline:
            log.warning("processes of a task outlived their SIGKILL", dir=str(task_dir), pids=sorted(processes))
            break
        if found >= processes.keys():
            time.sleep(0.01)
        found |= processes.keys()
        if info is not None and info.pgid is not None and info.pgid > 1 and info.pgid in processes.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(info.pgid, signal.SIGKILL)  # with it, the grandchildren that cleared their environment
        for pid in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    # Workers from the warm pool lead groups of their own (the task's folder names them even if
    # the shim died before it wrote them down).
    pool_workers = [(proc.pid, proc.pid_start) for proc in _launched_procs(task_dir) if proc.pid is not None]
    for pid, start_ticks in pool_workers:
        _kill_group(pid, start_ticks)
    while any(_kill_target_alive(*worker) for worker in pool_workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(found)


def _kill_target_alive(pid: int, start_ticks: int) -> bool:
    return pid > 1 and process_alive(pid, start_ticks)


def _kill_group(pid: int, start_ticks: int) -> None:
    """SIGKILL the process group led by ``pid``, if that very process still runs (a pid may be reused)."""
    if _kill_target_alive(pid, start_ticks):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def default_min_free_mb() -> int:
    """Host memory the warm pool leaves free: a tenth of the RAM, at least 1 GiB."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError):
        total = 0
    return max(1024, total // 10)


def _shim_env() -> dict[str, str]:
    """The shim must import ``services`` however the agent was started."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env
