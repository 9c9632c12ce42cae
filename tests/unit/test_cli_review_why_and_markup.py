"""The CLI on hand-made logs (``--log`` files, through the command functions): ``why`` and ``jobs``
say where a job is now (a running job's last requeue is history, not why it runs), and the words
submitters wrote (names, users, reasons) are printed as they are, never read as rich markup."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec
import pytest

from apps.cli import accounting, common, jobs, nodes
from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.log.files import write_log_file
from tests.helpers import node, placed, submit

REQUEUED = "node n1 lost: no heartbeat for 30 s"


def _placed(job: str, attempt: int, at: float, reason: str = "") -> ev.JobPlaced:
    return placed(job, ("n1", (0,)), attempt=attempt, at=at, reason=reason)


def _log(tmp_path: Path, events: list[ev.Event]) -> str:
    path = tmp_path / "events.jsonl"
    write_log_file([Record(seq, e) for seq, e in enumerate(events, 1)], path)
    return str(path)


def _requeued_then_running(tmp_path: Path) -> str:
    return _log(
        tmp_path,
        [
            node("n1", 2),
            submit("a", 1, at=1.0),
            _placed("a", 0, 2.0),
            ev.JobStarted(id="s0", at=3.0, source="agent.n1", job="a", attempt=0, node="n1"),
            ev.JobRequeued(id="rq", at=4.0, source="scheduler", job="a", attempt=0, reason=REQUEUED),
            _placed("a", 1, 5.0, reason="first fit"),
            ev.JobStarted(id="s1", at=6.0, source="agent.n1", job="a", attempt=1, node="n1"),
        ],
    )


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common.console, "_width", 400)  # (rows on one line each)


def _args(log: str, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(log=log, nats_url=None, data_dir=".gpuherd", json=False, **kw)


def test_why_a_running_job_that_was_requeued_once_is_not_its_old_requeue(tmp_path: Path, capsys: Any) -> None:
    log = _requeued_then_running(tmp_path)
    assert jobs.cmd_why(_args(log, job="a")) == 0
    out = capsys.readouterr().out
    assert "is running" in out and REQUEUED not in out, out
    args = _args(log, job="a")
    args.json = True
    jobs.cmd_why(args)
    answer = msgspec.json.decode(capsys.readouterr().out)
    assert answer["status"] == "running" and answer["attempt"] == 1
    assert answer["why"] == "first fit"


def test_the_jobs_table_gives_a_running_job_its_placement_not_its_old_requeue(
    tmp_path: Path, capsys: Any, wide: None
) -> None:
    log = _requeued_then_running(tmp_path)
    assert jobs.cmd_jobs(_args(log, status=None, workflow=None, array=None, limit=50)) == 0
    out = capsys.readouterr().out
    assert "first fit" in out and REQUEUED not in out, out


MARKUP = [("exp[lr=0.1]", "bob"), ("a[/x]", "carol[/b]"), ("[bold]loud", "[red]dave")]


def _named(tmp_path: Path) -> str:
    events: list[ev.Event] = [node("n1", 8)]
    for n, (name, user) in enumerate(MARKUP):
        spec = submit(f"j{n}", 1, at=1.0 + n).spec
        spec = msgspec.structs.replace(spec, name=name, user=user)
        events.append(
            ev.JobSubmitted(id=f"in-{n}", at=1.0 + n, source="test", job=f"j{n}", spec=spec, intake_source="test")
        )
    events.append(_placed("j0", 0, 10.0, reason="[/placed] best fit"))
    reason = "cancelled [urgent] by [/ops]"
    events.append(
        ev.JobFinished(id="f0", at=11.0, source="scheduler", job="j0", attempt=0, outcome="cancelled", reason=reason)
    )
    events.append(ev.NodeDrained(id="d1", at=12.0, source="cli", node="n1", reason="[/maintenance] fans"))
    return _log(tmp_path, events)


def test_names_users_and_reasons_are_printed_as_written(tmp_path: Path, capsys: Any, wide: None) -> None:
    log = _named(tmp_path)
    assert jobs.cmd_jobs(_args(log, status=None, workflow=None, array=None, limit=50)) == 0
    out = capsys.readouterr().out
    for name, user in MARKUP:
        assert name in out and user in out, (name, user, out)
    assert "cancelled [urgent] by [/ops]" in out
    for job in ("j0", "j1"):
        assert jobs.cmd_why(_args(log, job=job)) == 0
    out = capsys.readouterr().out
    assert "exp[lr=0.1]" in out and "a[/x]" in out and "[/ops]" in out, out
    assert nodes.cmd_nodes(_args(log)) == 0
    assert "[/maintenance] fans" in capsys.readouterr().out


def test_history_prints_names_users_and_reasons_as_written(tmp_path: Path, capsys: Any, wide: None) -> None:
    log = _named(tmp_path)
    args = _args(log, user=None, vc=None, workflow=None, since=None, until=None, state=None, limit=200)
    assert accounting.cmd_history(args) == 0
    out = capsys.readouterr().out
    assert "exp[lr=0.1]" in out and "cancelled [urgent] by [/ops]" in out, out


def test_an_error_naming_what_was_given_is_printed_as_given() -> None:
    """``main``'s error line holds what the user typed: ``[/x]`` in it stopped the command with a
    MarkupError traceback instead of the error (and exit code 2)."""
    import os
    import subprocess
    import sys

    env = os.environ | {"NATS_URL": "nats://127.0.0.1:1"}  # (refused before any connection)
    command = [str(Path(sys.executable).parent / "gpuherd"), "events", "--type", "Job[/x]Placed"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Job[/x]Placed" in result.stdout, result.stdout
