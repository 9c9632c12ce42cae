"""The shim fences its task by the monotonic clock: a step of the host's wall clock (the nemesis'
clock fault; NTP on a real host) must neither hide a silent agent nor fence a live one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from services.nodeagent.shim import Shim


def shim_for(tmp_path: Path, fence_after_s: float = 0.5) -> tuple[Shim, Path]:
    alive = tmp_path / "alive"
    alive.touch()
    spec = {"procs": [], "alive_file": str(alive), "fence_after_s": fence_after_s, "kill_grace_s": 1.0}
    (tmp_path / "task.json").write_text(json.dumps(spec))
    return Shim(tmp_path), alive


def test_a_wall_clock_stepped_back_does_not_hide_a_silent_agent(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    shim, _ = shim_for(tmp_path)
    assert not shim.fenced()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 600)  # the host's clock steps 10 minutes back
    time.sleep(0.7)  # the agent touches nothing: silent past fence_after_s
    assert shim.fenced(), "by the wall clock the file looks 10 minutes young; it is not"


def test_a_wall_clock_stepped_forward_does_not_fence_a_live_agent(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    shim, alive = shim_for(tmp_path)
    assert not shim.fenced()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600)  # the host's clock steps 10 minutes ahead
    for _ in range(4):
        time.sleep(0.2)
        alive.touch()  # the agent keeps renewing its lease
        assert not shim.fenced()


def test_an_alive_file_already_stale_at_start_fences_at_once(tmp_path) -> None:
    shim, alive = shim_for(tmp_path)
    old = time.time() - 60
    os.utime(alive, (old, old))
    assert shim.fenced(), "the agent was gone long before the shim started"
