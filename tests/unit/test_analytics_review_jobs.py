"""Review of the job-table summaries: utilization and the report's usage table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from services.analytics.jobs import utilization
from services.analytics.report import write_report
from services.analytics.traces import load_helios


def _helios(tmp_path: Path, rows: list[tuple[str, str, int, int, int]]) -> Path:
    """Rows of (job_id, vc, gpus, start, end) in the Helios schema, submitted at their start."""
    lines = ["job_id,user,vc,gpu_num,state,submit_time,start_time,end_time,duration"]
    for job, vc, gpus, start, end in rows:
        lines.append(f"{job},u,{vc},{gpus},COMPLETED,{start},{start},{end},{end - start}")
    path = tmp_path / "cluster_log.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_utilization_counts_the_jobs_of_no_vc(tmp_path: Path) -> None:
    # Two 1-GPU jobs over the same hour, one with no VC: a 2-GPU cluster is wholly busy.
    trace = load_helios(_helios(tmp_path, [("a", "vc1", 1, 0, 3600), ("b", "", 1, 0, 3600)]))
    assert trace.jobs["vc"].isna().sum() == 1
    util = utilization(trace.jobs, 2, bucket_s=3600.0)
    assert util["all"].tolist() == pytest.approx([1.0])


def test_report_usage_table_counts_busy_gpus_overall(tmp_path: Path) -> None:
    # With no capacity given the usage table is in busy GPUs: per VC and overall (3 GPUs busy).
    trace = load_helios(_helios(tmp_path, [("a", "x", 1, 0, 3600), ("b", "y", 2, 0, 3600)]))
    write_report(trace, tmp_path / "report")
    usage = pd.read_csv(tmp_path / "report" / "vc_usage.csv")
    assert usage["x"].tolist() == pytest.approx([1.0])
    assert usage["y"].tolist() == pytest.approx([2.0])
    assert usage["all"].tolist() == pytest.approx([3.0])
