"""The ``sim`` executor: declared GPUs, no processes; a job ends after ``duration_s``."""

from __future__ import annotations

import asyncio
import contextlib

from gpuherd.events import GpuInfo, declared_gpus
from services.nodeagent.executors.base import Executor, OnExit, TaskExit, TaskKey, TaskLaunch


class SimExecutor(Executor):
    kind = "sim"

    def __init__(self, gpus: int = 8, *, gpu_model: str = "SIM-GPU", memory_mb: int = 81920, island: int = 0) -> None:
        self.gpu_count = gpus
        self.gpu_model = gpu_model
        self.memory_mb = memory_mb
        self.island = island  # GPUs per NVLink island (0: all GPUs of the node are one island)
        self._tasks: dict[TaskKey, asyncio.Task[None]] = {}

    def inventory(self, node: str) -> list[GpuInfo]:
        return declared_gpus(node, self.gpu_count, island=self.island, model=self.gpu_model, memory_mb=self.memory_mb)

    async def start(self, launch: TaskLaunch, on_exit: OnExit) -> None:
        key = launch.key
        if key in self._tasks:
            return
        duration = launch.spec.duration_s if launch.spec.duration_s is not None else 0.0
        remaining = max(0.0, duration - launch.elapsed_s)  # a resumed task goes on where it was

        async def run() -> None:
            await asyncio.sleep(remaining)
            self._tasks.pop(key, None)
            await on_exit(TaskExit(key=key, outcome="completed", exit_code=0))

        self._tasks[key] = asyncio.create_task(run(), name=f"sim-{key.job}-{key.attempt}")

    async def stop(self, key: TaskKey, reason: str, *, checkpoint_grace_s: float = 0.0) -> TaskExit | None:
        task = self._tasks.pop(key, None)
        if task is None:
            return None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return TaskExit(key=key, outcome="stopped", reason=reason)

    def running(self) -> set[TaskKey]:
        return set(self._tasks)
