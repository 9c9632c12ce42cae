"""Events of memory leases (subject ``herd.lease.<id>``): spare memory of neighbor GPUs and pinned
host memory, lent by the memory broker (``services/memory``)."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from gpuherd.events.base import Command, Decision, Event, command_upcaster, reported_by, upcaster
from gpuherd.events.values import MEMORY_TIERS, MemoryShare, MemoryTier

# The rules of the memory broker's policy (``services/memory/policy.py``). The broker records the ones
# it decides by in ``MemoryBrokerConfigured``, so every lease decision is re-derived by the rules it was
# made by; a log that recorded none was decided by the first. 2: a request for less than
# ``min_share_mb`` is denied (it stayed pending), as is a waiting one a raised ``min_share_mb``
# outgrew; a worker leaving its elastic job at a rescale keeps its lease until the switch completes
# (it was reclaimed at the ``JobResized``), and ``RescaleCompleted`` runs a pass that reclaims it.
# 3: of a GPU's reported use, only shares lent when the report was made count as the borrowers'; a
# share granted since (in the same pass too) is spare no more but hides none of the owner's or
# strays' use (every share lent did, so a GPU with strays on it was lent past its memory).
# 4: of those shares, a report that says what borrowers had allocated (``GpuMemoryReported.borrowed_mb``)
# counts only that as theirs: a share granted but not yet allocated hid as much of the owner's or
# strays' growth, so a lender stayed over-committed and nothing was revoked.
MEMORY_RULES = 4


class MemoryLeaseRequested(Event, kw_only=True, frozen=True):
    """The agent running a worker on GPU ``gpu`` of ``node`` asks for ``mb`` MiB beyond it (the job's
    ``MemoryNeeds``). One lease per (job attempt, node, GPU); ``lease`` is derived from them."""

    lease: str
    job: str
    attempt: int
    node: str
    gpu: int
    mb: int
    min_mb: int = 0
    tiers: tuple[MemoryTier, ...] = MEMORY_TIERS

    def subject(self) -> str:
        return reported_by(f"herd.lease.{self.lease}", self.node)


class MemoryLeaseGranted(Decision, kw_only=True, frozen=True):
    """The broker adds ``shares`` to the lease (a first grant, or a top-up after a revocation).
    The lease holds until ``expires_at`` unless its agent renews it; the runtime must never use
    more of a lender than its share."""

    lease: str
    job: str
    attempt: int
    node: str
    gpu: int
    shares: tuple[MemoryShare, ...]
    expires_at: float
    reason: str = ""

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


class MemoryLeaseDenied(Decision, kw_only=True, frozen=True):
    """A request the broker will never grant (the job does not run there, a size out of range)."""

    lease: str
    job: str
    reason: str

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


class MemoryLeaseRenewed(Event, kw_only=True, frozen=True):
    """The borrower's agent says its task still runs: the lease holds for another term."""

    lease: str
    job: str
    node: str = ""  # the borrower's node (its agent writes this); empty in logs before permissions

    def subject(self) -> str:
        return reported_by(f"herd.lease.{self.lease}", self.node)


class MemoryLeaseRevoked(Decision, kw_only=True, frozen=True):
    """The borrower must give back its shares on lender ``gpus`` (empty: the whole lease, host
    share included) by ``deadline``: the lender's own job needs the memory, a job was placed on the
    lender, or the lease expired. The runtime moves the blocks to host and acknowledges."""

    lease: str
    job: str
    gpus: tuple[int, ...] = ()
    deadline: float
    reason: str

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


class MemoryLeaseReleased(Event, kw_only=True, frozen=True):
    """The borrower no longer uses its shares on lender ``gpus`` (empty: the whole lease): its
    runtime's acknowledgment of a revocation, relayed by the agent, or its task ended."""

    lease: str
    job: str
    gpus: tuple[int, ...] = ()
    reason: str = ""
    node: str = ""  # the borrower's node (its agent writes this); empty in logs before permissions

    def subject(self) -> str:
        return reported_by(f"herd.lease.{self.lease}", self.node)


class MemoryLeaseReclaimed(Decision, kw_only=True, frozen=True):
    """The broker ends a lease whose borrower is gone (attempt ended, worker moved, node lost) or
    missed a revocation's deadline (its agent then stops the task: the lender's owner comes first)."""

    lease: str
    job: str
    reason: str
    deadline_missed: bool = False

    def subject(self) -> str:
        return f"herd.lease.{self.lease}"


class MemoryBrokerConfigured(Command, kw_only=True, frozen=True):
    """The memory broker's parameters (``services/memory/policy.BrokerParams``) from here on and the
    rules of its policy (``MEMORY_RULES``; a broker of newer rules records its own when it starts on
    a log of older ones); recorded in the log so that a replay lends and revokes as the live broker did.

    v3: ``rules`` (v2 and older were decided by the first rules)."""

    VERSION: ClassVar[int] = 3
    v: int = 3
    params: dict[str, float] = msgspec.field(default_factory=dict)
    rules: int = MEMORY_RULES

    def subject(self) -> str:
        return "herd.cluster.memory"


command_upcaster("MemoryBrokerConfigured")


@upcaster("MemoryBrokerConfigured", 2)
def _memory_broker_configured_v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "rules": 1, "v": 3}  # recorded before the broker's rules were versioned
