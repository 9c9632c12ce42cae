"""The shim's standby and CUDA: a standby that made its CUDA context becomes only a worker that
sees the GPUs it made it for, and one made for workers bound to their own GPUs makes none."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuherd import jobenv
from gpuherd.train.standby import WARM_CUDA
from services.nodeagent import taskfiles
from services.nodeagent.shim import Shim
from services.nodeagent.taskfiles import ProcLaunch, TaskDescription


def shim_of(tmp_path: Path, env: dict[str, str]) -> Shim:
    worker = ProcLaunch(argv=[sys.executable, "train.py"], env=env, log=str(tmp_path / "worker-0.log"), gpu=0)
    description = TaskDescription(
        procs=[worker], alive_file=str(tmp_path / "alive"), fence_after_s=60.0, kill_grace_s=1.0, elastic=True
    )
    taskfiles.write(tmp_path / taskfiles.TASK_FILE, description)
    return Shim(tmp_path)


def worker_seeing(devices: str | None) -> ProcLaunch:
    env = {} if devices is None else {jobenv.CUDA_VISIBLE_DEVICES: devices}
    return ProcLaunch(argv=[sys.executable, "train.py"], env=env, log="worker.log")


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Shim]]:
    """Makes a shim of the given worker environment; kills the standbys it started."""
    shims: list[Shim] = []

    def make(env: dict[str, str]) -> Shim:
        shims.append(shim_of(tmp_path, env))
        return shims[-1]

    yield make
    for shim in shims:
        if shim.standby is not None:
            shim.standby.kill()
            shim.standby.wait()


def test_a_standby_of_workers_bound_to_their_own_gpu_makes_no_cuda_context(started) -> None:
    shim = started({jobenv.CUDA_VISIBLE_DEVICES: "GPU-aaa", WARM_CUDA: "1"})
    shim.start_standby()
    assert shim.standby is not None
    environ = Path(f"/proc/{shim.standby.pid}/environ").read_bytes().split(b"\0")
    assert f"{WARM_CUDA}=1".encode() not in environ
    assert shim.standby_cuda is None
    assert shim._standby_fits(worker_seeing("GPU-bbb"))


def test_a_standby_that_made_its_context_becomes_only_a_worker_of_the_same_gpus(started) -> None:
    shim = started({WARM_CUDA: "1"})  # the workers share every GPU of the machine
    shim.start_standby()
    assert shim.standby_cuda == "*"
    assert shim._standby_fits(worker_seeing(None))
    assert not shim._standby_fits(worker_seeing("GPU-bbb"))
