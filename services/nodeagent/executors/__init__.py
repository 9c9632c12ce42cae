"""Executors run this node's part of a job: ``sim`` (a timer, no process), ``cpu``
(declared virtual GPUs, real processes on CPU) and ``nvml`` (real GPUs)."""

from __future__ import annotations

from pathlib import Path

from services.nodeagent.executors.base import Executor, GpuSample, TaskExit, TaskKey, TaskLaunch
from services.nodeagent.executors.sim import SimExecutor

__all__ = ["Executor", "GpuSample", "SimExecutor", "TaskExit", "TaskKey", "TaskLaunch", "make_executor"]


def make_executor(
    kind: str,
    *,
    data_dir: Path,
    gpus: int = 8,
    island: int = 0,
    agent_addr: str = "",
    fence_after_s: float = 4.0,
    kill_grace_s: float = 10.0,
    warm_workers: int = 0,
    warm_min_free_mb: int | None = None,
) -> Executor:
    if kind == "sim":
        return SimExecutor(gpus, island=island)
    process_settings = {
        "alive_file": data_dir / "alive",
        "agent_addr": agent_addr,
        "fence_after_s": fence_after_s,
        "kill_grace_s": kill_grace_s,
        "warm_workers": warm_workers,
        "warm_min_free_mb": warm_min_free_mb,
    }
    if kind == "cpu":
        from services.nodeagent.executors.cpu import CpuExecutor

        return CpuExecutor(data_dir, gpus=gpus, island=island, **process_settings)  # type: ignore[arg-type]
    if kind == "nvml":
        from services.nodeagent.executors.nvml import NvmlExecutor

        return NvmlExecutor(data_dir, **process_settings)
    raise ValueError(f"unknown executor {kind!r}; choose sim, cpu or nvml")
