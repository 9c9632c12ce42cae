"""Elastic jobs at the cluster level, simulated with the live deciders: the elastic service shrinks
elastic jobs so a waiting rigid job that fits once they are at their minimum does start (it never
starves behind GPUs lent to them), and the job table counts what rescales cost."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.elastic import STEP_S, ElasticWorkload, make_elastic
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.scaling import with_efficiency
from tests.helpers import submit

LONG_S = 1e6  # the elastic jobs run far longer than the rigid job may wait


def _elastic(job: str, gpus: int, high: int, efficiency: float) -> ev.JobSubmitted:
    draft = submit(job, gpus, duration=LONG_S)
    spec = msgspec.structs.replace(
        draft.spec, elastic=ev.Elastic(min=1, max=high), scaling=with_efficiency(efficiency, 8, 1, STEP_S)
    )
    return msgspec.structs.replace(draft, spec=spec)


@st.composite
def clusters_with_a_late_rigid_job(draw: st.DrawFn) -> tuple[ClusterSpec, list[ev.JobSubmitted], int]:
    nodes = draw(st.integers(1, 3))
    per_node = draw(st.sampled_from([4, 8]))
    total = nodes * per_node
    jobs, used = [], 0
    for i in range(draw(st.integers(1, 4))):
        gpus = draw(st.integers(1, per_node))
        if used + gpus > total:
            break
        used += gpus
        jobs.append(_elastic(f"e{i}", gpus, per_node, draw(st.floats(0.6, 0.95))))
    room = total - len(jobs)  # every elastic job at its minimum (1 GPU)
    rigid = draw(st.integers(1, min(per_node, room)))
    arrives = draw(st.sampled_from([50.0, 400.0, 5000.0]))  # before or after they grew into idle GPUs
    jobs.append(submit("rigid", rigid, duration=100.0, at=arrives))
    cluster = ClusterSpec(vcs={"default": VcSpec(nodes=nodes)}, gpus_per_node=per_node)
    return cluster, jobs, rigid


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters_with_a_late_rigid_job())
def test_a_rigid_job_that_fits_once_elastic_jobs_shrink_to_their_minimum_never_starves(case) -> None:
    cluster, jobs, rigid_gpus = case
    arrives = jobs[-1].at
    result = simulate(jobs, cluster, "fifo", elastic=True, keep_log=False)
    rigid = result.table.jobs.set_index("name").loc["rigid"]
    assert rigid["start_time"] - arrives < 60.0, f"the rigid {rigid_gpus}-GPU job waited for more than shrinks cost"


def test_the_table_counts_each_job_s_gpu_seconds_rescales_and_pauses() -> None:
    cluster = ClusterSpec(vcs={"default": VcSpec(nodes=2)}, gpus_per_node=4)
    jobs = [_elastic("e", 2, 8, 0.9), submit("rigid", 4, duration=500.0, at=3000.0)]
    result = simulate(jobs, cluster, "fifo", elastic=True)
    table = result.table.jobs.set_index("name")
    grown = table.loc["e"]
    assert grown["elastic"] and grown["rescales"] >= 2, "it grew into idle GPUs and shrank for the rigid job"
    assert 0 < grown["paused_gpu_s"] < grown["rescales"] * 8 * 1.0
    assert grown["gpu_seconds"] > 2 * grown["duration"], "it held more than the 2 GPUs it asked for a while"
    assert table.loc["rigid", "gpu_seconds"] == 4 * table.loc["rigid", "duration"]


def test_a_share_of_a_trace_made_elastic_is_the_same_jobs_for_a_seed() -> None:
    drafts = [submit(f"j{i}", 1 + i % 4, duration=100.0, at=float(i)) for i in range(200)]
    workload = ElasticWorkload(share=0.3, seed=7)
    first = [j.spec.elastic is not None for j in make_elastic(drafts, workload)]
    again = [j.spec.elastic is not None for j in make_elastic(drafts, workload)]
    assert first == again and 0.2 < sum(first) / len(first) < 0.4


def test_an_elastic_job_s_ends_are_recorded_with_its_generation_as_the_live_agent_records_them() -> None:
    # Live, a part that left a node and came back ends there again in the same attempt, and the log
    # drops a repeated id: the agent puts the generation in the id. The simulated agents must too.
    cluster = ClusterSpec(vcs={"default": VcSpec(nodes=2)}, gpus_per_node=4)
    jobs = [_elastic("e", 2, 8, 0.9), submit("rigid", 4, duration=500.0, at=3000.0)]
    jobs[0] = msgspec.structs.replace(jobs[0], spec=msgspec.structs.replace(jobs[0].spec, duration_s=20_000.0))
    result = simulate(jobs, cluster, "fifo", elastic=True)
    ids = [record.event.id for record in result.records]
    assert len(ids) == len(set(ids))
    resized = [r.event for r in result.records if isinstance(r.event, ev.JobResized)]
    ends = [r.event for r in result.records if isinstance(r.event, ev.TaskEnded) and r.event.job == resized[0].job]
    shrink = next(r for r in resized if r.kind == "shrink")
    (left,) = shrink.releasing
    # Grown, shrunk for the rigid job (the leaving part's workers exit once the switch is done, and
    # its agent records that, as live), grown back, and both parts ended.
    assert [(end.node, end.outcome) for end in ends] == [
        (left.node, "completed"),
        ("default-n000", "completed"),
        ("default-n001", "completed"),
    ]
    assert ends[0].id == f"agent.{left.node}:ended:{shrink.job}:0:{shrink.generation}" and ends[0].exit_code == 0
    assert ends[0].at >= shrink.at
    for end in ends[1:]:
        assert end.id == f"agent.{end.node}:ended:{end.job}:0:{resized[-1].generation}"
