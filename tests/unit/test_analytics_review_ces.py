"""Review of cluster energy saving: the demand it forecasts from, and the nodes it powers down."""

from __future__ import annotations

from gpuherd import events as ev
from services.analytics.ces import CesParams
from services.analytics.decide import AnalyticsDecider
from services.analytics.state import demand_nodes


def _cluster(nodes: int, per_node: int) -> list[ev.Event]:
    out: list[ev.Event] = []
    for i in range(nodes):
        name = f"n{i}"
        gpus = ev.declared_gpus(name, per_node, island=0, model="SIM-GPU", memory_mb=81920)
        out.append(ev.NodeRegistered(id=f"reg-{name}", at=0.0, source="t", node=name, gpus=tuple(gpus)))
    out.append(ev.VcConfigured(id="vc", at=0.0, source="t", vc="default", gpu_quota=nodes * per_node))
    return out


def _submitted(job: str, gpus: int, at: float) -> ev.JobSubmitted:
    spec = ev.JobSpec(name=job, user="u", gpus=gpus, duration_s=600.0)
    return ev.JobSubmitted(id=f"sub-{job}", at=at, source="t", job=job, spec=spec, intake_source="t")


def _running_on_n0(gpus: int) -> list[ev.Event]:
    """A job of ``gpus`` GPUs submitted and placed on n0's first GPUs."""
    placed = ev.JobPlaced(
        id="p", at=2.0, source="t", job="running", attempt=0, allocations=(ev.Allocation("n0", tuple(range(gpus))),)
    )
    return [_submitted("running", gpus, 1.0), placed]


def _fold(decider: AnalyticsDecider, events: list[ev.Event]):
    state = decider.initial_state()
    for seq, event in enumerate(events, 1):
        state = decider.evolve(state, seq, event)
    return state


def test_a_waiting_job_counts_the_idle_node_it_would_fill_and_that_node_stays_on() -> None:
    # Three 8-GPU nodes: n0 full (a running job), n1 and n2 idle; an 8-GPU job waits (the scheduler
    # has not placed it yet). It needs one of the idle nodes: demand is 2 nodes, not 1, and energy
    # saving with no buffer powers down one idle node, not both.
    events = [
        *_cluster(3, 8),
        *_running_on_n0(8),
        _submitted("waiting", 8, 3.0),
    ]
    params = CesParams(buffer_nodes=0, lookback_s=600.0, sample_s=60.0, min_interval_s=0.0)
    decider = AnalyticsDecider(predict=False, ces=params)
    state = _fold(decider, events)
    assert demand_nodes(state) == 2
    tick = ev.AnalyticsTicked(id="tick", at=10.0, source="analytics")
    state = decider.evolve(state, len(events) + 1, tick)
    downs = [e for e in decider.decide(state, tick) if isinstance(e, ev.NodePowerDownRequested)]
    assert len(downs) == 1


def test_waiting_gpus_that_fit_the_free_gpus_of_busy_nodes_need_no_more_nodes() -> None:
    # n0 holds a 4-GPU job (4 free); a 4-GPU job waits: it fits n0, demand stays 1 node.
    events = [
        *_cluster(2, 8),
        *_running_on_n0(4),
        _submitted("waiting", 4, 3.0),
    ]
    state = _fold(AnalyticsDecider(predict=False, ces=CesParams()), events)
    assert demand_nodes(state) == 1


def test_a_wait_still_going_when_the_sequence_ends_is_an_episode() -> None:
    import pandas as pd

    from services.analytics.ces import evaluate_sequence

    # 10 nodes, 1 active for 118 minutes, then all 10 for the last 2: the controller (no buffer) has
    # powered 9 down, and demand waits for them to the end of the sequence.
    minutes = 120
    seq = pd.DataFrame(
        {
            "t": [60.0 * m for m in range(minutes)],
            "active": [1] * (minutes - 2) + [10, 10],
            "total": [10] * minutes,
        }
    )
    params = CesParams(buffer_nodes=0, min_interval_s=0.0, lookback_s=600.0, horizon_s=60.0)
    report = evaluate_sequence(seq, params, decide_every_s=600.0)
    assert report.wait_node_minutes == 18
    assert report.waits == 1
    assert report.mean_wait_s == 120.0  # (its two minutes, as far as the sequence goes)
