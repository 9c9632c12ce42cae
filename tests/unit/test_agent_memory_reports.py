"""A node agent's memory reports say what borrowers hold on each lender GPU (``borrowed_mb``), as
their runtimes told it (``control.LeaseHeld``): a share granted but not yet allocated is none of
the lender's use, so the broker sees an owner's or strays' growth before the borrower allocates."""

from __future__ import annotations

from gpuherd import control
from gpuherd import events as ev
from gpuherd.fold.leases import LeaseState
from services.nodeagent.leases import LeaseHoldings, MemoryReporter
from services.nodeagent.messages import JobMessages
from services.nodeagent.state import AgentState, evolve, new_state
from tests.helpers import node

STARTED_AT = 1000.0  # the agent's start


def _lease(name: str, *, granted_at: float, shares: list[tuple[int, int]], node_: str = "n1") -> LeaseState:
    return LeaseState(
        lease=name,
        job="j",
        attempt=0,
        node=node_,
        gpu=0,
        mb=sum(mb for _, mb in shares),
        status="active",
        shares=[ev.MemoryShare(tier="pcie", gpu=gpu, mb=mb) for gpu, mb in shares],
        term_s=600.0,
        expires_at=granted_at + 600.0,
    )


def test_a_share_granted_while_the_agent_ran_holds_nothing_until_its_runtime_says_it_allocated() -> None:
    holdings = LeaseHoldings(started_at=STARTED_AT)
    leases = {"A": _lease("A", granted_at=STARTED_AT + 5, shares=[(2, 66 * 1024)])}
    assert holdings.borrowed_mb(leases, "n1", 4) == (0, 0, 0, 0)
    holdings.said("A", {2: 66 * 1024})
    assert holdings.borrowed_mb(leases, "n1", 4) == (0, 0, 66 * 1024, 0)
    holdings.said("A", {})  # it gave the share back (a revocation)
    assert holdings.borrowed_mb(leases, "n1", 4) == (0, 0, 0, 0)


def test_a_share_granted_before_the_agent_started_is_unknown_until_its_runtime_speaks() -> None:
    """The runtime may have allocated it while no agent listened: the report then says nothing of
    borrowers (the broker reads it as before), until the runtime tells this agent."""
    holdings = LeaseHoldings(started_at=STARTED_AT)
    leases = {
        "old": _lease("old", granted_at=STARTED_AT - 60, shares=[(1, 4096)]),
        "other-node": _lease("other-node", granted_at=STARTED_AT - 60, shares=[(1, 4096)], node_="n2"),
    }
    assert holdings.borrowed_mb(leases, "n1", 4) is None
    holdings.said("old", {1: 4096})
    assert holdings.borrowed_mb(leases, "n1", 4) == (0, 4096, 0, 0)
    assert holdings.borrowed_mb({}, "n1", 4) == (0, 0, 0, 0), "an ended lease holds nothing"
    assert holdings.borrowed_mb(leases, "n1", 4) is None, "and what it said is forgotten"


def test_a_change_in_what_borrowers_hold_is_reported_even_when_no_gpu_moved_by_a_step() -> None:
    state = new_state("n1")
    evolve(state, 1, node("n1", gpus=4))
    reporter = MemoryReporter()
    used = [1000.0, 1000.0, 1000.0, 1000.0]
    assert reporter.changed(state, "n1", used, (0, 0, 0, 0)) == (1000,) * 4
    assert reporter.changed(state, "n1", used, (0, 0, 0, 0)) is None
    assert reporter.changed(state, "n1", used, (0, 0, 256, 0)) == (1000,) * 4
    assert reporter.changed(state, "n1", used, None) == (1000,) * 4


def _agent_with_lease() -> AgentState:
    state = new_state("n1")
    evolve(state, 1, node("n1", gpus=4))
    request = ev.MemoryLeaseRequested(
        id="r", source="agent.n1", lease="A", job="j", attempt=0, node="n1", gpu=0, mb=512
    )
    evolve(state, 2, request)
    return state


def test_what_a_runtime_says_it_holds_reaches_the_reports_only_for_its_own_lease() -> None:
    state = _agent_with_lease()
    holdings = LeaseHoldings(started_at=STARTED_AT)
    messages = JobMessages("n1", lambda: state, None, None, None, holdings=holdings)  # type: ignore[arg-type]
    messages.on_message(control.LeaseHeld(job="j", attempt=0, lease="A", held_mb={2: 512}))
    messages.on_message(control.LeaseHeld(job="intruder", attempt=0, lease="A", held_mb={1: 9999}))
    messages.on_message(control.LeaseHeld(job="j", attempt=0, lease="nope", held_mb={1: 9999}))
    assert holdings.borrowed_mb(state.leases, "n1", 4) == (0, 0, 512, 0)


def test_a_lease_held_message_round_trips_the_control_protocol() -> None:
    message = control.LeaseHeld(job="j", attempt=0, lease="A", held_mb={2: 512})
    assert control.decode_message(control.encode_message(message)) == message
