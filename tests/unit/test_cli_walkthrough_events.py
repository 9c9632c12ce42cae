"""``gpuherd events --type JobPlaced,JobFinished --last 2`` printed nothing: it took the log's last
2 events and only then kept those of the types asked. ``--last N`` is the last N events that match."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec
import pytest

from apps.cli import build_parser, history
from gpuherd import events as ev
from gpuherd.log.inprocess import InProcessLog
from tests.helpers import finish, node, submit, tick


@pytest.fixture
def log_(monkeypatch: pytest.MonkeyPatch) -> InProcessLog:
    log_ = InProcessLog()
    placed = ev.JobPlaced(
        id="p-a", at=2.0, source="scheduler", job="a", attempt=0, allocations=(ev.Allocation("n1", (0,)),)
    )
    events: list[ev.Event] = [node("n1", 2), submit("a", at=1.0), placed, finish("a", at=3.0)]
    events += [tick(4.0 + i) for i in range(50)]  # (the matches are far from the log's end)
    asyncio.run(log_.append(events))

    async def opened(args: argparse.Namespace) -> InProcessLog:
        return log_

    monkeypatch.setattr(history, "open_cli_log", opened)
    return log_


def _types(argv: list[str], capsys: Any) -> list[str]:
    args = build_parser().parse_args(["events", "--json", *argv])
    assert args.func(args) == 0
    return [msgspec.json.decode(line)["type"] for line in capsys.readouterr().out.splitlines()]


def test_last_n_is_the_last_n_events_of_the_types_asked(log_: InProcessLog, capsys: Any) -> None:
    assert _types(["--type", "JobPlaced,JobFinished", "--last", "2"], capsys) == ["JobPlaced", "JobFinished"]
    assert _types(["--type", "JobPlaced,JobFinished", "--last", "1"], capsys) == ["JobFinished"]
    assert _types(["--job", "a", "--last", "5"], capsys) == ["JobSubmitted", "JobPlaced", "JobFinished"]
    assert _types(["--type", "NodeLost", "--last", "3"], capsys) == []  # (none: the whole log read, nothing)
    assert _types(["--last", "2"], capsys) == ["ClockTicked", "ClockTicked"]  # (no filter: the log's last 2)
