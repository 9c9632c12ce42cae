"""At 80 columns (a terminal's default; and what a pipe got) the tables of ``jobs``, ``history``,
``nodes`` and ``rescales`` cut job ids to "j93…": the id a user types into ``why``/``logs``/``cancel``
could not be read or copied. Ids are now whole on one line; names and reasons fold, never "…"."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from apps.cli import accounting, common, jobs, nodes
from apps.cli.rescales import rescale_table
from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.log.files import write_log_file
from tests.helpers import finish, node, submit

IDS = ("j93a8b7c6d5e", "j1f2e3d4c5b6", "j00aa11bb22c")
REASON = "vc vision is at its quota of 16 GPUs; resnet50-sweep-with-a-long-name waits for 4 more"


@pytest.fixture(autouse=True)
def narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common.console, "_width", 80)


def _log(tmp_path: Path) -> str:
    events: list[ev.Event] = [node("sim-node-1", 8), submit(IDS[0], 8, at=1.0)]
    events.append(
        ev.JobPlaced(
            id="p0",
            at=2.0,
            source="scheduler",
            job=IDS[0],
            attempt=0,
            allocations=(ev.Allocation("sim-node-1", tuple(range(8))),),
            reason=REASON,
        )
    )
    events += [submit(IDS[1], 4, at=3.0), submit(IDS[2], 1, at=4.0), finish(IDS[2], at=5.0, outcome="cancelled")]
    events.append(ev.NodeDrained(id="d1", at=6.0, source="cli", node="sim-node-1", reason=REASON))
    path = tmp_path / "events.jsonl"
    write_log_file([Record(seq, e) for seq, e in enumerate(events, 1)], path)
    return str(path)


def _args(log: str, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(log=log, nats_url=None, data_dir=".gpuherd", json=False, **kw)


def _whole(ids: tuple[str, ...], out: str) -> None:
    for job in ids:
        assert job in out, (job, out)
    assert "j93…" not in out and "j1f…" not in out, out


def test_jobs_at_80_columns_shows_every_id_whole(tmp_path: Path, capsys: Any) -> None:
    assert jobs.cmd_jobs(_args(_log(tmp_path), status=None, workflow=None, array=None, limit=50)) == 0
    out = capsys.readouterr().out
    _whole(IDS, out)
    assert all(len(line) <= 80 for line in out.splitlines()), out


def test_history_at_80_columns_shows_every_id_whole(tmp_path: Path, capsys: Any) -> None:
    args = _args(_log(tmp_path), user=None, vc=None, workflow=None, since=None, until=None, state=None, limit=200)
    assert accounting.cmd_history(args) == 0
    _whole(IDS[2:], capsys.readouterr().out)


def test_nodes_shows_its_node_whole_and_every_job_on_it(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jobs column was cut at 60 characters: the 5th job id of a node was "j00aa11"."""
    many = tuple(f"j{n:02d}aa11bb22c" for n in range(6))
    events: list[ev.Event] = [node("sim-node-1", 8)]
    for n, job in enumerate(many):
        events.append(submit(job, 1, at=1.0 + n))
        allocation = (ev.Allocation("sim-node-1", (n,)),)
        events.append(ev.JobPlaced(id=f"p{n}", at=2.0 + n, source="s", job=job, attempt=0, allocations=allocation))
    events.append(ev.NodeDrained(id="d1", at=9.0, source="cli", node="sim-node-1", reason=REASON))
    path = tmp_path / "nodes.jsonl"
    write_log_file([Record(seq, e) for seq, e in enumerate(events, 1)], path)
    assert nodes.cmd_nodes(_args(str(path))) == 0
    assert "sim-node-1" in capsys.readouterr().out  # (at 80 columns: the node's name whole)
    monkeypatch.setattr(common.console, "_width", 400)
    assert nodes.cmd_nodes(_args(str(path))) == 0
    _whole(many, capsys.readouterr().out)


def test_rescales_at_80_columns_shows_the_job_id_whole(capsys: Any) -> None:
    row = {
        "job": IDS[0],
        "attempt": 0,
        "generation": 3,
        "kind": "grow",
        "gpus": "4 -> 8",
        "decided_at": 1.0,
        "outcome": "completed",
        "reason": REASON,
    } | dict.fromkeys(("notice_s", "wait_s", "reform_s", "restore_s", "first_step_s", "pause_s", "total_s"), 1.5)
    common.console.print(rescale_table([row], "rescales (1)"))
    _whole(IDS[:1], capsys.readouterr().out)
