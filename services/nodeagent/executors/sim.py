"""The ``sim`` executor: declared GPUs, no processes; a job ends after ``duration_s``."""

from __future__ import annotations

import asyncio
import contextlib

from gpuherd.events import GpuInfo, JobSpec
from services.nodeagent.executors.base import Executor, OnExit, TaskExit, TaskKey


class SimExecutor(Executor):
    kind = "sim"

    def __init__(self, gpus: int = 8, *, gpu_model: str = "SIM-GPU", memory_mb: int = 81920, island: int = 0) -> None:
        self.gpu_count = gpus
        self.gpu_model = gpu_model
        self.memory_mb = memory_mb
        self.island = island  # GPUs per NVLink island (0: all GPUs of the node are one island)
        self._tasks: dict[TaskKey, asyncio.Task[None]] = {}

    def inventory(self, node: str) -> list[GpuInfo]:
        size = self.island or self.gpu_count
        out = []
        for i in range(self.gpu_count):
            first = (i // size) * size
            peers = tuple(j for j in range(first, min(first + size, self.gpu_count)) if j != i)
            out.append(
                GpuInfo(
                    index=i, uuid=f"SIM-{node}-{i}", model=self.gpu_model, memory_mb=self.memory_mb, nvlink_peers=peers
                )
            )
        return out

    async def start(
        self, key: TaskKey, spec: JobSpec, gpus: tuple[int, ...], *, elapsed_s: float, on_exit: OnExit
    ) -> None:
        if key in self._tasks:
            return
        duration = spec.duration_s if spec.duration_s is not None else 0.0
        remaining = max(0.0, duration - elapsed_s)

        async def run() -> None:
            await asyncio.sleep(remaining)
            self._tasks.pop(key, None)
            await on_exit(TaskExit(key=key, outcome="completed", exit_code=0))

        self._tasks[key] = asyncio.create_task(run(), name=f"sim-{key.job}-{key.attempt}")

    async def stop(self, key: TaskKey, reason: str) -> None:
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def running(self) -> set[TaskKey]:
        return set(self._tasks)
