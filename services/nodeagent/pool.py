"""The node's pool of warm workers: interpreters with torch imported, ready to become the next worker
of any elastic job on this node.

A worker that starts as a new process spends seconds importing torch (more while the node's other
workers keep its cores busy): most of the time a grow onto a node takes. So the agent keeps
``size`` interpreters (``python -m gpuherd.train.standby``) started ahead of time, shared by the
node's elastic jobs:

- ``take(launch)`` hands a worker's launch to the first warm interpreter whose environment fits; it
  becomes that worker at once. The pool starts another in the background, ``refill_delay_s`` later
  (so that its import does not compete for the cores with the worker that just started).
- Taken interpreters stay the agent's children, each in a session (and process group) of its own.
  The task's shim watches them through their pid and start time, and an exit record: the
  interpreter writes it when its script ends, the agent when it reaps one that was killed.
- Memory: the pool's resident memory is counted (``memory_mb``, in the node's telemetry and
  metrics). While the host's available memory is under ``min_free_mb`` the pool gives interpreters
  back (the youngest first) and does not refill.
- On a CUDA node an interpreter may be pinned to an idle GPU (``pin``): it creates its CUDA context
  there before it is needed, and can then only become a worker of that GPU. One whose GPU went to
  another job is given back.
- An idle interpreter exits when the agent does (its stdin closes).

Only the agent's event loop touches a pool; ``take`` does not wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from gpuherd.obs import get_logger
from gpuherd.train.standby import WARM_CUDA, WARM_MARKER
from services.nodeagent.shim import is_python_script, process_start_ticks
from services.nodeagent.taskfiles import StandbyLaunch, WorkerExitRecord

log = get_logger("gpuherd.nodeagent.pool")

# Read once, when an interpreter starts or imports torch: a warm interpreter becomes only a worker
# whose environment agrees with its own on these (``become`` applies every other variable).
FIXED_AT_START_PREFIXES = ("PYTHON", "TORCH", "PYTORCH_", "LD_", "MKL_", "KMP_", "GOMP_")
APPLIED_WHEN_TAKEN = frozenset({"PYTHONUNBUFFERED"})
DEFAULT_WORKER_MB = 400  # the resident memory of a warm interpreter, until one has been measured
PIN_GRACE_S = 10.0  # a pinned GPU held by a job this long was not taken for it: give its interpreter back


def available_mb() -> int:
    """The host's available memory in MiB (``MemAvailable``), what new processes can still use."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30  # not Linux: never under pressure


def resident_mb(pid: int) -> float:
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def fixed_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` an interpreter reads once, at start."""
    return {k: v for k, v in env.items() if k.startswith(FIXED_AT_START_PREFIXES) and k not in APPLIED_WHEN_TAKEN}


@dataclass
class WarmWorker:
    proc: asyncio.subprocess.Process
    fixed: dict[str, str]  # what it can only become a worker with (fixed_environment and its pin's variables)
    pin: int | None  # the GPU it created its CUDA context on (None: no context, any GPU)
    started: float  # monotonic
    start_ticks: int  # with the pid, names this very process (a pid may be reused)
    warm: bool = False
    pin_held_since: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class PoolCounts:
    taken: int = 0
    given_back: int = 0  # for memory, or because their GPU went to another job
    died: int = 0
    warm_s: list[float] = field(default_factory=list)  # how long the recent ones took to get warm


class WarmPool:
    def __init__(
        self,
        size: int,
        folder: Path,
        *,
        min_free_mb: int,
        refill_delay_s: float = 2.0,
        check_s: float = 1.0,
        interpreter: str = sys.executable,
        env: Mapping[str, str] | None = None,
        pin: Callable[[set[int]], int | None] = lambda pinned: None,
        pin_env: Callable[[int], dict[str, str]] = lambda gpu: {},
        pin_free: Callable[[int], bool] = lambda gpu: True,
        memory: Callable[[], int] = available_mb,
    ) -> None:
        if size < 0:
            raise ValueError(f"a warm pool holds 0 or more workers, not {size}")
        self.size = size
        self.folder = Path(folder)
        self.min_free_mb = min_free_mb
        self.refill_delay_s = refill_delay_s
        self.check_s = check_s
        self.interpreter = interpreter
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self._pin, self._pin_env, self._pin_free = pin, pin_env, pin_free
        self._available = memory
        self.idle: list[WarmWorker] = []
        self.counts = PoolCounts()
        self._refill_at = 0.0  # monotonic: no new interpreter before this
        self._worker_mb = float(DEFAULT_WORKER_MB)
        self._wake = asyncio.Event()
        self._upkeep: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[Any]] = set()

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        if self._upkeep is None and self.size > 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._upkeep = asyncio.create_task(self._tend_forever(), name="warm-pool")

    async def close(self) -> None:
        """Stop refilling and give back every idle interpreter (taken ones are job workers now: they stay)."""
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
            self._upkeep = None
        idle, self.idle = self.idle, []
        for worker in idle:
            _kill_group(worker.pid)
        for worker in idle:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.proc.wait(), 5.0)
        for watcher in list(self._watchers):
            watcher.cancel()

    # -- what the executor asks --------------------------------------------------------------------

    def take(self, launch: StandbyLaunch) -> WarmWorker | None:
        """Hand ``launch`` (with its ``exit_file``) to a warm interpreter that can become it; None if
        none can (the caller starts the worker as a new process)."""
        if not is_python_script(launch.argv) or launch.argv[0] != self.interpreter or launch.exit_file is None:
            return None
        for worker in self.idle:
            if not worker.warm or worker.proc.returncode is not None or not _fits(worker, launch.env):
                continue
            assert worker.proc.stdin is not None
            try:
                worker.proc.stdin.write(msgspec.json.encode(launch) + b"\n")
                worker.proc.stdin.close()
            except (OSError, RuntimeError):
                continue  # it died meanwhile: the upkeep forgets it
            self.idle.remove(worker)
            self.counts.taken += 1
            self._watch(self._record_exit(worker, Path(launch.exit_file)))
            self._refill_at = time.monotonic() + self.refill_delay_s
            self._wake.set()
            log.info("warm worker taken", pid=worker.pid, log=launch.log, idle=len(self.idle))
            return worker
        return None

    def ready(self) -> int:
        """Warm interpreters waiting now."""
        return sum(1 for w in self.idle if w.warm and w.proc.returncode is None)

    def memory_mb(self) -> float:
        """Resident memory of the idle interpreters (what the pool holds of the node's memory)."""
        return sum(resident_mb(w.pid) for w in self.idle)

    def status(self) -> dict[str, float | int]:
        return {
            "size": self.size,
            "warm": self.ready(),
            "starting": sum(1 for w in self.idle if not w.warm),
            "memory_mb": round(self.memory_mb(), 1),
            "taken": self.counts.taken,
            "given_back": self.counts.given_back,
        }

    # -- upkeep ------------------------------------------------------------------------------------

    async def _tend_forever(self) -> None:
        while True:
            try:
                await self.tend()
            except Exception:
                log.exception("warm pool upkeep failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.check_s)
            self._wake.clear()

    async def tend(self) -> None:
        """One round: forget interpreters that died, give back what memory pressure or another
        job's GPU asks for, and start one more if the pool is short and the host can afford it."""
        now = time.monotonic()
        for worker in [w for w in self.idle if w.proc.returncode is not None]:
            self.idle.remove(worker)
            self.counts.died += 1
            log.warning("a warm worker died while idle", pid=worker.pid, code=worker.proc.returncode)
        for worker in [w for w in self.idle if w.pin is not None]:
            if self._pin_free(worker.pin):  # type: ignore[arg-type]
                worker.pin_held_since = None
            elif worker.pin_held_since is None:
                worker.pin_held_since = now
            elif now - worker.pin_held_since > PIN_GRACE_S:
                self._give_back(worker, f"GPU {worker.pin} went to another job")
        available = self._available()
        if available < self.min_free_mb and self.idle:
            freed = 0.0
            for worker in sorted(self.idle, key=lambda w: w.started, reverse=True):
                if available + freed >= self.min_free_mb:
                    break
                freed += resident_mb(worker.pid) or self._worker_mb
                self._give_back(worker, f"host memory low: {available} MiB available, {self.min_free_mb} kept free")
            self._refill_at = max(self._refill_at, now + self.refill_delay_s)
            return
        starting = any(not w.warm for w in self.idle)  # one import at a time: it spares the cores
        affordable = available - self._worker_mb >= self.min_free_mb
        if len(self.idle) < self.size and not starting and now >= self._refill_at and affordable:
            await self._start_one()

    def _give_back(self, worker: WarmWorker, reason: str) -> None:
        if worker in self.idle:
            self.idle.remove(worker)
        _kill_group(worker.pid)
        self.counts.given_back += 1
        self._watch(worker.proc.wait())
        log.info("warm worker given back", pid=worker.pid, reason=reason, idle=len(self.idle))

    async def _start_one(self) -> None:
        pin = self._pin({w.pin for w in self.idle if w.pin is not None})
        env = dict(self.env)
        if pin is not None:
            env.update(self._pin_env(pin), **{WARM_CUDA: "1"})
        fixed = fixed_environment(env) | (self._pin_env(pin) if pin is not None else {})
        with open(self.folder / "pool.log", "ab") as output:
            proc = await asyncio.create_subprocess_exec(
                self.interpreter,
                "-m",
                "gpuherd.train.standby",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=output,
                env=env,
                start_new_session=True,  # its own process group: the task's shim stops it with its group
            )
        worker = WarmWorker(proc, fixed, pin, time.monotonic(), process_start_ticks(proc.pid) or 0)
        self.idle.append(worker)
        self._watch(self._await_warm(worker))
        log.info("warm worker starting", pid=proc.pid, pin=pin, idle=len(self.idle))

    async def _await_warm(self, worker: WarmWorker) -> None:
        assert worker.proc.stdout is not None
        line = await worker.proc.stdout.readline()
        if line.decode(errors="replace").startswith(WARM_MARKER):
            worker.warm = True
            self.counts.warm_s = [*self.counts.warm_s[-9:], time.monotonic() - worker.started]
            self._worker_mb = resident_mb(worker.pid) or self._worker_mb
            self._wake.set()  # the next one may start
        await worker.proc.stdout.read()  # until it becomes a worker (its stdout goes to the worker's log) or exits

    async def _record_exit(self, worker: WarmWorker, exit_file: Path) -> None:
        """A taken interpreter is the agent's child, not its shim's: only the agent learns how it
        ended. The shim reads it here (unless the worker wrote its own record first)."""
        code = await worker.proc.wait()
        with contextlib.suppress(OSError):
            fd = os.open(exit_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(WorkerExitRecord(code=code, by="agent")))

    def _watch(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)


def _fits(worker: WarmWorker, env: Mapping[str, str]) -> bool:
    """Whether ``worker`` can become a process with environment ``env``: they agree on every variable
    read at start (both ways: one the worker has and the launch lacks counts too), and on its pin's."""
    wanted = fixed_environment(env)
    return all(env.get(k) == v for k, v in worker.fixed.items()) and all(
        worker.fixed.get(k) == v for k, v in wanted.items()
    )


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
