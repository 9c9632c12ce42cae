"""Memory broker rules 4: a memory report that says what borrowers had allocated on each GPU
(``GpuMemoryReported.borrowed_mb``) is taken at its word. Under rules 3 every share lent when a
report was made counted as the borrower's use in it, allocated by then or not: strays (or a
lender's own job) growing between a grant and the borrower's allocation were read as the
borrower's buffer, so the lender stayed over-committed past its memory and nothing was revoked."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.memory.decide import MemoryDecider
from tests.unit.test_memory_broker import GB, _e, _fold, gpus, job, of, request, run, shares
from tests.unit.test_memory_rules_3 import ROOM_MB, STRAY_MB

OTHERS_MB = (78 * GB, 79 * GB, 79 * GB)  # GPUs 0, 1 and 3: full of their jobs' own use
GROWN_MB = 20 * GB  # the strays on GPU 2 after A was granted its share there


def _report(at: float, gpu2_mb: int, borrowed_on_gpu2: int | None) -> ev.Event:
    """GPU 2 (no job) at ``gpu2_mb``, of which ``borrowed_on_gpu2`` is borrowers' buffers (None: the
    agent does not say, as a v1 agent)."""
    used = (OTHERS_MB[0], OTHERS_MB[1], gpu2_mb, OTHERS_MB[2])
    borrowed = None if borrowed_on_gpu2 is None else (0, 0, borrowed_on_gpu2, 0)
    return _e(ev.GpuMemoryReported, at=at, node="n1", used_mb=used, borrowed_mb=borrowed)


def _granted_a(rules: int) -> list[Record]:
    """n1: 4 GPUs on PCIe, no host tier; ``big`` (GPU 0) borrows, GPU 2 has no job and 10 GiB of
    strays. A asks for 66 GiB at t=110 and is granted all GPU 2 can spare at t=120."""
    configured = ev.MemoryBrokerConfigured(id="memory:rules:0", source="memory", rules=rules)
    n1 = _e(ev.NodeRegistered, node="n1", gpus=gpus(1), executor="cpu", host_memory_mb=0)
    events = [configured, n1, *job("big", 0, memory=ev.MemoryNeeds(extra_mb=GB)), *job("small", 1), *job("x", 3)]
    log = run([*events, _report(100.0, 79 * GB, 0)], [])
    log = run([request(66 * GB, lease="A", gpu=0, job_="big", tiers=("pcie",), at=110.0)], log)
    log = run([_report(120.0, STRAY_MB, 0)], log)
    (grant,) = of(log, ev.MemoryLeaseGranted)
    assert shares(grant) == [("pcie", 2, ROOM_MB - STRAY_MB)]
    return log


def test_the_broker_decides_by_rules_4() -> None:
    assert ev.MEMORY_RULES == 4
    assert _fold(run([])).rules == 4, "a new log begins with the broker's rules recorded"


def test_strays_grown_before_the_borrower_allocated_revoke_the_newest_share_and_it_is_lent_again_smaller() -> None:
    """The strays grow to 20 GiB before A allocates its 66 GiB: 86 GiB of an 80 GiB GPU. The report
    says no borrower holds anything there yet, so A's share is revoked with the reason; once A gives
    it back, A is topped up with what the GPU can spare now."""
    log = run([_report(125.0, GROWN_MB, 0)], _granted_a(ev.MEMORY_RULES))
    (revoked,) = of(log, ev.MemoryLeaseRevoked)
    assert revoked.lease == "A" and revoked.gpus == (2,)
    assert f"own use rose to {GROWN_MB} MiB besides borrowers' 0 MiB" in revoked.reason, revoked.reason
    assert f"({ROOM_MB - STRAY_MB} not allocated yet) it is over-committed" in revoked.reason, revoked.reason
    assert of(log, ev.MemoryLeaseGranted)[-1].at == 120.0, "no top-up while a share is being revoked"
    log = run([_e(ev.MemoryLeaseReleased, at=130.0, lease="A", job="big", gpus=(2,), reason="revoked")], log)
    top_up = of(log, ev.MemoryLeaseGranted)[-1]
    assert top_up.lease == "A" and shares(top_up) == [("pcie", 2, ROOM_MB - GROWN_MB)]
    assert _fold(log).lent_mb("n1")[2] + GROWN_MB == ROOM_MB
    assert audit(log, MemoryDecider()).ok


def test_a_share_the_report_shows_allocated_is_the_borrowers_and_revokes_nothing() -> None:
    a_mb = ROOM_MB - STRAY_MB
    log = run([_report(125.0, STRAY_MB + a_mb, a_mb)], _granted_a(ev.MEMORY_RULES))
    assert of(log, ev.MemoryLeaseRevoked) == []
    # A report before A allocated, with the strays as they were, revokes nothing either.
    log = run([_report(126.0, STRAY_MB, 0)], _granted_a(ev.MEMORY_RULES))
    assert of(log, ev.MemoryLeaseRevoked) == []


def test_a_report_that_does_not_say_what_borrowers_hold_is_read_as_rules_3_read_it() -> None:
    """A v1 agent's report (no ``borrowed_mb``): every share lent when it was made counts as in use,
    so the strays' growth stays hidden, as before; no worse than rules 3."""
    log = run([_report(125.0, GROWN_MB, None)], _granted_a(ev.MEMORY_RULES))
    assert of(log, ev.MemoryLeaseRevoked) == []


def test_a_log_of_rules_3_is_decided_and_audited_as_it_was() -> None:
    """A broker of rules 3 ignored what a report said borrowers held: its log is re-decided the same."""
    log = run([_report(125.0, GROWN_MB, 0)], _granted_a(3))
    assert of(log, ev.MemoryLeaseRevoked) == []
    assert audit(log, MemoryDecider()).ok


def test_a_lenders_own_job_growing_before_the_borrower_allocated_counts_in_its_peak() -> None:
    """GPU 1's job ``small`` grows from 20 to 60 GiB while L's 50 GiB share there is not allocated
    yet: its peak is 60 GiB (under rules 3 the share hid it: 10 GiB), and L's share is revoked."""
    n1 = _e(ev.NodeRegistered, node="n1", gpus=gpus(2), executor="cpu", host_memory_mb=0)
    events = [n1, *job("big", 0, memory=ev.MemoryNeeds(extra_mb=GB)), *job("small", 1)]
    events.append(_e(ev.GpuMemoryReported, at=100.0, node="n1", used_mb=(78 * GB, 20 * GB, 0, 0), borrowed_mb=(0,) * 4))
    log = run([*events, request(50 * GB, lease="L", tiers=("nvlink",), at=110.0)])
    assert shares(of(log, ev.MemoryLeaseGranted)[0]) == [("nvlink", 1, 50 * GB)]
    grown = (78 * GB, 60 * GB, 0, 0)
    log = run([_e(ev.GpuMemoryReported, at=120.0, node="n1", used_mb=grown, borrowed_mb=(0,) * 4)], log)
    assert _fold(log).peak_mb["small"] == 60 * GB
    (revoked,) = of(log, ev.MemoryLeaseRevoked)
    assert revoked.lease == "L" and revoked.gpus == (1,)


def test_a_v1_memory_report_reads_as_one_that_does_not_say_what_borrowers_hold() -> None:
    stored = {"type": "GpuMemoryReported", "v": 1, "id": "r1", "at": 1.0, "source": "agent", "node": "n1"}
    event = ev.decode(msgspec.json.encode({**stored, "used_mb": [1, 2]}))
    assert isinstance(event, ev.GpuMemoryReported) and event.v == ev.GpuMemoryReported.VERSION == 2
    assert event.used_mb == (1, 2) and event.borrowed_mb is None


@settings(max_examples=40, deadline=None)
@given(grown=st.integers(0, 80 * GB), allocated=st.booleans())
def test_after_a_report_that_says_what_borrowers_hold_the_lender_is_never_left_over_committed(
    grown: int, allocated: bool
) -> None:
    """Whatever the strays grew to after A's grant (A allocated its share or not), once the report is
    decided the shares not being given back and the strays fit the GPU less half its reserve."""
    a_mb = ROOM_MB - STRAY_MB
    used, held = (min(80 * GB, grown + a_mb), a_mb) if allocated else (grown, 0)
    log = run([_report(125.0, used, held)], _granted_a(ev.MEMORY_RULES))
    state = _fold(log)
    keeping = sum(
        s.mb for lease in state.leases.values() for s in lease.shares if s.gpu == 2 and 2 not in lease.revoking
    )
    strays = used - held
    half_reserve = (80 * GB - ROOM_MB) // 2
    assert strays + keeping <= 80 * GB - half_reserve or keeping == 0
