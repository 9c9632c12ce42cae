"""The fold of memory leases: what the memory broker lends from and every agent hands its tasks.

A lease belongs to one worker (a job's attempt on GPU ``gpu`` of ``node``). ``apply_lease`` folds
the lease events into a dict of leases not yet ended; the broker keeps every node's, an agent its
own node's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import msgspec

from gpuherd import events as ev

LeaseStatus = Literal["pending", "active"]


class LeaseState(msgspec.Struct, kw_only=True, gc=False):
    """What a lease asked for, the shares granted and not yet released, and the revocations it
    must answer."""

    lease: str
    job: str
    attempt: int
    node: str
    gpu: int
    mb: int
    min_mb: int = 0
    tiers: tuple[ev.MemoryTier, ...] = ev.MEMORY_TIERS
    requested_at: float = 0.0
    status: LeaseStatus = "pending"
    shares: list[ev.MemoryShare] = msgspec.field(default_factory=list)
    expires_at: float = 0.0
    term_s: float = 0.0
    revoking: dict[int, float] = msgspec.field(default_factory=dict)  # lender GPU -> deadline
    ending_by: float | None = None  # the whole lease was revoked: the deadline to release it all

    @property
    def granted_mb(self) -> int:
        return sum(s.mb for s in self.shares)

    def lenders(self) -> list[int]:
        return [s.gpu for s in self.shares if s.gpu is not None]


Leases = dict[str, LeaseState]


def lent_mb(leases: Mapping[str, LeaseState], node: str) -> dict[int, int]:
    """MiB lent out of each GPU of ``node`` by the leases that hold shares on it."""
    out: dict[int, int] = {}
    for lease in leases.values():
        if lease.node != node:
            continue
        for share in lease.shares:
            if share.gpu is not None:
                out[share.gpu] = out.get(share.gpu, 0) + share.mb
    return out


def host_lent_mb(leases: Mapping[str, LeaseState], node: str) -> int:
    return sum(s.mb for lease in leases.values() if lease.node == node for s in lease.shares if s.gpu is None)


def _requested(leases: Leases, e: ev.MemoryLeaseRequested) -> None:
    if e.lease in leases:
        return  # asked again (an agent restart): the lease stands as it is
    leases[e.lease] = LeaseState(
        lease=e.lease,
        job=e.job,
        attempt=e.attempt,
        node=e.node,
        gpu=e.gpu,
        mb=e.mb,
        min_mb=e.min_mb,
        tiers=e.tiers,
        requested_at=e.at,
    )


def _granted(leases: Leases, e: ev.MemoryLeaseGranted) -> None:
    lease = leases.get(e.lease)
    if lease is None:
        return
    lease.shares.extend(e.shares)
    lease.status = "active"
    lease.term_s = max(0.0, e.expires_at - e.at)
    lease.expires_at = e.expires_at


def _renewed(leases: Leases, e: ev.MemoryLeaseRenewed) -> None:
    lease = leases.get(e.lease)
    if lease is not None and lease.status == "active" and lease.ending_by is None:
        lease.expires_at = max(lease.expires_at, e.at + lease.term_s)


def _revoked(leases: Leases, e: ev.MemoryLeaseRevoked) -> None:
    lease = leases.get(e.lease)
    if lease is None:
        return
    if not e.gpus:
        lease.ending_by = e.deadline if lease.ending_by is None else min(lease.ending_by, e.deadline)
    for gpu in e.gpus or lease.lenders():
        lease.revoking[gpu] = min(lease.revoking.get(gpu, e.deadline), e.deadline)


def _released(leases: Leases, e: ev.MemoryLeaseReleased) -> None:
    lease = leases.get(e.lease)
    if lease is None:
        return
    if not e.gpus:
        del leases[e.lease]
        return
    lease.shares = [s for s in lease.shares if s.gpu not in e.gpus]
    for gpu in e.gpus:
        lease.revoking.pop(gpu, None)


def _ended(leases: Leases, e: ev.MemoryLeaseDenied | ev.MemoryLeaseReclaimed) -> None:
    leases.pop(e.lease, None)


LEASE_HANDLERS: dict[type, Callable[[Leases, ev.Event], None]] = {
    ev.MemoryLeaseRequested: _requested,
    ev.MemoryLeaseGranted: _granted,
    ev.MemoryLeaseRenewed: _renewed,
    ev.MemoryLeaseRevoked: _revoked,
    ev.MemoryLeaseReleased: _released,
    ev.MemoryLeaseDenied: _ended,
    ev.MemoryLeaseReclaimed: _ended,
}  # type: ignore[dict-item]


def apply_lease(leases: Leases, event: ev.Event) -> bool:
    """Fold a lease event into ``leases``; False for an event that is not about leases."""
    handler = LEASE_HANDLERS.get(type(event))
    if handler is None:
        return False
    handler(leases, event)
    return True
