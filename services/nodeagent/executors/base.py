"""The executor interface: inventory, start, stop."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import msgspec

from gpuherd.events import GpuInfo, JobSpec


class TaskKey(NamedTuple):
    job: str
    attempt: int


class TaskExit(msgspec.Struct, frozen=True):
    key: TaskKey
    outcome: str  # completed | failed | cancelled
    exit_code: int | None = None
    reason: str = ""


OnExit = Callable[[TaskExit], Awaitable[None]]


class Executor(abc.ABC):
    kind: str

    @abc.abstractmethod
    def inventory(self, node: str) -> list[GpuInfo]: ...

    @abc.abstractmethod
    async def start(
        self, key: TaskKey, spec: JobSpec, gpus: tuple[int, ...], *, elapsed_s: float, on_exit: OnExit
    ) -> None:
        """Run this node's part of a job attempt. ``elapsed_s`` > 0 means it already ran
        that long before an agent restart (the executor adopts it)."""

    @abc.abstractmethod
    async def stop(self, key: TaskKey, reason: str) -> None:
        """Stop the task if it runs; no exit is reported for a stopped task."""

    @abc.abstractmethod
    def running(self) -> set[TaskKey]: ...

    async def shutdown(self) -> None:
        for key in list(self.running()):
            await self.stop(key, "agent shutting down")
