"""Memory broker rules 3: a GPU's reported use holds the borrowers' buffers only of shares lent when
the report was made. Under rules 1 and 2 every share lent was taken as in use, so a share granted
after the report (earlier in the same pass too) hid as much of a free GPU's stray use, and the
next lease was offered that room again: 76 GiB lent beside 10 GiB of strays on an 80 GiB GPU."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.memory.decide import MemoryDecider
from tests.unit.test_memory_broker import GB, PARAMS, TOTAL, _e, _fold, gpus, job, of, request, run, shares

STRAY_MB = 10 * GB  # a process of no job's on the free GPU 2
ROOM_MB = TOTAL - max(PARAMS.margin_min_mb, int(PARAMS.margin_frac * TOTAL))  # what a GPU may hold, reserve kept


def _report(at: float, gpu2_mb: int) -> ev.Event:
    """GPUs 0, 1 and 3 full of their jobs' own use; GPU 2 (no job) at ``gpu2_mb``."""
    return _e(ev.GpuMemoryReported, at=at, node="n1", used_mb=(78 * GB, 79 * GB, gpu2_mb, 79 * GB))


def _cluster(rules: int) -> list[Record]:
    """A log begun by a broker of ``rules``. n1: 4 GPUs on PCIe, no host tier to lend; ``big`` (GPU 0)
    and ``big2`` (GPU 3) borrow, ``small`` fills GPU 1, GPU 2 has no job; all of it busy at t=100."""
    configured = ev.MemoryBrokerConfigured(id="memory:rules:0", source="memory", rules=rules)
    n1 = _e(ev.NodeRegistered, node="n1", gpus=gpus(1), executor="cpu", host_memory_mb=0)
    borrows = ev.MemoryNeeds(extra_mb=GB)
    events = [configured, n1, *job("big", 0, memory=borrows), *job("small", 1), *job("big2", 3, memory=borrows)]
    return run([*events, _report(100.0, 79 * GB)], [])


def _two_waiting(rules: int) -> list[Record]:
    """A (on GPU 0) and B (on GPU 3) each ask for 66 GiB of PCIe neighbors and wait: nothing is spare."""
    log = run(
        [
            request(66 * GB, lease="A", gpu=0, job_="big", tiers=("pcie",), at=110.0),
            request(66 * GB, lease="B", gpu=3, job_="big2", tiers=("pcie",), at=111.0),
        ],
        _cluster(rules),
    )
    assert of(log, ev.MemoryLeaseGranted) == []
    return log


def _lent_on_gpu2(log: list[Record]) -> int:
    return _fold(log).lent_mb("n1").get(2, 0)


def test_the_broker_decides_by_rules_3_or_later() -> None:
    assert ev.MEMORY_RULES >= 3, "later rules keep rules 3 (they refine what a report says is borrowed)"
    assert MemoryDecider().initial_state().rules == 1, "a log that recorded no rules: still the first"
    assert _fold(run([])).rules == ev.MEMORY_RULES, "a new log begins with the broker's rules recorded"


def test_one_pass_lends_a_free_gpu_with_strays_on_it_no_more_than_it_has() -> None:
    """One report frees GPU 2 down to its strays' 10 GiB: its one pass grants A the 66 GiB spare,
    and B, asking after A in the same pass, gets none of what A was just given."""
    log = run([_report(120.0, STRAY_MB)], _two_waiting(ev.MEMORY_RULES))
    (grant,) = of(log, ev.MemoryLeaseGranted)
    assert grant.lease == "A" and shares(grant) == [("pcie", 2, ROOM_MB - STRAY_MB)]
    assert _lent_on_gpu2(log) + STRAY_MB <= ROOM_MB
    assert _fold(log).leases["B"].status == "pending"
    assert audit(log, MemoryDecider()).ok


def test_a_request_after_a_grant_sees_it_before_any_report_shows_it_in_use() -> None:
    log = run([_report(105.0, STRAY_MB)], _cluster(ev.MEMORY_RULES))
    log = run([request(200 * GB, lease="A", gpu=0, job_="big", tiers=("pcie",), at=110.0)], log)
    log = run([request(200 * GB, lease="B", gpu=3, job_="big2", tiers=("pcie",), at=120.0)], log)
    assert [g.lease for g in of(log, ev.MemoryLeaseGranted)] == ["A"]
    assert _lent_on_gpu2(log) + STRAY_MB <= ROOM_MB


def test_a_share_a_report_shows_in_use_is_the_borrowers_not_the_strays() -> None:
    """Once a report shows A's buffer on GPU 2, that use is A's: nothing is revoked for it, and what
    the strays free is lent again (B tops up to the GPU's room, not beyond)."""
    log = run([_report(120.0, STRAY_MB)], _two_waiting(ev.MEMORY_RULES))
    a_mb = _lent_on_gpu2(log)
    log = run([_report(130.0, STRAY_MB + a_mb)], log)  # A's runtime allocated its share
    assert of(log, ev.MemoryLeaseRevoked) == [] and of(log, ev.MemoryLeaseGranted)[-1].lease == "A"
    log = run([_report(140.0, a_mb)], log)  # the strays exited
    b_grant = of(log, ev.MemoryLeaseGranted)[-1]
    assert b_grant.lease == "B" and shares(b_grant) == [("pcie", 2, STRAY_MB)]
    assert _lent_on_gpu2(log) == ROOM_MB
    # The strays come back while both shares are in use: the GPU is over half its reserve; B goes.
    log = run([_report(150.0, ROOM_MB + STRAY_MB)], log)
    (revoked,) = of(log, ev.MemoryLeaseRevoked)
    assert revoked.lease == "B" and revoked.gpus == (2,)
    assert audit(log, MemoryDecider()).ok


def test_a_log_of_rules_2_is_decided_and_audited_as_it_was() -> None:
    """A broker of rules 2 lent B what A's fresh share hid of the strays; its log is re-decided
    the same, and audits clean."""
    log = run([_report(120.0, STRAY_MB)], _two_waiting(2))
    assert [(g.lease, shares(g)) for g in of(log, ev.MemoryLeaseGranted)] == [
        ("A", [("pcie", 2, ROOM_MB - STRAY_MB)]),
        ("B", [("pcie", 2, STRAY_MB)]),
    ]
    assert audit(log, MemoryDecider()).ok


@settings(max_examples=40, deadline=None)
@given(
    stray=st.integers(0, TOTAL),
    asks=st.lists(st.tuples(st.integers(1, 100 * GB), st.booleans()), min_size=1, max_size=2),
)
def test_a_free_gpu_is_never_lent_past_its_room_beside_its_strays(stray: int, asks: list[tuple[int, bool]]) -> None:
    """However the leases ask, waiting for the one pass of a report or one after another after it:
    lent + strays <= the GPU less its reserve (no report shows a share in use)."""
    borrowers = [("big", 0), ("big2", 3)]
    asked = [
        (waits, request(mb, lease=f"L{i}", gpu=borrowers[i][1], job_=borrowers[i][0], tiers=("pcie",), at=110.0 + i))
        for i, (mb, waits) in enumerate(asks)
    ]
    log = run([e for waits, e in asked if waits], _cluster(ev.MEMORY_RULES))
    log = run([_report(120.0, stray)], log)
    for waits, e in asked:
        if not waits:
            log = run([e], log)
    assert _lent_on_gpu2(log) <= max(0, ROOM_MB - stray)
