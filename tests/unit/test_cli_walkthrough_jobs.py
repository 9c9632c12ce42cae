"""``gpuherd jobs`` and ``why`` as a new user meets them: ``--status bogus`` printed an empty table
(exit 0); now it is refused, naming the statuses there are."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec
import pytest

from apps.cli import build_parser, common, jobs
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from gpuherd.log.files import write_log_file
from tests.helpers import finish, node, submit


def _log(tmp_path: Path, events: list[ev.Event]) -> str:
    path = tmp_path / "events.jsonl"
    write_log_file([Record(seq, e) for seq, e in enumerate(events, 1)], path)
    return str(path)


def _args(log: str, argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.log = log  # (`jobs` reads NATS; the command reads a --log file as the other commands do)
    return args


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common.console, "_width", 400)


@pytest.mark.parametrize("status", ["bogus", "done", "pending,finished"])
def test_jobs_status_that_no_job_has_is_refused_naming_the_statuses(status: str) -> None:
    args = build_parser().parse_args(["--nats-url", "nats://127.0.0.1:1", "jobs", "--status", status])
    with pytest.raises(GpuherdError, match=r"--status: no job status .*; the statuses are pending, placed, running,"):
        args.func(args)  # (refused before any connection is tried)


def test_jobs_status_takes_statuses_comma_separated(tmp_path: Path, capsys: Any, wide: None) -> None:
    log = _log(tmp_path, [node("n1", 1), submit("ok1", at=1.0), finish("ok1", at=2.0), submit("wait1", at=3.0)])
    for status, shown, hidden in (("completed", "ok1", "wait1"), ("pending", "wait1", "ok1")):
        assert jobs.cmd_jobs(_args(log, ["jobs", "--status", status])) == 0
        out = capsys.readouterr().out
        assert shown in out and hidden not in out, out
    assert jobs.cmd_jobs(_args(log, ["jobs", "--status", "pending, completed"])) == 0
    out = capsys.readouterr().out
    assert "ok1" in out and "wait1" in out, out


def test_why_of_a_completed_job_says_its_status_once(tmp_path: Path, capsys: Any, wide: None) -> None:
    """It printed "ok1 (ok1) is completed: completed"."""
    log = _log(tmp_path, [node("n1", 1), submit("ok1", at=1.0), finish("ok1", at=2.0)])
    assert jobs.cmd_why(_args(log, ["why", "ok1"])) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].rstrip() == "ok1 (ok1) is completed", out  # (then its waits: `why` replays them)


def test_why_of_an_ended_job_with_a_reason_gives_it(tmp_path: Path, capsys: Any, wide: None) -> None:
    failed = msgspec.structs.replace(finish("bad1", at=2.0, outcome="failed"), reason="rank 0 exited with code 3")
    log = _log(tmp_path, [node("n1", 1), submit("bad1", at=1.0), failed])
    assert jobs.cmd_why(_args(log, ["why", "bad1"])) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].rstrip() == "bad1 (bad1) is failed: rank 0 exited with code 3", out
