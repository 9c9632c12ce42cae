"""Review of trace jobs as gpuherd jobs: two trace ids are two jobs, none dropped (an id the trace
repeats is intake's to judge: ``test_analytics_cli``'s reused intake id)."""

from __future__ import annotations

from pathlib import Path

from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from services.analytics.traces import load_helios, submissions


def _trace(tmp_path: Path):
    # "j.1" and "j_1" are one gpuherd id (a NATS token has no dots); "j_1-2" is taken already.
    path = tmp_path / "cluster_log.csv"
    path.write_text(
        "job_id,user,vc,gpu_num,state,submit_time,start_time,end_time,duration\n"
        "j.1,u,a,1,COMPLETED,0,0,100,100\n"
        "j_1,u,a,1,COMPLETED,10,10,110,100\n"
        "j_1-2,u,a,1,COMPLETED,5,5,105,100\n"
        "j2,u,a,1,COMPLETED,30,30,130,100\n"
    )
    return load_helios(path)


def test_every_trace_job_is_submitted_under_an_id_of_its_own(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    jobs = [s.job for s in submissions(trace)]
    assert len(jobs) == 4
    assert len(set(jobs)) == 4
    assert jobs == ["j_1", "j_1-2", "j_1-3", "j2"]  # (in submission order, the first keeps its id)


def test_a_simulation_runs_every_trace_job(tmp_path: Path) -> None:
    result = simulate(submissions(_trace(tmp_path)), ClusterSpec(vcs={"a": VcSpec(nodes=1)}), "fifo")
    assert result.submitted == 4
    assert len(result.table.jobs) == 4
    assert (result.table.jobs["state"] == "completed").all()
