"""The warm standby on a real GPU: the worker it becomes sees the GPU its own launch names, not the
standby's. Skipped where CUDA is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(120),
]


def test_a_standby_warmed_without_a_gpu_becomes_a_worker_that_sees_the_one_it_is_given(tmp_path: Path) -> None:
    """Once a process asked CUDA anything (the autograd engine's first run does), its
    CUDA_VISIBLE_DEVICES is fixed: a standby that had warmed up with a backward saw no GPU as
    the worker it became."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    (tmp_path / "script.py").write_text(
        "import json, torch\nprint(json.dumps({'devices': torch.cuda.device_count()}), file=open('seen.json', 'w'))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "GPUHERD_WARM_CUDA"}
    base["PYTHONPATH"] = os.pathsep.join(sys.path)
    standby = subprocess.Popen(
        [sys.executable, "-m", "gpuherd.train.standby"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**base, "CUDA_VISIBLE_DEVICES": ""},  # no GPU while it warms up
    )
    try:
        assert standby.stdout is not None and standby.stdin is not None
        assert standby.stdout.readline().startswith(b"gpuherd standby: warm")
        launch = {
            "argv": [sys.executable, "script.py"],
            "env": {**base, "CUDA_VISIBLE_DEVICES": given},
            "cwd": str(tmp_path),
            "log": str(tmp_path / "worker.log"),
        }
        standby.stdin.write(json.dumps(launch).encode() + b"\n")
        standby.stdin.close()
        assert standby.wait(90) == 0, (tmp_path / "worker.log").read_text()
    finally:
        if standby.poll() is None:
            standby.kill()
            standby.wait(10)
    assert json.loads((tmp_path / "seen.json").read_text()) == {"devices": 1}
