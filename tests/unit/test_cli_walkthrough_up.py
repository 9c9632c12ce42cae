"""``gpuherd up --demo philly --trace /tmp/nosuch.csv`` started the whole cluster, then stopped it
saying "philly.csv not found: pass --trace PATH" (it had been passed; the path was not named). The
trace, and a ``--vcs`` file, are now checked before anything starts (or ``--fresh`` deletes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apps.cli import build_parser
from apps.cluster import up
from gpuherd.errors import GpuherdError


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    started: list[Any] = []

    def cluster(*args: Any, **kw: Any) -> Any:
        started.append(args)
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(up, "LocalCluster", cluster)
    return started


def _up(tmp_path: Path, *argv: str) -> None:
    data = tmp_path / "data"
    args = build_parser().parse_args(["--data-dir", str(data), "up", "--agents", "1", "--ui-port", "-1", *argv])
    args.func(args)


def test_a_demo_trace_not_there_is_named_before_anything_starts(tmp_path: Path) -> None:
    missing = tmp_path / "nosuch.csv"
    demo = ("--demo", "philly", "--exit-after-demo")
    with pytest.raises(GpuherdError, match=rf"--trace {missing}: no such file: give the path of philly.csv"):
        _up(tmp_path, *demo, "--trace", str(missing))
    with pytest.raises(GpuherdError, match=rf"--trace {tmp_path}: is a folder"):
        _up(tmp_path, *demo, "--trace", str(tmp_path))


def test_a_vcs_file_not_there_is_named_before_fresh_deletes_the_data(tmp_path: Path) -> None:
    kept = tmp_path / "data" / "keep.txt"
    kept.parent.mkdir()
    kept.write_text("x")
    missing = tmp_path / "nosuch.yaml"
    with pytest.raises(GpuherdError, match=rf"{missing}: no such file"):
        _up(tmp_path, "--fresh", "--vcs", str(missing))
    assert kept.exists()
