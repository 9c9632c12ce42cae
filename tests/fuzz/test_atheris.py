"""A short run of the atheris harness (skipped where atheris did not install)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HARNESS = Path(__file__).with_name("atheris_intake.py")
ROOT = Path(__file__).resolve().parents[2]


def test_atheris_finds_no_crash_in_intake_or_decoding(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(HARNESS), "-runs=20000", "-max_len=512", f"-artifact_prefix={tmp_path}/"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done 20000 runs" in result.stderr
