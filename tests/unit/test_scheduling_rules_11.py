"""Scheduling rules 11: a VC's held job does not stand in for its VC's first job, and a backfill
reservation counts only the GPUs its head can use (its per-node share, its executor kind)."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from services.scheduler.placement import ViewCache
from services.scheduler.policy import Fifo
from services.scheduler.ranks import RankIndex
from services.scheduler.schedule import Plan, plan
from services.scheduler.state import SchedulerState
from tests.helpers import finish, node, submit
from tests.unit.test_policies import run, state_of
from tests.unit.test_scheduler_decider import decisions, drive, folded


def _rules(rules: int, *, vc: ev.VcConfigured | None = None) -> list[ev.Event]:
    return [*([vc] if vc is not None else []), ev.PolicyConfigured(id="policy", policy="fifo", rules=rules)]


def _with(event: ev.JobSubmitted, **spec: object) -> ev.JobSubmitted:
    return msgspec.structs.replace(event, spec=msgspec.structs.replace(event.spec, **spec))


def _decided(state: SchedulerState) -> list[Plan]:
    """The decider's own pass (no explanations), reading the kept order and sorting the queue."""
    return [
        plan(state, Fifo(), explain=False, cache=ViewCache(), ranks=RankIndex()),
        plan(state, Fifo(), explain=False),
    ]


def _started(*jobs: str) -> list[ev.Event]:
    return [ev.JobStarted(id=f"s-{job}", at=0.0, job=job, attempt=0, node="n1") for job in jobs]


def _audits_clean(log: list[Record]) -> bool:
    return audit(log, SchedulerDecider()).ok


# -- a held job is not its VC's first ------------------------------------------------------------------


def _vc_with_held_first(rules: int, *, held: bool = True) -> SchedulerState:
    """VC A (quota 4, no borrowing) runs L (4 GPUs, priority 0); J1 (priority 10) waits for X, J2
    (priority 5) outranks L."""
    return state_of(
        *_rules(rules, vc=ev.VcConfigured(id="vc", vc="A", gpu_quota=4, can_borrow=False)),
        node("n1", 8),
        submit("L", 4, vc="A", duration=1000.0),
        *run("L", "n1", (0, 1, 2, 3)),
        submit("X", 1, duration=1000.0),
        *run("X", "n1", (4,)),
        *([_with(submit("J1", 4, vc="A"), priority=10, depends_on=ev.Dependencies(afterok=("X",)))] if held else []),
        _with(submit("J2", 4, vc="A"), priority=5),
    )


def test_a_job_its_dependency_holds_does_not_stop_the_next_job_of_its_vc_from_preempting() -> None:
    for result in _decided(_vc_with_held_first(11)):
        assert [(p.job, p.by) for p in result.preempted] == [("L", "J2")]
    assert [(p.job, p.by) for p in _decided(_vc_with_held_first(11, held=False))[0].preempted] == [("L", "J2")]


def test_rules_10_let_a_held_job_stand_for_its_vc_as_they_decided() -> None:
    for result in _decided(_vc_with_held_first(10)):
        assert result.preempted == []


def _held_first_log(rules: int) -> list[Record]:
    """The same, decided by the scheduler as the events come: L and X placed and started, then J1, J2."""
    log = drive(
        [
            *_rules(rules, vc=ev.VcConfigured(id="vc", vc="A", gpu_quota=4, can_borrow=False)),
            node("n1", 8),
            submit("L", 4, vc="A", duration=1000.0),
            submit("X", 1, duration=1000.0),
        ]
    )
    log = drive(_started("L", "X"), log)
    held = _with(submit("J1", 4, vc="A"), priority=10, depends_on=ev.Dependencies(afterok=("X",)))
    return drive([held, _with(submit("J2", 4, vc="A"), priority=5)], log)


def test_the_scheduler_preempts_for_the_next_job_and_a_rules_10_log_audits_as_decided() -> None:
    log, old = _held_first_log(ev.SCHEDULING_RULES), _held_first_log(10)
    assert [(p.job, p.by) for p in decisions(log, ev.JobPreempted)] == [("L", "J2")]
    assert decisions(old, ev.JobPreempted) == [], "rules 10 re-derived as decided"
    assert _audits_clean(log) and _audits_clean(old)


# -- a reservation counts only the GPUs its head can use -----------------------------------------------


def _per_node_shape_log(rules: int) -> list[Record]:
    """n1 (4 GPUs) and n2 (3): c (3 GPUs, 50 s) runs on n2 and a (2 GPUs, 100 s) on n1; then H (4 GPUs
    on one node) and d (1 GPU, 10,000 s) are submitted. Only n1 can hold H: it starts at a's end."""
    log = drive([*_rules(rules), node("n1", 4), node("n2", 3), submit("c", 3, duration=50.0)])
    log = drive([submit("a", 2, duration=100.0)], log)
    assert {p.job: p.allocations[0].node for p in decisions(log, ev.JobPlaced)} == {"c": "n2", "a": "n1"}
    return drive([submit("H", 4, nodes=1, duration=100.0), submit("d", 1, duration=10_000.0)], log)


def test_a_gangs_reservation_counts_the_gpus_that_free_up_per_node() -> None:
    state = folded(_per_node_shape_log(ev.SCHEDULING_RULES))
    result = SchedulerDecider().plan(state)
    assert (result.head, result.reserved_at) == ("H", 100.0), "n2 can never hold H: a's end at t=100 is its start"
    assert [p.job for p in decisions(_per_node_shape_log(ev.SCHEDULING_RULES), ev.JobPlaced)] == ["c", "a"]
    assert result.pending["d"].kind == "reserved"
    for rules in (13, ev.SCHEDULING_RULES):
        ended = drive([finish("c", at=50.0), finish("a", at=100.0)], _per_node_shape_log(rules))
        started = [(p.job, p.at, p.allocations[0].node) for p in decisions(ended, ev.JobPlaced)][2:]
        if rules < 14:  # (no GPU was spare for H: d waited for its start)
            assert started == [("H", 100.0, "n1"), ("d", 100.0, "n2")]
        else:  # (rules 14: n2, which H can never use, takes d once c has ended)
            assert started == [("d", 50.0, "n2"), ("H", 100.0, "n1")]


def test_rules_10_reserved_a_gang_by_count_and_their_logs_audit_as_decided() -> None:
    old = _per_node_shape_log(10)
    assert [p.job for p in decisions(old, ev.JobPlaced)] == ["c", "a", "d"], "rules 10 re-derived as decided"
    assert _audits_clean(old) and _audits_clean(_per_node_shape_log(ev.SCHEDULING_RULES))


def _mixed_cluster_log(rules: int) -> list[Record]:
    """s1 (sim, 8 GPUs) and c1 (cpu, 4): A (2 GPUs, a command, limit 100 s) runs on c1; then H (4 GPUs,
    limit 100 s) and B (2 GPUs, limit 10,000 s), commands both, are submitted: only c1 can run them."""
    command = ("python", "train.py")
    log = drive(
        [
            *_rules(rules),
            node("s1", 8),
            node("c1", 4, executor="cpu", ports=(29500, 29599)),
            _with(submit("A", 2, duration=None, command=command), time_limit_s=100.0),
        ]
    )
    return drive(
        [
            _with(submit("H", 4, duration=None, command=command), time_limit_s=100.0),
            _with(submit("B", 2, duration=None, command=command), time_limit_s=10_000.0),
        ],
        log,
    )


def test_idle_gpus_of_nodes_that_cannot_run_the_head_do_not_make_its_reservation_now() -> None:
    log = _mixed_cluster_log(ev.SCHEDULING_RULES)
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["A"]
    result = SchedulerDecider().plan(folded(log))
    assert (result.head, result.reserved_at) == ("H", 100.0)
    assert result.pending["B"].kind == "reserved"


def test_rules_10_counted_every_idle_gpu_and_their_logs_audit_as_decided() -> None:
    old = _mixed_cluster_log(10)
    assert [p.job for p in decisions(old, ev.JobPlaced)] == ["A", "B"], "rules 10 re-derived as decided"
    assert _audits_clean(old) and _audits_clean(_mixed_cluster_log(ev.SCHEDULING_RULES))
