"""A short run of the atheris harness (skipped where atheris did not install)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HARNESS = Path(__file__).with_name("atheris_intake.py")
SEEDS = Path(__file__).with_name("seeds")  # valid submissions: mutated, they reach past the JSON parser
DICTIONARY = Path(__file__).with_name("intake.dict")  # the spec's field names and edge numbers
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_atheris_finds_no_crash_in_intake_or_decoding(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            "-runs=20000",
            # CI (GPUHERD_FUZZ_SEED set by .ci/run) fuzzes from a fixed seed, so its verdict does
            # not hang on the seed; elsewhere each run explores from a new one.
            *([f"-seed={os.environ['GPUHERD_FUZZ_SEED']}"] if os.environ.get("GPUHERD_FUZZ_SEED") else []),
            "-max_len=1024",
            f"-dict={DICTIONARY}",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),  # (new inputs go to the first folder; the seeds stay as they are)
            str(SEEDS),
        ],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done 20000 runs" in result.stderr
