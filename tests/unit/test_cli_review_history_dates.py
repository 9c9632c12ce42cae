"""``gpuherd history`` (sacct's listing, often of days: ``--since 7d``) gives each time with its date:
it gave the time of day alone, so a job that started at 23:50 and ended at 00:10 the next day read
as ending before it started, and jobs of different days could not be told apart."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pytest

from apps.cli import accounting, common
from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.log.files import write_log_file
from tests.helpers import node, submit

START = 1_714_607_400.0  # 2024-05-01 23:50 UTC
END = START + 1_200.0  # 20 minutes later: the next day in UTC and in most zones near it


def test_history_gives_the_date_of_each_time(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    placed = ev.JobPlaced(
        id="p", at=START, source="scheduler", job="a", attempt=0, allocations=(ev.Allocation("n1", (0,)),)
    )
    events: list[ev.Event] = [
        node("n1", 1, at=START - 10),
        submit("a", 1, at=START - 5),
        placed,
        ev.JobStarted(id="s", at=START, source="agent.n1", job="a", attempt=0, node="n1"),
        ev.JobFinished(id="f", at=END, source="scheduler", job="a", attempt=0, outcome="completed"),
    ]
    path = tmp_path / "events.jsonl"
    write_log_file([Record(seq, e) for seq, e in enumerate(events, 1)], path)
    monkeypatch.setattr(common.console, "_width", 300)
    args = argparse.Namespace(
        log=str(path), json=False, user=None, vc=None, workflow=None, since=None, until=None, state=None, limit=200
    )
    assert accounting.cmd_history(args) == 0
    out = capsys.readouterr().out
    for at in (START, END):
        assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) in out, out
