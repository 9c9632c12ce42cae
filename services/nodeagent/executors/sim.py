"""The ``sim`` executor: declared GPUs, no processes; a task ends after what is left of its job's
``duration_s``. ``SimTasks`` is its bookkeeping on any clock: the live executor runs it on asyncio
timers, the simulator on its virtual clock (``apps/sim``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpuherd.events import GpuInfo, declared_gpus
from services.nodeagent.executors.base import Executor, TaskExit, TaskKey, TaskLaunch


def remaining_s(launch: TaskLaunch) -> float:
    """How long a sim task runs: its duration, less the work of earlier attempts (a preempted sim job
    checkpoints) and, when resumed after an agent restart, the time it has run already."""
    duration = launch.spec.duration_s if launch.spec.duration_s is not None else 0.0
    return max(0.0, duration - launch.attained_s - launch.elapsed_s)


class SimTasks:
    """Which sim tasks run and when each ends. With a ``checkpoint_cost`` (a job's GPUs -> seconds),
    each attempt after the first also restores its checkpoint: every preemption costs that much more."""

    def __init__(self, checkpoint_cost: Callable[[int], float] | None = None) -> None:
        self.ends: dict[TaskKey, float] = {}
        self.checkpoint_cost = checkpoint_cost

    def start(self, launch: TaskLaunch, now: float) -> float | None:
        """When the task ends; None if it runs already."""
        if launch.key in self.ends:
            return None
        restores = launch.key.attempt * self.checkpoint_cost(launch.spec.gpus) if self.checkpoint_cost else 0.0
        end = now + remaining_s(launch) + restores
        self.ends[launch.key] = end
        return end

    def stop(self, key: TaskKey) -> bool:
        return self.ends.pop(key, None) is not None

    def finish(self, key: TaskKey, end: float) -> bool:
        """The timer of ``key`` went off at ``end``: whether it completed (it was not stopped or started again)."""
        if self.ends.get(key) != end:
            return False
        del self.ends[key]
        return True

    def running(self) -> set[TaskKey]:
        return set(self.ends)


class SimExecutor(Executor):
    kind = "sim"

    def __init__(self, gpus: int = 8, *, gpu_model: str = "SIM-GPU", memory_mb: int = 81920, island: int = 0) -> None:
        super().__init__()
        self.gpu_count = gpus
        self.gpu_model = gpu_model
        self.memory_mb = memory_mb
        self.island = island  # GPUs per NVLink island (0: all GPUs of the node are one island)
        self.tasks = SimTasks()
        self._timers: dict[TaskKey, asyncio.TimerHandle] = {}

    def inventory(self, node: str) -> list[GpuInfo]:
        return declared_gpus(node, self.gpu_count, island=self.island, model=self.gpu_model, memory_mb=self.memory_mb)

    async def start(self, launch: TaskLaunch) -> None:
        loop = asyncio.get_running_loop()
        end = self.tasks.start(launch, loop.time())
        if end is None:
            return
        key = launch.key

        def ended() -> None:
            self._timers.pop(key, None)
            if self.tasks.finish(key, end):
                self.exits.put_nowait(TaskExit(key=key, outcome="completed", exit_code=0))

        self._timers[key] = loop.call_at(end, ended)

    async def stop(self, key: TaskKey, reason: str, *, checkpoint_grace_s: float = 0.0) -> TaskExit | None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if not self.tasks.stop(key):
            return None
        return TaskExit(key=key, outcome="stopped", reason=reason)

    def running(self) -> set[TaskKey]:
        return self.tasks.running()
