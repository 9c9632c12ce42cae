"""The analytics commands (``gpuherd predict``, ``ces``, ``sim``) on inputs that are not what they
expect: logs with jobs that never ran, empty files, zero durations, negative options.

The command functions are called directly (``build_parser().parse_args`` then ``args.func``): the
CLI's ``main`` configures logging onto the captured stderr, which later tests then write to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from apps.cli import build_parser
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from gpuherd.log.files import write_log_file

START = 1.7e9  # a log's times are epoch seconds


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def _ran_and_cancelled_log(path: Path, jobs: int = 40) -> Path:
    """A log of ``jobs`` jobs that ran 100 s each and as many cancelled before they started."""
    spec = ev.JobSpec(name="train", user="ann", gpus=1, duration_s=100.0)
    on_n1 = (ev.Allocation(node="n1", gpus=(0,)),)
    events: list[ev.Event] = []
    for i in range(jobs):
        at = START + i * 300.0
        events += [
            ev.JobSubmitted(job=f"ran{i}", at=at, spec=spec, intake_source="t"),
            ev.JobPlaced(job=f"ran{i}", at=at + 1, attempt=1, allocations=on_n1),
            ev.JobStarted(job=f"ran{i}", at=at + 1, attempt=1, node="n1"),
            ev.JobSubmitted(job=f"cancelled{i}", at=at + 2, spec=spec, intake_source="t"),
            ev.JobFinished(job=f"cancelled{i}", at=at + 3, attempt=0, outcome="cancelled"),
            ev.JobFinished(job=f"ran{i}", at=at + 101, attempt=1, outcome="completed"),
        ]
    write_log_file([Record(seq, event) for seq, event in enumerate(events, 1)], path)
    return path


# -- predict ------------------------------------------------------------------------------------------


def test_predict_on_a_log_scores_only_jobs_that_ran_to_completion_and_says_what_it_left_out(
    tmp_path: Path, capsys: Any
) -> None:
    log = _ran_and_cancelled_log(tmp_path / "mixed.jsonl")
    assert _run(["predict", str(log), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["mixed"]
    # Scored against the cancelled jobs' run time of 0, the median (50 s) "beat" the model.
    assert result["model"]["jobs"] == 40 and result["trace_median"]["jobs"] == 40
    assert result["trace_median"]["MAE (s)"] == 0, "every job that ran took 100 s"
    assert result["model"]["within 2x"] >= 0.9, "learned from 100 s runs, not from cancelled zeros"
    assert result["rows"] == {"read": 80, "used": 40, "not_used": {"not completed (cancelled)": 40}}
    assert _run(["predict", str(log)]) == 0
    assert "mixed: 40 of 80 rows used; not used: 40 not completed (cancelled)" in capsys.readouterr().out


HELIOS_HEADER = "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue\n"


@pytest.mark.parametrize("command", ["predict", "sim"])
def test_a_trace_without_rows_is_refused_with_why_rather_than_a_traceback(tmp_path: Path, command: str) -> None:
    empty = tmp_path / "header_only.csv"
    empty.write_text(HELIOS_HEADER)
    with pytest.raises(GpuherdError, match=r"no usable jobs in .*header_only\.csv: it has no rows"):
        _run([command, str(empty)])


def test_an_accuracy_of_no_jobs_is_a_row_without_figures_not_an_error() -> None:
    import numpy as np

    from services.analytics.predict import accuracy

    assert accuracy(np.array([]), np.array([])).row() == {
        "jobs": 0,
        "MAE (s)": None,
        "median rel. error": None,
        "within 2x": None,
    }


# -- ces ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("time,active,total\n", r"no usable rows in .*seq\.csv: it has a header and no rows"),
        ("", r"seq\.csv: not a readable CSV"),
        ("time,active\n2017-10-03 00:00:00,3\n", r"seq\.csv: missing columns total"),
        ("time,active,total\n2017-10-03 00:00:00,3,10\nsoon,2,10\n", r"1 of its rows .* line 3"),
    ],
)
def test_ces_on_a_node_sequence_it_cannot_replay_says_why_rather_than_a_traceback(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "seq.csv"
    path.write_text(text)
    with pytest.raises(GpuherdError, match=problem):
        _run(["ces", str(path)])
