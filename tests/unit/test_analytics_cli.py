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


# -- sim ----------------------------------------------------------------------------------------------


def test_a_trace_s_zero_second_jobs_are_not_used_and_counted_under_their_own_reason(
    tmp_path: Path, capsys: Any
) -> None:
    from services.analytics.traces import load_trace

    trace = tmp_path / "cluster_log.csv"
    trace.write_text(
        HELIOS_HEADER
        + "1,u1,vcA,1,6,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:00:10,2020-04-01 01:00:10,3600,10\n"
        # (Helios traces hold jobs cancelled before they ran, of 0 s, which intake would refuse)
        + "2,u2,vcA,1,6,1,CANCELLED,2020-04-01 00:05:00,2020-04-01 00:05:00,2020-04-01 00:05:00,0,0\n"
    )
    assert load_trace(trace).rejected == {"zero duration (never ran)": 1}
    assert _run(["sim", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == "cluster_log: 1 of 2 rows used; not used: 1 zero duration (never ran)"
    assert (out["fifo"]["submitted"], out["fifo"]["rejected"]) == (1, 0)


def test_sim_says_why_intake_rejected_jobs_by_reason(tmp_path: Path, capsys: Any) -> None:
    log = _ran_and_cancelled_log(tmp_path / "mixed.jsonl")  # (its cancelled jobs ran 0 s)
    assert _run(["sim", str(log), "--json"]) == 0
    fifo = json.loads(capsys.readouterr().out)["fifo"]
    assert fifo["rejected"] == 40
    assert fifo["rejected_reasons"] == {"`duration_s` must be positive, got 0.0": 40}
    assert _run(["sim", str(log)]) == 0
    shown = capsys.readouterr().out
    assert "rejected at intake, by reason:\n    40: `duration_s` must be positive, got 0.0\n" in shown


def test_sim_s_rejection_reasons_include_a_vc_the_cluster_lacks_not_a_job_id_the_trace_reused(
    tmp_path: Path, capsys: Any
) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("gpus_per_node: 4\nvcs:\n  vcA: {nodes: 1}\n")
    trace = tmp_path / "cluster_log.csv"
    row = "u1,{vc},{gpus},6,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:00:00,2020-04-01 00:01:00,60,0\n"
    trace.write_text(
        HELIOS_HEADER
        + "1," + row.format(vc="vcA", gpus=1)
        + "2," + row.format(vc="vcB", gpus=1)
        + "3," + row.format(vc="vcA", gpus=1)
        + "3," + row.format(vc="vcA", gpus=2)  # (the same job id, another job: the loader renames it 3-2)
    )  # fmt: skip
    for model in ("gpuherd", "helios"):  # (helios: each VC simulated alone, the unknown VC apart)
        assert _run(["sim", str(trace), "--cluster", str(cluster), "--model", model, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["trace"].endswith("changed: 1 a job id used by an earlier row, renamed <id>-<n>"), model
        fifo = out["fifo"]
        assert fifo["rejected"] == 1, model
        (unknown,) = fifo["rejected_reasons"]
        assert unknown.startswith("unknown virtual cluster 'vcB'"), model


def test_sim_refuses_a_negative_limit(tmp_path: Path) -> None:
    log = _ran_and_cancelled_log(tmp_path / "mixed.jsonl", jobs=2)
    with pytest.raises(GpuherdError, match="--limit"):  # (it simulated all but the last N jobs)
        _run(["sim", str(log), "--limit", "-1"])


# -- CES parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ('{"buffer_nodes": -4}', "buffer_nodes is a number of nodes >= 0, got -4"),
        ('{"horizon_s": -600}', "horizon_s is seconds >= 0, got -600"),
        ('{"history_s": -1}', "history_s is seconds >= 0"),
        ('{"lookback_s": NaN}', "lookback_s is seconds >= 0, got nan"),
        ('{"lookback_s": 30}', r"lookback_s \(30\) must be at least sample_s \(60\)"),
    ],
)
def test_ces_parameters_that_would_power_down_needed_nodes_are_refused(
    tmp_path: Path, params: str, problem: str
) -> None:
    from services.analytics.ces import CesParams

    sequence = tmp_path / "seq.csv"
    sequence.write_text("time,active,total\n2017-10-03 00:00:00,3,10\n2017-10-03 00:01:00,4,10\n")
    with pytest.raises(GpuherdError, match=problem):
        _run(["ces", str(sequence), "--params", params])
    with pytest.raises(GpuherdError, match=problem):  # (as the live service makes them, from --ces)
        CesParams(**json.loads(params))


def test_a_negative_buffer_would_have_powered_down_nodes_the_forecast_needs() -> None:
    from services.analytics.ces import CesParams, plan_power

    plan = plan_power(powered=100, total=100, forecast=50, now=1e9, last_down_at=0.0, params=CesParams(buffer_nodes=0))
    assert plan.down == 50, "down to the forecast, not below it"
    with pytest.raises(GpuherdError, match="buffer_nodes"):  # (-10 planned 60 down: 40 powered for 50)
        CesParams(buffer_nodes=-10)
