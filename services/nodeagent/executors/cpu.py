"""The ``cpu`` executor: declared virtual GPUs, real processes running torch on CPU (gloo).

It stands in for a GPU node wherever there is none (laptops, CI): the
scheduler sees GPUs with NVLink islands as declared, the job's processes run
for real, one per virtual GPU, and must not touch a CUDA device.
"""

from __future__ import annotations

from pathlib import Path

from gpuherd import jobenv
from gpuherd.events import GpuInfo
from services.nodeagent.executors.base import declared_gpus
from services.nodeagent.executors.process import ProcessExecutor


class CpuExecutor(ProcessExecutor):
    kind = "cpu"

    def __init__(
        self,
        data_dir: Path,
        *,
        gpus: int = 4,
        island: int = 0,
        memory_mb: int = 16384,
        alive_file: Path,
        agent_addr: str = "",
        fence_after_s: float = 4.0,
        kill_grace_s: float = 10.0,
    ) -> None:
        super().__init__(
            data_dir,
            alive_file=alive_file,
            agent_addr=agent_addr,
            fence_after_s=fence_after_s,
            kill_grace_s=kill_grace_s,
        )
        self.gpu_count = gpus
        self.island = island
        self.memory_mb = memory_mb

    def inventory(self, node: str) -> list[GpuInfo]:
        return declared_gpus(node, self.gpu_count, island=self.island, model="CPU-VGPU", memory_mb=self.memory_mb)

    def device_env(self, gpus: tuple[int, ...], local_rank: int) -> dict[str, str]:
        return {jobenv.CUDA_VISIBLE_DEVICES: "", jobenv.VIRTUAL_GPUS: ",".join(map(str, gpus))}
