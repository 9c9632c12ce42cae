"""``gpuherd sim --model helios`` against the Helios artifact's simulator, on a sample of Philly.

The peer's numbers below are its own output on the same input: the first 800 jobs of its Philly
window (``tests/fixtures/philly-sample.csv``), each VC at half its peak demand, its estimate noise
for QSSF; obtained with ``bench/bench_sim.py --peer ../shared/peers/helios-qssf --trace
tests/fixtures/philly-sample.csv --json`` (the peer is not needed to run this test).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.sim.helios import helios_workload, noisy_estimates
from apps.sim.model import GPUHERD, HELIOS, SimModel
from apps.sim.run import simulate
from services.analytics.jobs import job_table, summarize
from services.analytics.traces import job_id_for, load_trace, submissions
from services.nodeagent.executors.base import TaskKey, TaskLaunch
from services.nodeagent.executors.sim import SimTasks

SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "philly-sample.csv"

# policy -> VC ("all": every job) -> (average JCT, average queueing), seconds, as the peer printed them.
PEER: dict[str, dict[str, tuple[float, float]]] = {
    "fifo": {
        "all": (20651.69875, 4297.2225),
        "103959": (265.8462, 0.0),
        "11cb48": (157.6667, 0.0),
        "2869ce": (395.0, 21.5),
        "6c71a0": (73698.0, 28683.8125),
        "7f04ca": (1220617.1429, 307356.2857),
        "b436b2": (1192621.0, 0.0),
        "e13805": (115038.0, 0.0),
        "ed69ec": (78748.32, 9509.4),
        "ee9e8c": (110260.2, 18340.2),
    },
    "sjf": {
        "all": (20295.87375, 3941.3975),
        "103959": (265.8462, 0.0),
        "11cb48": (157.6667, 0.0),
        "2869ce": (395.0, 21.5),
        "6c71a0": (63684.25, 18670.0625),
        "7f04ca": (1204202.7143, 290941.8571),
        "b436b2": (1192621.0, 0.0),
        "e13805": (115038.0, 0.0),
        "ed69ec": (78748.32, 9509.4),
        "ee9e8c": (110260.2, 18340.2),
    },
    "qssf": {
        "all": (20327.66875, 3973.1925),
        "103959": (265.8462, 0.0),
        "11cb48": (157.6667, 0.0),
        "2869ce": (395.0, 21.5),
        "6c71a0": (63684.25, 18670.0625),
        "7f04ca": (1204202.7143, 290941.8571),
        "b436b2": (1192621.0, 0.0),
        "e13805": (115038.0, 0.0),
        "ed69ec": (78748.32, 9509.4),
        "ee9e8c": (111487.8, 19567.8),
    },
    "srtf": {
        "all": (19230.13, 2873.54),
        "103959": (266.8462, 0.0),
        "11cb48": (158.6667, 0.0),
        "2869ce": (396.5, 22.0),
        "6c71a0": (52939.5, 7916.375),
        "7f04ca": (1123079.2857, 209808.8571),
        "b436b2": (1192622.0, 0.0),
        "e13805": (115039.0, 0.0),
        "ed69ec": (78749.68, 9509.76),
        "ee9e8c": (100365.8, 8438.8),
    },
}
# How close: FIFO, SJF and QSSF within 0.5% overall and 2% per VC; SRTF within 2% overall (its
# preemption rules differ: the peer re-sorts running and waiting jobs by remaining time every second).
TOLERANCE = {"fifo": (0.005, 0.02), "sjf": (0.005, 0.02), "qssf": (0.005, 0.02), "srtf": (0.02, None)}


def run(policy: str, model: SimModel = HELIOS) -> dict[str, dict[str, float]]:
    trace, cluster = helios_workload(load_trace(SAMPLE))
    given = {job_id_for(j): s for j, s in noisy_estimates(trace.jobs).items()} if policy == "qssf" else None
    start = trace.origin
    result = simulate(submissions(trace, start=start), cluster, policy, start=start, model=model, estimates=given)
    assert result.submitted == len(trace.jobs) and result.rejected == 0
    return summarize(job_table(result.records).jobs)


@pytest.mark.parametrize("policy", sorted(TOLERANCE))
def test_the_helios_model_reproduces_the_helios_simulator(policy: str) -> None:
    ours = run(policy)
    overall, per_vc = TOLERANCE[policy]
    for vc, (jct, queue) in PEER[policy].items():
        if vc != "all" and per_vc is None:
            continue
        rel = overall if vc == "all" else per_vc
        assert ours[vc]["avg_jct_s"] == pytest.approx(jct, rel=rel), (vc, "JCT")
        if vc == "all":
            assert ours[vc]["avg_queue_s"] == pytest.approx(queue, rel=rel), (vc, "queueing")


def test_gpuherd_s_own_model_differs_where_the_models_differ() -> None:
    """The same sample under gpuherd's model (shared pool, backfill, spread placement) queues less."""
    assert run("fifo", GPUHERD)["all"]["avg_queue_s"] < PEER["fifo"]["all"][1]


def test_switches_override_the_model_one_by_one() -> None:
    model = HELIOS.with_switches(backfill=True, partition_vcs=None)
    assert model.backfill and model.partition_vcs and model.consolidate
    assert (HELIOS.checkpoint_cost(1), HELIOS.checkpoint_cost(8), HELIOS.checkpoint_cost(16)) == (7.0, 30.0, 60.0)
    assert HELIOS.policy_params() == {"preemption_grace_s": 0.0, "max_preemptions_per_hour": 1e9}


def test_a_resumed_sim_task_pays_a_restore_for_each_preemption() -> None:
    from gpuherd import events as ev

    spec = ev.JobSpec(name="j", user="u", gpus=8, duration_s=100.0)
    tasks = SimTasks(HELIOS.checkpoint_cost)
    third = TaskLaunch(key=TaskKey("j", 2), spec=spec, gpus=tuple(range(8)), attained_s=40.0)
    assert tasks.start(third, now=1000.0) == 1000.0 + (100.0 - 40.0) + 2 * 30.0
    assert SimTasks().start(third, now=1000.0) == 1000.0 + 60.0, "no cost without the switch"


def test_the_helios_model_sees_jobs_as_the_peer_does() -> None:
    from gpuherd import events as ev

    def job(gpus: int, duration_s: float) -> ev.JobSubmitted:
        spec = ev.JobSpec(name="j", user="u", gpus=gpus, duration_s=duration_s)
        return ev.JobSubmitted(job=f"j{gpus}", spec=spec, intake_source="trace")

    seen = list(HELIOS.jobs([job(4, 10.2), job(16, 0.4), job(12, 7.0)], gpus_per_node=8))
    assert [(j.spec.nodes, j.spec.duration_s) for j in seen] == [(1, 11.0), (2, 1.0), (None, 7.0)]
    assert [j.spec for j in GPUHERD.jobs([job(4, 10.2)], gpus_per_node=8)] == [job(4, 10.2).spec], "as submitted"


def test_vcs_simulated_in_parallel_give_the_logs_of_one_process() -> None:
    trace, cluster = helios_workload(load_trace(SAMPLE))
    runs = [
        simulate(submissions(trace, start=trace.origin), cluster, "srtf", start=trace.origin, model=HELIOS, workers=n)
        for n in (1, 2)
    ]
    assert list(runs[0].logs) == list(runs[1].logs) == list(cluster.vcs)
    assert [r.event for r in runs[0].records] == [r.event for r in runs[1].records]


def test_estimates_for_every_job_leave_the_duration_model_out_and_the_log_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """QSSF on estimates for every job: the model is not trained (its predictions would go unused),
    and the log is the one of a run that trains it. With one job lacking an estimate, it is trained."""
    from services.analytics.decide import AnalyticsDecider

    trace, cluster = helios_workload(load_trace(SAMPLE))
    given = {job_id_for(j): s for j, s in noisy_estimates(trace.jobs).items()}
    learned: list[bool] = []
    forced: dict[str, bool] = {}
    make = AnalyticsDecider.__init__

    def made(self: AnalyticsDecider, **kwargs: object) -> None:
        make(self, **{**kwargs, **forced})  # type: ignore[arg-type]
        learned.append(self.learn)

    monkeypatch.setattr(AnalyticsDecider, "__init__", made)

    def qssf(estimates: dict[str, float]) -> list:
        learned.clear()
        start = trace.origin
        result = simulate(
            submissions(trace, start=start), cluster, "qssf", start=start, model=HELIOS, estimates=estimates, workers=1
        )
        return [r.event for r in result.records]

    without_model = qssf(given)
    assert learned and not any(learned)
    forced["learn"] = True
    assert qssf(given) == without_model
    del forced["learn"]
    qssf(dict(list(given.items())[1:]))
    assert learned and all(learned), "a job without an estimate gets the model's prediction"
    with pytest.raises(ValueError, match="needs estimates"):
        make(AnalyticsDecider.__new__(AnalyticsDecider), learn=False)


def test_gpuherd_sim_takes_the_model_and_its_switches(tmp_path: Path) -> None:
    import json

    from apps.cli import build_parser
    from gpuherd.log.files import read_log_file

    args = build_parser().parse_args(
        ["sim", str(SAMPLE), "--model", "helios", "--backfill", "--limit", "200", "--out", str(tmp_path), "--json"]
    )
    assert args.func(args) == 0
    summary = json.loads((tmp_path / "fifo" / "summary.json").read_text())
    assert summary["submitted"] == 200
    logs = sorted(p.parent.name for p in (tmp_path / "fifo").glob("*/events.jsonl"))
    assert logs and set(logs) <= {str(vc) for vc in load_trace(SAMPLE).jobs["vc"].unique()}, "one log per VC"
    policy = [r.event for r in read_log_file(tmp_path / "fifo" / logs[0] / "events.jsonl")]
    configured = next(e for e in policy if e.__class__.__name__ == "PolicyConfigured")
    assert configured.backfill is True, "--backfill overrides the model's choice"
    assert configured.params["preemption_grace_s"] == 0.0
