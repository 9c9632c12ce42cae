"""The ``cpu`` executor: declared virtual GPUs, real processes running torch on CPU (gloo).

It stands in for a GPU node wherever there is none (laptops, CI): the
scheduler sees GPUs with NVLink islands as declared, the job's processes run
for real, one per virtual GPU, and must not touch a CUDA device.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpuherd import jobenv
from gpuherd.events import GpuInfo, declared_gpus
from services.nodeagent.executors.base import GpuSample
from services.nodeagent.executors.process import ProcessExecutor
from services.nodeagent.shim import process_stat


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
        warm_workers: int = 0,
        warm_min_free_mb: int | None = None,
    ) -> None:
        super().__init__(
            data_dir,
            alive_file=alive_file,
            agent_addr=agent_addr,
            fence_after_s=fence_after_s,
            kill_grace_s=kill_grace_s,
            warm_workers=warm_workers,
            warm_min_free_mb=warm_min_free_mb,
        )
        self.gpu_count = gpus
        self.island = island
        self.memory_mb = memory_mb
        self._cpu_seen: dict[int, tuple[float, float]] = {}  # pid -> (cpu seconds, when)

    def inventory(self, node: str) -> list[GpuInfo]:
        return declared_gpus(node, self.gpu_count, island=self.island, model="CPU-VGPU", memory_mb=self.memory_mb)

    def sample(self) -> list[GpuSample]:
        """A virtual GPU's "utilization" is the CPU use of the ranks on it (100 = one core busy), its
        "memory used" their resident memory: the load a real GPU would show, as far as a CPU can."""
        now = time.monotonic()
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
        by_gpu = self.rank_pids()
        samples, seen = [], {}
        for index in range(self.gpu_count):
            cpu_pct = memory_mb = 0.0
            for pid in by_gpu.get(index, []):
                fields = process_stat(pid)
                try:
                    rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if fields is None:
                    continue
                cpu_s = (int(fields[11]) + int(fields[12])) / ticks_per_s  # utime + stime
                seen[pid] = (cpu_s, now)
                before = self._cpu_seen.get(pid)
                if before is not None and now > before[1]:
                    cpu_pct += 100.0 * (cpu_s - before[0]) / (now - before[1])
                memory_mb += rss_pages * page_mb
            samples.append(
                GpuSample(index=index, utilization_pct=round(cpu_pct, 1), memory_used_mb=round(memory_mb, 1))
            )
        self._cpu_seen = seen
        return samples

    def device_env(self, gpus: tuple[int, ...], local_rank: int, neighbors: tuple[int, ...] = ()) -> dict[str, str]:
        # No CUDA devices here: a lease's neighbor shares are host memory to the runtime.
        return {jobenv.CUDA_VISIBLE_DEVICES: "", jobenv.VIRTUAL_GPUS: ",".join(map(str, gpus))}
