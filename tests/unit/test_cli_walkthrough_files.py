"""``gpuherd submit FILE`` and ``gpuherd up --vcs FILE`` with a file that is not there (or a folder):
they printed a FileNotFoundError (IsADirectoryError) traceback; now an error naming the path."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.cli import build_parser
from apps.cluster.up import load_vc_file
from gpuherd.errors import GpuherdError


@pytest.mark.parametrize("name", ["nosuch.yaml", "nosuch.json"])
def test_submit_of_a_missing_file_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["submit", name])
    with pytest.raises(GpuherdError, match=rf"{name}: no such file \(looked in .*\): check the path"):
        args.func(args)


def test_submit_of_a_folder_says_it_is_a_folder(tmp_path: Path) -> None:
    args = build_parser().parse_args(["submit", str(tmp_path)])
    with pytest.raises(GpuherdError, match="is a folder, not a file"):
        args.func(args)


def test_up_vcs_of_a_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nosuch.yaml"
    with pytest.raises(GpuherdError, match=f"{missing}: no such file: check the path"):
        load_vc_file(str(missing))
    with pytest.raises(GpuherdError, match="is a folder, not a file"):
        load_vc_file(str(tmp_path))
