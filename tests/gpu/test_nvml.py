"""The nvml executor on a real GPU: inventory, telemetry, and CUDA_VISIBLE_DEVICES isolation.

Skipped where CUDA is absent."""

from __future__ import annotations

import asyncio
import sys
import time
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


HOLD_GPU = (
    "import time, torch\n"
    "x = torch.empty(256 << 20, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
    "print('holding', flush=True); time.sleep(600)\n"
)


async def test_a_stopped_job_leaves_no_process_on_its_gpu(tmp_path: Path) -> None:
    """What cancel and a time limit both come to on the agent (its StopTask): the task's process
    tree is gone from NVML's list of the GPU's processes, not merely signalled."""
    executor = nvml_executor(tmp_path)
    target = len(executor.inventory("gpu-test")) - 1
    before = executor.compute_pids(target)
    spec = ev.JobSpec(name="hold", user="t", gpus=1, command=(sys.executable, "-c", HOLD_GPU))
    key = TaskKey("hold", 0)
    await executor.start(TaskLaunch(key=key, spec=spec, gpus=(target,)))
    deadline = time.monotonic() + 60
    while not executor.compute_pids(target) - before and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    holding = executor.compute_pids(target) - before
    assert holding, "NVML never listed the job's process on its GPU (the positive control)"
    assert set(executor.rank_pids().get(target, ())) & holding, "the rank NVML lists is not the task's"
    result = await executor.stop(key, "cancelled by the test")
    assert result is not None and result.outcome != "completed", result
    deadline = time.monotonic() + 10
    while executor.compute_pids(target) & holding and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not executor.compute_pids(target) & holding
