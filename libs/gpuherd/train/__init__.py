"""What a training script imports: the job's place in the gang, and progress reports.

    from gpuherd import train

    ctx = train.init()              # reads the agent's env; joins the process group if WORLD_SIZE > 1
    model = ctx.wrap(model)         # DistributedDataParallel when there is more than one rank
    ...
    train.report(step, loss=loss)   # to the node agent (telemetry; the last one lands in JobFinished)
    ctx.maybe_profile(model, batch) # answers `gpuherd profile --job` (one file check otherwise)
    ctx.close()

A script started by hand (no agent, no env) runs as a single process.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuherd import control, jobenv
from gpuherd.train.report import report, send

if TYPE_CHECKING:
    import torch

    from gpuherd.train.elastic import Membership
    from gpuherd.train.profile import StepProfile

__all__ = [
    "ElasticSampler",
    "ElasticState",
    "JobContext",
    "Membership",
    "MemoryTiers",
    "accumulation_steps",
    "init",
    "profile_layers",
    "report",
]

_LAZY = {  # torch-heavy: imported when used, not by every script
    "profile_layers": "gpuherd.train.profile",
    "ElasticSampler": "gpuherd.train.elastic",
    "ElasticState": "gpuherd.train.elastic",
    "accumulation_steps": "gpuherd.train.elastic",
    "Membership": "gpuherd.train.elastic",
    "MemoryTiers": "gpuherd.train.memory",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


@dataclass
class JobContext:
    job_id: str
    attempt: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: str
    device: torch.device
    backend: str | None  # None when single-process (or elastic: the membership forms the group)
    elastic_worker: str | None = None  # this worker's identity when the job is elastic

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def elastic(self) -> bool:
        return self.elastic_worker is not None

    def membership(self, **options: Any) -> Membership | None:
        """An elastic job's worker: follows the generations the agent writes into the task folder
        (``ElasticState(..., membership=ctx.membership())``); None when the job is not elastic."""
        if self.elastic_worker is None:
            return None
        from gpuherd.train.elastic import Membership, PlanFile

        plans = PlanFile(Path(os.environ[jobenv.TASK_DIR]) / jobenv.ELASTIC_PLAN_FILE)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        return Membership(self.elastic_worker, plans, backend=backend, device=self.device, **options)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to this process's device; DistributedDataParallel when distributed."""
        model = model.to(self.device)
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def maybe_profile(
        self, model: torch.nn.Module, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None
    ) -> StepProfile | None:
        """Call once per step: when someone asked for a profile of this job (``gpuherd profile
        --job``), profile ``steps`` steps of ``model`` on ``batch`` here (this node's first rank;
        the model's own layers, without DDP's communication), hand it to the agent, and return it.
        Costs one file check per step otherwise."""
        task_dir = os.environ.get(jobenv.TASK_DIR)
        if not task_dir or self.local_rank != 0:
            return None
        request = _claim(Path(task_dir) / jobenv.PROFILE_REQUEST_FILE, self.rank)
        if request is None:
            return None
        from gpuherd.train.profile import profile_layers

        inner = getattr(model, "module", model) if self.distributed else model
        profile = profile_layers(inner, batch, loss_fn=loss_fn, warmup=1, repeats=max(1, int(request["steps"])))
        name = jobenv.profile_result_file(self.rank)
        tmp = Path(task_dir) / f".{name}.tmp"
        tmp.write_text(json.dumps(profile.to_dict()))
        tmp.replace(Path(task_dir) / name)
        send(control.ProfileReady, request=str(request.get("request", "")), file=name)
        return profile

    def close(self) -> None:
        import torch.distributed as dist

        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _claim(path: Path, rank: int) -> dict[str, Any] | None:
    """Take the request file (a rename: one process wins it) and read it."""
    if not path.exists():
        return None
    taken = path.with_name(f"{path.name}.rank{rank}")
    try:
        path.rename(taken)
        request = json.loads(taken.read_text())
        taken.unlink()
    except (OSError, ValueError):
        return None
    return request if isinstance(request, dict) and "steps" in request else None


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def init(*, timeout_s: float = 120.0) -> JobContext:
    """Read the environment the agent set; join the process group when there are several ranks.

    The device is ``cuda:LOCAL_RANK`` when CUDA devices are visible (the agent made exactly the
    job's GPUs visible), else the CPU; the backend is NCCL on GPUs, gloo on CPU."""
    import torch
    import torch.distributed as dist

    world_size = _int(jobenv.WORLD_SIZE, 1)
    local_rank = _int(jobenv.LOCAL_RANK, 0)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = None
    elastic_worker = os.environ.get(jobenv.ELASTIC_WORKER) or None
    if world_size > 1 and elastic_worker is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=_int(jobenv.RANK, 0),
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return JobContext(
        job_id=os.environ.get(jobenv.JOB_ID, "local"),
        attempt=_int(jobenv.ATTEMPT, 0),
        rank=_int(jobenv.RANK, 0),
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=_int(jobenv.LOCAL_WORLD_SIZE, 1),
        node=os.environ.get(jobenv.NODE, ""),
        device=device,
        backend=backend,
        elastic_worker=elastic_worker,
    )
