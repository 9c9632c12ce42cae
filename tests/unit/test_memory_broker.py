"""The memory broker's decisions, as a pure decider: grant, spread, prefer NVLink, revoke on
pressure, top up, reclaim when the borrower is gone, expiry and deadlines, denials."""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.log import InProcessLog, Record
from gpuherd.runtime.audit import audit
from gpuherd.runtime.decider import decide_stamped
from gpuherd.runtime.runner import DeciderRunner
from services.memory.decide import MemoryDecider
from services.memory.policy import BrokerParams, reserve_mb, spare_mb, water_fill
from services.memory.spec import SPEC
from services.memory.state import MemoryState

GB = 1024
TOTAL = 80 * GB  # MiB of each GPU
PARAMS = BrokerParams()
_ids = itertools.count()


def _e(cls: type[ev.Event], at: float = 0.0, **fields: object) -> ev.Event:
    return cls(id=f"t{next(_ids)}", at=at, source="test", **fields)  # type: ignore[call-arg]


def gpus(island: int) -> tuple[ev.GpuInfo, ...]:
    return tuple(ev.declared_gpus("n1", 4, island=island, model="H100", memory_mb=TOTAL))


def started() -> ev.Event:
    """What a broker records when it starts on a log without its rules (``spec.rules_recorder``)."""
    return ev.MemoryBrokerConfigured(id="memory:rules:0", source="memory")


def run(events: list[ev.Event], log: list[Record] | None = None, params: BrokerParams = PARAMS) -> list[Record]:
    """Append ``events`` the way the runner does: fold, decide, append and fold the decisions first.
    A new log (``log`` None) begins as a broker starting on it writes it, with its rules; a given log
    goes on as it is (``[]``: a log begun by a broker from before the rules were recorded)."""
    decider = MemoryDecider(params)
    state = decider.initial_state()
    for r in log or []:
        decider.evolve(state, r.seq, r.event)
    inbox = collections.deque([started(), *events] if log is None else events)
    log = list(log or [])
    pending: collections.deque[Record] = collections.deque()
    while inbox or pending:
        record = pending.popleft() if pending else None
        if record is not None:
            for out in decide_stamped(decider, state, record):
                pending.append(_append(log, decider, state, out))
        else:
            pending.append(_append(log, decider, state, inbox.popleft()))
    return log


def _append(log: list[Record], decider: MemoryDecider, state: MemoryState, event: ev.Event) -> Record:
    record = Record(len(log) + 1, event)
    log.append(record)
    decider.evolve(state, record.seq, event)
    return record


def job(name: str, gpu: int, *, at: float = 0.0, memory: ev.MemoryNeeds | None = None) -> list[ev.Event]:
    """``name`` submitted, placed on GPU ``gpu`` of n1 and started at ``at``."""
    spec = ev.JobSpec(name=name, user="ana", gpus=1, command=("python", "t.py"), memory=memory)
    return [
        _e(ev.JobSubmitted, at=at, job=name, spec=spec, intake_source="t"),
        _e(ev.JobPlaced, at=at, job=name, attempt=0, allocations=(ev.Allocation("n1", (gpu,)),)),
        _e(ev.JobStarted, at=at, job=name, attempt=0, node="n1"),
    ]


def cluster(*, island: int = 2, host_mb: int = 512 * GB, small_peak_mb: int = 20 * GB) -> list[Record]:
    """n1: 4 GPUs in NVLink pairs (0-1, 2-3) by default. ``big`` (a borrower) runs on GPU 0,
    ``small`` on GPU 1 since t=0; at t=100 their use is reported; GPUs 2 and 3 are free."""
    n1 = _e(ev.NodeRegistered, node="n1", gpus=gpus(island), executor="cpu", host_memory_mb=host_mb)
    events: list[ev.Event] = [n1]
    events += job("big", 0, memory=ev.MemoryNeeds(extra_mb=30 * GB))
    events += job("small", 1)
    events.append(_e(ev.GpuMemoryReported, at=100.0, node="n1", used_mb=(78 * GB, small_peak_mb, 0, 0)))
    return run(events)


def request(mb: int, *, lease: str = "L", gpu: int = 0, at: float = 100.0, job_: str = "big", **kw) -> ev.Event:
    return _e(ev.MemoryLeaseRequested, at=at, lease=lease, job=job_, attempt=0, node="n1", gpu=gpu, mb=mb, **kw)


def of(log: list[Record], kind: type) -> list:
    return [r.event for r in log if isinstance(r.event, kind)]


def _fold(log: list[Record]) -> MemoryState:
    decider = MemoryDecider()
    state = decider.initial_state()
    for r in log:
        decider.evolve(state, r.seq, r.event)
    return state


def shares(grant: ev.MemoryLeaseGranted) -> list[tuple[str, int | None, int]]:
    return [(s.tier, s.gpu, s.mb) for s in grant.shares]


# -- grants -----------------------------------------------------------------------------------------------


def test_a_request_the_nvlink_peer_can_cover_is_granted_there_alone() -> None:
    log = run([request(30 * GB)], cluster())
    (grant,) = of(log, ev.MemoryLeaseGranted)
    assert shares(grant) == [("nvlink", 1, 30 * GB)]
    assert grant.expires_at == 100.0 + PARAMS.lease_term_s
    assert grant.cause == log[-2].event.id and grant.based_on == len(log) - 1
    assert _fold(log).lent_mb("n1") == {1: 30 * GB}


def test_what_the_nvlink_peer_lacks_is_spread_over_pcie_neighbors_then_host() -> None:
    log = cluster()
    slot = _fold(log).nodes["n1"].gpus[1]
    peer_room = TOTAL - reserve_mb(slot, PARAMS) - int(20 * GB * 1.1)
    free_room = TOTAL - reserve_mb(slot, PARAMS)
    want = peer_room + 2 * free_room + 5 * GB
    (grant,) = of(run([request(want)], log), ev.MemoryLeaseGranted)
    assert shares(grant) == [
        ("nvlink", 1, peer_room),
        ("pcie", 2, free_room),
        ("pcie", 3, free_room),
        ("host", None, 5 * GB),
    ]
    # Less than the PCIe pair can give: split evenly over both (two links' bandwidth).
    (grant,) = of(run([request(peer_room + 10 * GB)], log), ev.MemoryLeaseGranted)
    assert shares(grant) == [("nvlink", 1, peer_room), ("pcie", 2, 5 * GB), ("pcie", 3, 5 * GB)]


def test_nvlink_peers_share_a_request_evenly_at_most_three_of_them() -> None:
    log = run([request(30 * GB)], cluster(island=4))  # all four GPUs are NVLink peers
    (grant,) = of(log, ev.MemoryLeaseGranted)
    assert [(t, mb) for t, _, mb in shares(grant)] == [("nvlink", 10 * GB)] * 3
    assert {g for _, g, _ in shares(grant)} == {1, 2, 3}
    # A small request is not cut into pieces below min_share_mb.
    (grant,) = of(run([request(300)], cluster(island=4)), ev.MemoryLeaseGranted)
    assert len(grant.shares) == 1


def test_water_fill_gives_lenders_with_little_room_all_they_have_and_the_rest_evenly() -> None:
    assert water_fill(900, [100, 1000, 1000], 50) == [100, 400, 400]
    assert water_fill(600, [1000, 1000, 1000], 256) == [300, 300, 0]
    assert water_fill(10, [1000], 256) == [0]


def test_a_gpu_whose_job_just_started_or_borrows_itself_lends_nothing() -> None:
    log = cluster(island=4)
    log = run([*job("fresh", 2, at=90.0), _e(ev.JobStarted, at=95.0, job="fresh", attempt=0, node="n1")], log)
    log = run(job("hungry", 3, memory=ev.MemoryNeeds(extra_mb=GB)), log)
    (grant,) = of(run([request(30 * GB)], log), ev.MemoryLeaseGranted)
    assert {g for _, g, _ in shares(grant)} == {1}  # 2 warms up (started 5 s ago), 3 borrows itself


def test_a_request_waits_until_its_minimum_can_be_met_and_is_granted_when_memory_frees() -> None:
    log = cluster(island=4, host_mb=0)
    busy = [_e(ev.GpuMemoryReported, at=100.0, node="n1", used_mb=(78 * GB, 75 * GB, 75 * GB, 75 * GB))]
    log = run(busy + job("a", 2) + job("b", 3), log)
    log = run([_e(ev.GpuMemoryReported, at=200.0, node="n1", used_mb=(78 * GB, 75 * GB, 75 * GB, 75 * GB))], log)
    log = run([request(30 * GB, at=200.0, min_mb=10 * GB)], log)
    assert of(log, ev.MemoryLeaseGranted) == [] and of(log, ev.MemoryLeaseDenied) == []
    assert _fold(log).leases["L"].status == "pending"
    log = run([_e(ev.JobFinished, at=300.0, job="a", attempt=0, outcome="completed")], log)
    assert of(log, ev.MemoryLeaseGranted) == []  # its memory is in use until a report says otherwise
    log = run([_e(ev.GpuMemoryReported, at=310.0, node="n1", used_mb=(78 * GB, 75 * GB, 0, 75 * GB))], log)
    (grant,) = of(log, ev.MemoryLeaseGranted)
    assert shares(grant) == [("nvlink", 2, 30 * GB)]


def test_requests_that_can_never_be_granted_are_denied_with_the_reason() -> None:
    log = cluster()
    for bad, words in (
        (request(0), "mb > 0"),
        (request(GB, gpu=2), "no longer runs on GPU 2"),
        (request(GB, job_="ghost"), "never existed"),
        (request(10_000 * GB, min_mb=10_000 * GB), "can lend at most"),
        (request(GB, tiers=()), "no memory tier"),
    ):
        (denied,) = of(run([bad], log), ev.MemoryLeaseDenied)
        assert words in denied.reason, denied.reason
        assert "L" not in _fold(run([bad], log)).leases


def test_a_request_below_the_smallest_share_is_denied_with_the_size_to_ask_for() -> None:
    """A request for less than ``min_share_mb`` can never be cut into a share (smaller pieces are not
    worth a lender): it stayed pending for the job's whole life, neither granted nor denied."""
    log = run([request(PARAMS.min_share_mb - 1)], cluster())
    (denied,) = of(log, ev.MemoryLeaseDenied)
    assert f"below the broker's min_share_mb of {PARAMS.min_share_mb} MiB" in denied.reason, denied.reason
    assert f"ask for at least {PARAMS.min_share_mb} MiB" in denied.reason, denied.reason
    assert of(log, ev.MemoryLeaseGranted) == [] and "L" not in _fold(log).leases
    (grant,) = of(run([request(PARAMS.min_share_mb)], cluster()), ev.MemoryLeaseGranted)
    assert shares(grant) == [("nvlink", 1, PARAMS.min_share_mb)]


def test_a_pending_request_that_a_raised_min_share_outgrows_is_denied() -> None:
    """A request waiting for memory when ``min_share_mb`` is raised above its size could no longer
    be granted at all: it is denied then, not left pending."""
    log = cluster(island=4, host_mb=0)
    busy = [_e(ev.GpuMemoryReported, at=100.0, node="n1", used_mb=(78 * GB, 79 * GB, 79 * GB, 79 * GB))]
    log = run(busy + job("a", 2) + job("b", 3), log)
    log = run([request(300, at=200.0)], log)
    assert of(log, ev.MemoryLeaseGranted) == [] and of(log, ev.MemoryLeaseDenied) == []
    log = run([_e(ev.MemoryBrokerConfigured, at=210.0, params={"min_share_mb": 512})], log)
    (denied,) = of(log, ev.MemoryLeaseDenied)
    assert "asks for 300 MiB, below the broker's min_share_mb of 512 MiB" in denied.reason, denied.reason
    assert _fold(log).leases == {}


# -- revocation and top-up ------------------------------------------------------------------------------------


def test_the_lenders_own_rising_use_revokes_its_share_and_the_lease_is_topped_up_elsewhere() -> None:
    log = run([request(30 * GB)], cluster())
    # small now uses 60 GiB of its own: 60 + 30 lent > 80 - half the reserve.
    log = run([_e(ev.GpuMemoryReported, at=150.0, node="n1", used_mb=(78 * GB, 90 * GB, 0, 0))], log)
    (revoked,) = of(log, ev.MemoryLeaseRevoked)
    assert (revoked.lease, revoked.gpus, revoked.deadline) == ("L", (1,), 150.0 + PARAMS.revoke_deadline_s)
    assert "own use rose" in revoked.reason
    assert len(of(log, ev.MemoryLeaseGranted)) == 1  # no top-up while the revoked share is in use
    log = run([_e(ev.MemoryLeaseReleased, at=160.0, lease="L", job="big", gpus=(1,), reason="revoked")], log)
    top_up = of(log, ev.MemoryLeaseGranted)[-1]
    # The released share is off GPU 1 (the report that showed it in use counted it as L's, rules
    # 3): GPU 1 lends what small's forecast (60 GiB and headroom) leaves, the PCIe pair the rest.
    assert shares(top_up) == [("nvlink", 1, 10 * GB), ("pcie", 2, 10 * GB), ("pcie", 3, 10 * GB)]
    assert _fold(log).leases["L"].granted_mb == 30 * GB


def test_use_within_the_forecast_revokes_nothing_hysteresis() -> None:
    log = run([request(30 * GB)], cluster())
    log = run([_e(ev.GpuMemoryReported, at=150.0, node="n1", used_mb=(78 * GB, 30 * GB + 30 * GB, 0, 0))], log)
    assert of(log, ev.MemoryLeaseRevoked) == []


def test_a_job_placed_on_a_lender_revokes_the_shares_on_it() -> None:
    log = run([request(70 * GB)], cluster())
    (grant,) = of(log, ev.MemoryLeaseGranted)
    assert 2 in {g for _, g, _ in shares(grant)}
    spec = ev.JobSpec(name="new", user="bo", gpus=1, command=("python", "t.py"))
    log = run(
        [
            _e(ev.JobSubmitted, at=200.0, job="new", spec=spec, intake_source="t"),
            _e(ev.JobPlaced, at=201.0, job="new", attempt=0, allocations=(ev.Allocation("n1", (2,)),)),
        ],
        log,
    )
    (revoked,) = of(log, ev.MemoryLeaseRevoked)
    assert revoked.gpus == (2,) and "was placed" in revoked.reason


def test_the_newest_lease_on_a_lender_gives_back_first_and_only_as_much_as_needed() -> None:
    log = cluster(island=4)
    log = run(job("big2", 2, memory=ev.MemoryNeeds(extra_mb=GB)), log)
    log = run([request(20 * GB, at=100.0)], log)
    log = run([request(20 * GB, lease="M", gpu=2, job_="big2", at=110.0)], log)
    assert all(1 in lease.lenders() for lease in _fold(log).leases.values())  # both borrow of GPU 1
    # small's own use rises by a bit beyond the margin on GPU 1: one lease gives back, the newest.
    on_1 = _fold(log).lent_mb("n1")[1]
    used = TOTAL - reserve_mb(_fold(log).nodes["n1"].gpus[1], PARAMS) // 2 - on_1 + GB
    log = run([_e(ev.GpuMemoryReported, at=120.0, node="n1", used_mb=(78 * GB, used + on_1, 0, 0))], log)
    revoked = of(log, ev.MemoryLeaseRevoked)
    assert [r.lease for r in revoked] == ["M"]


# -- lifetimes -------------------------------------------------------------------------------------------


def test_leases_of_a_finished_or_requeued_job_are_reclaimed() -> None:
    log = run([request(30 * GB)], cluster())
    done = run([_e(ev.JobFinished, at=500.0, job="big", attempt=0, outcome="completed")], log)
    (reclaimed,) = of(done, ev.MemoryLeaseReclaimed)
    assert "ended" in reclaimed.reason and not reclaimed.deadline_missed
    assert _fold(done).leases == {}
    lost = run([_e(ev.NodeLost, at=500.0, node="n1", reason="silent")], log)
    assert len(of(lost, ev.MemoryLeaseReclaimed)) == 1


def test_an_unrenewed_lease_is_revoked_at_expiry_and_reclaimed_after_the_deadline() -> None:
    log = run([request(30 * GB)], cluster())

    def tick(at: float) -> ev.Event:
        return _e(ev.ClockTicked, at=at, last_heard={}, lost_after_s=ev.TICK_ONLY_TIMEOUT_S)

    renewed = run([_e(ev.MemoryLeaseRenewed, at=400.0, lease="L", job="big"), tick(100.0 + PARAMS.lease_term_s)], log)
    assert of(renewed, ev.MemoryLeaseRevoked) == []
    log = run([tick(100.0 + PARAMS.lease_term_s)], log)
    (revoked,) = of(log, ev.MemoryLeaseRevoked)
    assert revoked.gpus == () and "expired" in revoked.reason
    released = run([_e(ev.MemoryLeaseReleased, at=710.0, lease="L", job="big", reason="revoked")], log)
    assert _fold(released).leases == {} and of(released, ev.MemoryLeaseReclaimed) == []
    log = run([tick(revoked.deadline + 1)], log)
    (reclaimed,) = of(log, ev.MemoryLeaseReclaimed)
    assert reclaimed.deadline_missed and "by the deadline" in reclaimed.reason


def test_replaying_the_log_decides_the_same() -> None:
    log = run([request(30 * GB)], cluster())
    log = run([_e(ev.GpuMemoryReported, at=150.0, node="n1", used_mb=(78 * GB, 90 * GB, 0, 0))], log)
    inputs = [r.event for r in log if r.event.source == "test"]
    again = run(inputs)
    assert [type(r.event).__name__ for r in again] == [type(r.event).__name__ for r in log]
    decided = [r.event for r in log if r.event.source == "memory"]
    assert decided and [r.event for r in again if r.event.source == "memory"] == decided


# -- the invariant -------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    used=st.lists(st.integers(0, TOTAL), min_size=4, max_size=4),
    asks=st.lists(st.integers(1, 200 * GB), min_size=1, max_size=3),
)
def test_grants_never_lend_more_than_a_gpu_can_spare(used: list[int], asks: list[int]) -> None:
    log = cluster(island=4)
    log = run(job("b2", 2, memory=ev.MemoryNeeds(extra_mb=GB)) + job("b3", 3, memory=ev.MemoryNeeds(extra_mb=GB)), log)
    log = run([_e(ev.GpuMemoryReported, at=100.0, node="n1", used_mb=tuple(used))], log)
    borrowers = [("big", 0), ("b2", 2), ("b3", 3)]
    for i, mb in enumerate(asks):
        name, gpu = borrowers[i]
        log = run([request(mb, lease=f"L{i}", gpu=gpu, job_=name)], log)
    state = _fold(log)
    lent = state.lent_mb("n1")
    before = _fold([r for r in log if not isinstance(r.event, ev.MemoryLeaseGranted)])
    for gpu, mb in lent.items():
        node = before.nodes["n1"]
        assert mb <= spare_mb(before, node, node.gpus[gpu], 0, PARAMS)
    for lease in state.leases.values():
        assert lease.granted_mb <= lease.mb
        assert len(lease.lenders()) <= PARAMS.max_neighbors


def test_an_elastic_grow_onto_a_lender_revokes_the_shares_on_it() -> None:
    """A worker that joins its job at a grow is as new on its GPU as a placed job: what is lent
    there is revoked (its need is not known yet), not left for the new worker to run out of."""
    log = cluster()
    free_room = TOTAL - reserve_mb(_fold(log).nodes["n1"].gpus[2], PARAMS)
    log = run([request(2 * free_room, tiers=("pcie",))], log)
    (grant,) = of(log, ev.MemoryLeaseGranted)
    assert shares(grant) == [("pcie", 2, free_room), ("pcie", 3, free_room)]
    grow = _e(
        ev.JobResized,
        at=200.0,
        job="small",
        attempt=0,
        generation=1,
        allocations=(ev.Allocation("n1", (1, 2)),),
        joiners=("n1/2",),
        kind="grow",
    )
    log = run([grow], log)
    (revoked,) = of(log, ev.MemoryLeaseRevoked)
    assert (revoked.lease, revoked.gpus) == ("L", (2,)) and "need is not known" in revoked.reason


def _elastic_pair_with_a_lease_on_gpu_1(log: list[Record] | None = None) -> list[Record]:
    """n1: elastic ``el`` runs a worker on GPUs 0 and 1 since t=0, GPUs 2 and 3 are free; the
    worker on GPU 1 holds lease L1 of 10 GiB over PCIe. (``log``: the log it goes on from.)"""
    spec = ev.JobSpec(
        name="el",
        user="ana",
        gpus=2,
        command=("python", "t.py"),
        elastic=ev.Elastic(min=1, max=2),
        memory=ev.MemoryNeeds(extra_mb=10 * GB),
    )
    n1 = _e(ev.NodeRegistered, node="n1", gpus=gpus(2), executor="cpu", host_memory_mb=512 * GB)
    log = run(
        [
            n1,
            _e(ev.JobSubmitted, job="el", spec=spec, intake_source="t"),
            _e(ev.JobPlaced, job="el", attempt=0, allocations=(ev.Allocation("n1", (0, 1)),)),
            _e(ev.JobStarted, job="el", attempt=0, node="n1"),
            _e(ev.GpuMemoryReported, at=100.0, node="n1", used_mb=(70 * GB, 70 * GB, 0, 0)),
        ],
        log,
    )
    log = run([request(10 * GB, lease="L1", gpu=1, job_="el", tiers=("pcie",))], log)
    assert len(of(log, ev.MemoryLeaseGranted)) == 1
    return log


def _shrink_off_gpu_1(at: float) -> ev.Event:
    return _e(
        ev.JobResized,
        at=at,
        job="el",
        attempt=0,
        generation=1,
        allocations=(ev.Allocation("n1", (0,)),),
        state_from="n1/0",
        releasing=(ev.Allocation("n1", (1,)),),
        kind="shrink",
    )


def test_a_leaving_workers_lease_is_kept_until_its_switch_completes() -> None:
    """At a shrink the leaving worker takes part in the switch (its state may be the one handed
    over) before it exits: its lease was reclaimed at the JobResized, under it. It is reclaimed once
    the rescale completed, and is not lent more in between."""
    log = run([_shrink_off_gpu_1(200.0)], _elastic_pair_with_a_lease_on_gpu_1())
    assert of(log, ev.MemoryLeaseReclaimed) == []
    assert _fold(log).leases["L1"].granted_mb == 10 * GB
    # Within the switch: a request from the leaving worker waits, and so does a top-up.
    log = run([request(10 * GB, lease="L2", gpu=1, job_="el", at=210.0)], log)
    log = run([_e(ev.MemoryLeaseReleased, at=211.0, lease="L1", job="el", gpus=(2,), reason="moved")], log)
    assert len(of(log, ev.MemoryLeaseGranted)) == 1 and of(log, ev.MemoryLeaseDenied) == []
    done = _e(ev.RescaleCompleted, at=230.0, job="el", attempt=0, generation=1, node="n1", world=1, world_before=2)
    log = run([done], log)
    reclaimed = of(log, ev.MemoryLeaseReclaimed)
    assert sorted(r.lease for r in reclaimed) == ["L1", "L2"]
    assert all("no longer runs on GPU 1" in r.reason and not r.deadline_missed for r in reclaimed)
    assert _fold(log).leases == {}


# -- parameters ----------------------------------------------------------------------------------------


def test_parameters_the_broker_cannot_lend_by_are_refused_and_the_ones_in_force_stay() -> None:
    """A huge margin or headroom overflowed the broker's arithmetic (it crashed on every pass, again
    at each restart); a margin over the whole GPU revoked every share as "own use rose"; a zero
    piece granted empty host shares at every pass; a term or deadline below zero revoked or
    reclaimed (stopping the task) as soon as granted."""
    bad_values: list[dict[str, float]] = [
        {"margin_frac": 1e308},
        {"owner_headroom": 1e308},
        {"host_fraction": 1e308},
        {"margin_frac": 5.0},
        {"min_share_mb": 0},
        {"lease_term_s": 0.0},
        {"revoke_deadline_s": -1.0},
        {"max_neighbors": -1},
    ]
    for bad in bad_values:
        configured = _e(ev.MemoryBrokerConfigured, at=100.0, params=bad)
        log = run([configured, request(30 * GB)], cluster())
        (refusal,) = of(log, ev.CommandRefused)
        assert next(iter(bad)) in refusal.reason, refusal.reason
        assert _fold(log).params == {}, "the defaults the broker recorded at start"
        (grant,) = of(log, ev.MemoryLeaseGranted)
        assert shares(grant) == [("nvlink", 1, 30 * GB)], "granted by the parameters in force"


# -- rules ---------------------------------------------------------------------------------------------

# Parameters a broker recorded before its rules were versioned (MemoryBrokerConfigured v2), as stored.
PARAMS_OF_AN_OLD_BROKER = (
    b'{"type":"MemoryBrokerConfigured","id":"memory:config:1","at":0.0,"source":"memory","v":2,'
    b'"unchecked":false,"params":{"lease_term_s":900.0}}'
)


def _as_they_are(log: list[Record], events: list[ev.Event]) -> list[Record]:
    """``log`` with ``events`` appended as they are: nothing decided on them."""
    return [*log, *(Record(len(log) + n, e) for n, e in enumerate(events, 1))]


def _a_log_of_the_first_rules(log: list[Record]) -> list[Record]:
    """What a broker of the first rules wrote on ``log``, by hand where the rules since differ: el's
    worker on GPU 0 asks for 100 MiB, below min_share_mb (it stayed pending: nothing decided); el
    shrinks off GPU 1, and L1, its leaving worker's lease, is reclaimed at the JobResized; the
    switch completes (no trigger then)."""
    log = _elastic_pair_with_a_lease_on_gpu_1(log)
    shrink = _shrink_off_gpu_1(200.0)
    log = _as_they_are(log, [request(100, lease="S", gpu=0, job_="el", at=150.0), shrink])
    reclaimed = ev.MemoryLeaseReclaimed(
        id=f"memory:{log[-1].seq}:0",
        at=200.0,
        source="memory",
        based_on=log[-1].seq,
        cause=shrink.id,
        lease="L1",
        job="el",
        reason="job el no longer runs on GPU 1 of n1",
    )
    done = _e(ev.RescaleCompleted, at=230.0, job="el", attempt=0, generation=1, node="n1", world=1, world_before=2)
    return _as_they_are(log, [reclaimed, done])


@pytest.mark.parametrize("begun", ["with nothing recorded", "with parameters recorded before the rules"])
def test_a_log_of_the_first_rules_audits_clean(begun: str) -> None:
    """A broker from before the rules were versioned recorded none (or parameters without them):
    the audit replayed its log by the rules since, and reported its decisions where they differ as
    wrong (here the reclaim at the shrink, where a pass of the rules since denies the small request
    left pending and keeps the leaving worker's lease). It replays by the first rules."""
    start = [] if begun == "with nothing recorded" else [Record(1, ev.decode(PARAMS_OF_AN_OLD_BROKER))]
    log = _a_log_of_the_first_rules(start)
    report = audit(log, MemoryDecider())
    assert report.ok, report.mismatches
    assert report.decisions_checked == 2  # L1's grant, and its reclaim at the shrink
    assert _fold(log).rules == 1
    # The same decisions after a broker recorded the rules since are wrong by them, and reported.
    newer = audit(_a_log_of_the_first_rules(run([])), MemoryDecider())
    assert [m.kind for m in newer.mismatches] == ["differs"], newer.mismatches


def test_parameters_recorded_before_the_rules_were_versioned_keep_the_first_rules() -> None:
    old = ev.decode(PARAMS_OF_AN_OLD_BROKER)
    assert isinstance(old, ev.MemoryBrokerConfigured) and old.rules == 1 and old.v == 3
    assert old.params == {"lease_term_s": 900.0}
    assert ev.MemoryBrokerConfigured().rules == ev.MEMORY_RULES == 4


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not reached"
        await asyncio.sleep(0.01)


async def _serve(log: InProcessLog, instance: str) -> tuple[DeciderRunner[MemoryState], asyncio.Event, asyncio.Task]:
    """A broker on ``log`` with its spec's tasks, as ``gpuherd up`` starts one."""
    runner = DeciderRunner(log, MemoryDecider(), instance=instance, extra_tasks=SPEC.tasks(argparse.Namespace()))
    stop = asyncio.Event()
    return runner, stop, asyncio.create_task(runner.run(stop))


async def test_a_fresh_broker_records_its_rules_and_decides_by_them() -> None:
    """A broker records the rules it decides by when it starts (a log with none reads as the first
    rules): a request below min_share_mb is then denied, not left pending."""
    log = InProcessLog(duplicate_window=0)
    _, stop, task = await _serve(log, "a")
    try:
        await _until(lambda: of(list(log.records), ev.MemoryBrokerConfigured))
        inputs = [r.event for r in cluster() if r.event.source == "test"]
        await log.append([*inputs, request(PARAMS.min_share_mb - 1)])
        await _until(lambda: of(list(log.records), ev.MemoryLeaseDenied))
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    records = list(log.records)
    (recorded,) = of(records, ev.MemoryBrokerConfigured)
    assert recorded.rules == ev.MEMORY_RULES and recorded.params == {} and recorded.id.startswith("memory:rules:")
    (denied,) = of(records, ev.MemoryLeaseDenied)
    assert "below the broker's min_share_mb" in denied.reason, denied.reason
    assert audit(records, MemoryDecider()).ok


async def test_a_broker_started_on_a_log_of_the_first_rules_records_its_own_with_the_parameters_in_force() -> None:
    """On an older broker's log, a broker records its rules with the parameters in force: it decides
    by them from there (the request left pending is denied), the log before is audited by the first
    rules, and the whole log audits clean. Started again, it records nothing more."""
    log = InProcessLog(duplicate_window=0)
    await log.append([r.event for r in _a_log_of_the_first_rules([Record(1, ev.decode(PARAMS_OF_AN_OLD_BROKER))])])
    for instance in ("a", "b"):
        runner, stop, task = await _serve(log, instance)
        try:
            await _until(
                lambda runner=runner: runner.caught_up.is_set() and of(list(log.records), ev.MemoryLeaseDenied)
            )
            await asyncio.sleep(0.05)  # (anything still to come would come now)
            await _until(lambda runner=runner: runner.core.quiescent() and runner.state.seq == len(log.records))
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
    records = list(log.records)
    old, recorded = of(records, ev.MemoryBrokerConfigured)
    assert (old.rules, recorded.rules) == (1, ev.MEMORY_RULES)
    assert recorded.params == old.params and recorded.id.startswith("memory:rules:")
    (denied,) = of(records, ev.MemoryLeaseDenied)
    assert denied.lease == "S" and "below the broker's min_share_mb" in denied.reason, denied.reason
    report = audit(records, MemoryDecider())
    assert report.ok and report.decisions_checked == 3, report.mismatches


def test_a_simulated_broker_records_its_rules_and_decides_by_them_as_a_live_one() -> None:
    """A simulation's log begins as a live one: the broker's rules recorded (without them it would
    read as the first rules, and a simulated request below min_share_mb would wait forever)."""
    from apps.sim.cluster import ClusterSpec, VcSpec
    from apps.sim.run import simulate

    spec = ev.JobSpec(name="b", user="ana", gpus=1, duration_s=600.0, vc="a", memory=ev.MemoryNeeds(extra_mb=100))
    jobs = [ev.JobSubmitted(job="b", spec=spec, at=50.0, intake_source="t")]
    records = simulate(jobs, ClusterSpec(vcs={"a": VcSpec(nodes=1)}, gpus_per_node=4), "fifo", memory=True).records
    assert [c.rules for c in of(records, ev.MemoryBrokerConfigured)] == [ev.MEMORY_RULES]
    (denied,) = of(records, ev.MemoryLeaseDenied)
    assert "below the broker's min_share_mb" in denied.reason, denied.reason
    assert audit(records, MemoryDecider()).ok
