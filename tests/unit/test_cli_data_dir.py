"""Where a CLI command finds its cluster: the data folder given, GPUHERD_DATA_DIR, or the nearest
.gpuherd with a cluster file in this folder or a parent (as git finds its repository); and what it
says when there is none."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from apps.cli import build_parser
from apps.cli.common import DEFAULT_NATS_URL, cluster_file, nats_url_of, open_cli_log
from gpuherd.errors import GpuherdError


def cluster_at(folder: Path, url: str) -> Path:
    data = folder / ".gpuherd"
    data.mkdir(parents=True)
    (data / "cluster.json").write_text(json.dumps({"nats_url": url}))
    return data / "cluster.json"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("NATS_URL", "GPUHERD_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_command_in_a_subfolder_finds_the_cluster_of_a_parent(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    made = cluster_at(tmp_path, "nats://127.0.0.1:46777")
    sub = tmp_path / "experiments" / "run1"
    sub.mkdir(parents=True)
    clean_env.chdir(sub)
    args = build_parser().parse_args(["jobs"])
    assert cluster_file(args) == made
    assert nats_url_of(args) == "nats://127.0.0.1:46777"


def test_the_nearest_cluster_wins_and_a_named_folder_is_not_looked_for_elsewhere(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    cluster_at(tmp_path, "nats://127.0.0.1:1111")
    inner = cluster_at(tmp_path / "team", "nats://127.0.0.1:2222")
    clean_env.chdir(tmp_path / "team")
    assert cluster_file(build_parser().parse_args(["jobs"])) == inner.relative_to(tmp_path / "team")
    named = build_parser().parse_args(["--data-dir", str(tmp_path / "elsewhere"), "jobs"])
    assert cluster_file(named) is None and nats_url_of(named) == DEFAULT_NATS_URL


def test_gpuherd_data_dir_names_the_folder(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    made = cluster_at(tmp_path / "ops", "nats://127.0.0.1:3333")
    clean_env.setenv("GPUHERD_DATA_DIR", str(made.parent))
    clean_env.chdir(tmp_path)
    assert nats_url_of(build_parser().parse_args(["jobs"])) == "nats://127.0.0.1:3333"


def test_no_cluster_anywhere_says_where_it_looked_and_what_to_pass(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.chdir(tmp_path)
    args = build_parser().parse_args(["--nats-url", "nats://127.0.0.1:1", "jobs"])
    with pytest.raises(GpuherdError, match="is `gpuherd up` running"):
        asyncio.run(open_cli_log(args))  # (a URL given: the question is whether it is up)
    args = build_parser().parse_args(["jobs"])
    assert nats_url_of(args) == DEFAULT_NATS_URL
    clean_env.setattr("apps.cli.common.DEFAULT_NATS_URL", "nats://127.0.0.1:1")  # (whatever serves 4222 here)
    with pytest.raises(GpuherdError, match=r"no cluster file \(\.gpuherd/cluster\.json\).*--data-dir"):
        asyncio.run(open_cli_log(args))
