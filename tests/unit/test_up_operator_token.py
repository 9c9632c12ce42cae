"""A default ``gpuherd up`` had a read-only dashboard: no cancel, drain or audit from its pages
unless the user had made a token file. ``up`` now makes one, private to the user, and keeps it."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from apps.cli import build_parser
from apps.cluster import up
from gpuherd.errors import GpuherdError


@pytest.fixture
def layouts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The layout each ``up`` would start (nothing starts)."""
    seen: list[Any] = []

    class NotStarted(Exception):
        pass

    def cluster(data_dir: Path, layout: Any, **kw: Any) -> Any:
        seen.append(layout)
        raise NotStarted

    monkeypatch.setattr(up, "LocalCluster", cluster)
    monkeypatch.setattr(up, "_free_or_any", lambda port: None if port < 0 else 18080)
    seen.append(NotStarted)
    return seen


def _up(data: Path, layouts: list[Any], *argv: str) -> Any:
    args = build_parser().parse_args(["--data-dir", str(data), "up", "--agents", "1", *argv])
    with pytest.raises(layouts[0]):
        args.func(args)
    return layouts[-1]


def test_a_default_up_gives_its_dashboard_a_private_token_and_keeps_it(tmp_path: Path, layouts: list[Any]) -> None:
    data = tmp_path / "data"
    layout = _up(data, layouts)
    token_file = Path(layout.ui_token_file)
    assert token_file == data / "dashboard.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 16
    assert Path(_up(data, layouts).ui_token_file).read_text().strip() == token  # the next up keeps it
    assert Path(_up(data, layouts, "--fresh").ui_token_file).read_text().strip() != token  # a fresh one: a new one


def test_read_only_no_dashboard_and_a_given_token_file_make_none(tmp_path: Path, layouts: list[Any]) -> None:
    data = tmp_path / "data"
    assert _up(data, layouts, "--ui-read-only").ui_token_file is None
    assert _up(data, layouts, "--ui-port", "-1").ui_token_file is None
    given = tmp_path / "mine"
    given.write_text("x" * 20)
    assert _up(data, layouts, "--ui-token-file", str(given)).ui_token_file == str(given)
    assert not (data / "dashboard.token").exists()


def test_a_token_file_others_may_read_or_too_short_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    path = up.operator_token_file(data)
    path.chmod(0o644)
    with pytest.raises(GpuherdError, match=r"may be read by other users \(mode 644\).*chmod 600"):
        up.operator_token_file(data)
    path.chmod(0o600)
    path.write_text("short\n")
    with pytest.raises(GpuherdError, match="no usable token"):
        up.operator_token_file(data)


def test_what_to_try_after_the_demo_names_the_token_file(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--data-dir", str(tmp_path), "up", "--ui-token-file", "/x/dashboard.token"])
    assert "dashboard: http://127.0.0.1:8080/ (its operator token" in up.what_to_try(args, "http://127.0.0.1:8080/")
    assert "/x/dashboard.token" in up.what_to_try(args, "http://127.0.0.1:8080/")
    args = build_parser().parse_args(["--data-dir", str(tmp_path), "up", "--ui-read-only"])
    assert "token" not in up.what_to_try(args, "http://127.0.0.1:8080/")
