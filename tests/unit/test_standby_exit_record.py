"""The warm standby (gpuherd.train.standby): a pooled worker's exit record says how its process
really ended (the shim takes the record, and the agent's own, written when it reaps the process,
cannot replace it), and warming up leaves CUDA uninitialised."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ENDINGS = {
    "keyboard-interrupt": ("raise KeyboardInterrupt  # as a SIGINT would, in the script\n", -signal.SIGINT),
    "base-exception": ("class Stop(BaseException):\n    pass\n\nraise Stop()\n", 1),
}


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_pooled_worker_s_exit_record_is_the_code_its_process_ends_with(tmp_path: Path, ending: str) -> None:
    script, expected = ENDINGS[ending]
    (tmp_path / "script.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    standby = subprocess.Popen(
        [sys.executable, "-m", "gpuherd.train.standby"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert standby.stdout is not None and standby.stdin is not None
        assert standby.stdout.readline().startswith(b"gpuherd standby: warm")
        launch = {
            "argv": [sys.executable, "script.py"],
            "env": env,
            "cwd": str(tmp_path),
            "log": str(tmp_path / "worker.log"),
            "exit_file": str(tmp_path / "worker.exit"),
        }
        standby.stdin.write(json.dumps(launch).encode() + b"\n")
        standby.stdin.close()
        code = standby.wait(60)
    finally:
        if standby.poll() is None:
            standby.kill()
            standby.wait(10)
    assert code == expected
    assert json.loads((tmp_path / "worker.exit").read_text()) == {"code": expected, "by": "worker"}


WARM_PROBE = """
import json

import torch

used = []


def recorder(name, original):
    def recording(*args, **kwargs):
        used.append(name)
        return original(*args, **kwargs)

    return recording


for name in ("is_available", "device_count", "current_device", "init", "_lazy_init", "is_initialized"):
    setattr(torch.cuda, name, recorder(f"torch.cuda.{name}", getattr(torch.cuda, name)))
for name in ("backward", "grad"):
    setattr(torch.autograd, name, recorder(f"torch.autograd.{name}", getattr(torch.autograd, name)))

from gpuherd.train.standby import warm

warm()
print(json.dumps(used))
"""


@pytest.mark.timeout(60)
def test_warming_up_neither_asks_cuda_nor_runs_autograd() -> None:
    """Either would fix the process's CUDA_VISIBLE_DEVICES (the autograd engine's first run asks CUDA
    for its device count): the worker the standby becomes would see the standby's GPUs, not its own.
    In a fresh process, as a standby warms up (import-time calls count too)."""
    env = {k: v for k, v in os.environ.items() if k != "GPUHERD_WARM_CUDA"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    done = subprocess.run([sys.executable, "-c", WARM_PROBE], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
