"""The nvml executor on a real GPU: inventory, telemetry, and CUDA_VISIBLE_DEVICES isolation.

Skipped where CUDA is absent."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from gpuherd import events as ev
from services.nodeagent.executors import TaskExit, TaskKey, TaskLaunch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(120),
]


def nvml_executor(tmp_path: Path):
    from services.nodeagent.executors.nvml import NvmlExecutor

    alive = tmp_path / "alive"
    alive.touch()
    executor = NvmlExecutor(tmp_path, alive_file=alive, fence_after_s=60.0, kill_grace_s=2.0)
    executor.node = "gpu-test"
    return executor


def test_inventory_lists_every_gpu_with_uuid_model_memory(tmp_path: Path) -> None:
    executor = nvml_executor(tmp_path)
    gpus = executor.inventory("gpu-test")
    assert len(gpus) == torch.cuda.device_count()
    for index, gpu in enumerate(gpus):
        assert gpu.index == index
        assert gpu.uuid.startswith("GPU-")
        assert gpu.memory_mb > 1000
        props = torch.cuda.get_device_properties(index)
        assert abs(gpu.memory_mb - props.total_memory / 2**20) < 0.05 * gpu.memory_mb
        assert all(0 <= peer < len(gpus) and peer != index for peer in gpu.nvlink_peers)


def test_telemetry_samples_read_the_hardware(tmp_path: Path) -> None:
    executor = nvml_executor(tmp_path)
    samples = executor.sample()
    assert [s.index for s in samples] == list(range(torch.cuda.device_count()))
    for s in samples:
        assert s.memory_used_mb is not None and s.memory_used_mb >= 0
        assert s.utilization_pct is not None and 0 <= s.utilization_pct <= 100
        assert s.temperature_c is not None and 0 < s.temperature_c < 120
        assert s.power_w is None or s.power_w > 0


async def test_a_job_sees_exactly_its_gpu(tmp_path: Path) -> None:
    executor = nvml_executor(tmp_path)
    inventory = executor.inventory("gpu-test")
    target = len(inventory) - 1  # the last GPU: visible to the job as cuda:0, and only it
    code = (
        "import os, torch\n"
        "print(torch.cuda.device_count(), os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
        "print('uuid', torch.cuda.get_device_properties(0).uuid, flush=True)\n"
        "x = torch.ones(1024, 1024, device='cuda'); print('sum', int((x @ x)[0, 0].item()))\n"
    )
    spec = ev.JobSpec(name="iso", user="t", gpus=1, command=(sys.executable, "-c", code))
    await executor.start(TaskLaunch(key=TaskKey("iso", 0), spec=spec, gpus=(target,)))
    result: TaskExit = await asyncio.wait_for(executor.exits.get(), 90)
    assert result.outcome == "completed", result
    out = executor.output(TaskKey("iso", 0))["rank-0.log"].splitlines()
    assert out[0] == f"1 {inventory[target].uuid}"
    assert out[1].removeprefix("uuid ").replace("GPU-", "") == inventory[target].uuid.removeprefix("GPU-")
    assert out[2] == "sum 1024"
