"""How the memory broker lends, as pure functions of the cluster state.

**Spare memory of a lender GPU** (a GPU on the borrower's node that is not the borrower's job's):
``total - reserve - need - lent`` (never below 0), where ``reserve`` is a safety margin
(``margin_frac`` of the GPU, at least ``margin_min_mb``), ``lent`` is what leases already hold on
it (granted earlier in the same pass included) and ``need`` is the forecast of the GPU's own job:
the larger of what it uses now and the most it ever used (its observed peak,
``MemoryState.peak_mb``), plus ``owner_headroom``. A job that started less than ``owner_warmup_s``
ago has no trustworthy peak yet: its GPUs lend nothing. A free GPU needs only what strays use on
it. A GPU whose own job borrows memory never lends. What the owner (or strays) uses now is the
GPU's reported use less the borrowers' part of it: a report counts every process on the GPU,
borrowers' buffers on it included, but only of shares they had allocated when it was sampled (a
borrower allocates its share at its next step once it has it): the part the report says is theirs
(``borrowed_mb``), else every share lent when it was made; a share granted since is not in it, so
it counts in ``lent`` alone.

**Grants** fill a request from the fastest tier first: NVLink peers, then PCIe neighbors (at most
``max_neighbors`` lender GPUs per lease), spread evenly over the lenders of a tier (water-filling:
more lenders, more copy bandwidth, less taken from each), then pinned host memory (up to
``host_fraction`` of the node's RAM over all its leases). A request that cannot get ``min_mb`` now
waits; a lease below its size is topped up when memory frees.

A request for less than ``min_share_mb`` is denied (no share is that small), as is a waiting one
that a raised ``min_share_mb`` outgrew. A worker leaving its elastic job at a rescale keeps its
lease (it gets no more) until the switch completes; then the lease is reclaimed.

**Rules** are versioned (``MEMORY_RULES``, recorded in ``MemoryBrokerConfigured``; a log that recorded
none was decided by the first), so a log is audited by the rules it was decided by. Under rules 1
(each change since is a predicate below) a request below ``min_share_mb`` stayed pending
(``denies_requests_below_min_share``), and a leaving worker's lease was reclaimed at the
``JobResized`` (``keeps_leaving_workers_leases``). Under rules 1 and 2 every share lent counted as
in use in the latest report, granted after it or not (``counts_only_reported_shares_in_use``); under
rules 1 to 3 every share lent when the report was made did, allocated by then or not, so a report
of an owner's or strays' growth before the borrower allocated was read as the borrower's use
(``state.trusts_reported_borrowed_mb``).

**Revocations**, with hysteresis against grant/revoke flapping: a lender's shares are revoked when
its own job's *actual* use (on a free GPU, its strays') plus what is lent eats into half the
reserve (the forecast with headroom only gates new grants): the GPU is over-committed, shares not
yet allocated included, as when strays grew between a grant and the borrower's allocation; when a
job is placed on it (its need is unknown), or when a lease expired unrenewed. The newest leases on
the lender go first; a lease revoked on a lender is topped up, once it gave the share back, with
what is spare then. A revocation carries a deadline; a lease not released by then is reclaimed and
its task stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ACTIVE, GpuSlot, NodeState
from gpuherd.fold.leases import LeaseState
from services.memory.state import MemoryState, trusts_reported_borrowed_mb

MAX_OWNER_HEADROOM = 10.0  # (a forecast of 11 times the owner's peak); more only overflows the arithmetic


class BrokerParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    margin_frac: float = 0.05  # of each lender GPU, never lent
    margin_min_mb: int = 1024
    owner_warmup_s: float = 60.0  # a GPU whose job started more recently lends nothing
    owner_headroom: float = 0.10  # forecast of the owner's need = its peak x (1 + headroom)
    max_neighbors: int = 3  # lender GPUs per lease
    min_share_mb: int = 256  # smaller pieces are not worth a lender
    host_fraction: float = 0.5  # of a node's RAM that leases may pin
    lease_term_s: float = 600.0  # a lease its agent does not renew within this is revoked
    revoke_deadline_s: float = 30.0  # time the borrower has to move its blocks off a revoked share

    def __post_init__(self) -> None:
        # Values the broker cannot lend by: a huge margin or headroom overflowed its arithmetic (a
        # crash at every pass), a margin over the GPU revoked every share, a zero piece granted empty
        # shares at every pass, a term or deadline below zero revoked or reclaimed at once.
        for name in self.__struct_fields__:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("margin_frac", "host_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} is a fraction of memory: within 0..1, got {getattr(self, name)}")
        if not 0 <= self.owner_headroom <= MAX_OWNER_HEADROOM:
            raise ValueError(
                f"owner_headroom is a share of the owner's peak: within 0..{MAX_OWNER_HEADROOM:g}, "
                f"got {self.owner_headroom}"
            )
        for name in ("margin_min_mb", "max_neighbors", "owner_warmup_s", "revoke_deadline_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.min_share_mb < 1:
            raise ValueError(f"min_share_mb must be at least 1 MiB, got {self.min_share_mb}")
        if self.lease_term_s <= 0:
            raise ValueError(f"lease_term_s must be positive (seconds), got {self.lease_term_s}")


def params_from(values: dict[str, float]) -> BrokerParams:
    """BrokerParams from ``MemoryBrokerConfigured.params`` (or ``--params``): unknown names are refused."""
    try:
        return msgspec.convert(values, BrokerParams, strict=False)
    except msgspec.ValidationError as exc:
        known = ", ".join(BrokerParams.__struct_fields__)
        raise ValueError(f"{exc}; known parameters: {known}") from None


# -- the rules in force: one predicate per change since rules 1 ------------------------------------


def denies_requests_below_min_share(state: MemoryState) -> bool:
    """Rules 2: a request for less than ``min_share_mb`` is denied; rules 1 left it pending (never
    granted, never denied)."""
    return state.rules >= 2


def keeps_leaving_workers_leases(state: MemoryState) -> bool:
    """Rules 2: a worker leaving its elastic job at a rescale keeps its lease until the switch
    completes, reclaimed by a pass at its ``RescaleCompleted``; rules 1 reclaimed it at the
    ``JobResized`` and made no pass at ``RescaleCompleted``."""
    return state.rules >= 2


def counts_only_reported_shares_in_use(state: MemoryState) -> bool:
    """Rules 3: of a GPU's reported use, only shares lent when the report was made can be the
    borrowers'; rules 1 and 2 took every share lent as in use, one granted after the report (even
    earlier in the same pass) too, which hid as much of the owner's or strays' use and lent it
    again (a GPU with 10 GiB of strays lent 76 of its 76 GiB)."""
    return state.rules >= 3


# -- the view of spare memory -----------------------------------------------------------------------


def reserve_mb(slot: GpuSlot, params: BrokerParams) -> int:
    return max(params.margin_min_mb, int(params.margin_frac * slot.info.memory_mb))


def own_use_mb(state: MemoryState, node: str, gpu: int, lent: int) -> int:
    """What the GPU's own job (on a free GPU, strays) uses by its latest report: the reported use
    less the borrowers' part of it (rules 4: what they had allocated when it was sampled, where the
    report says; rules 3: the shares lent when the report was made; before, ``lent``: what its
    leases hold now, granted since the report or not)."""
    used = state.gpu_used_mb(node, gpu) or 0
    if counts_only_reported_shares_in_use(state):
        lent = state.gpu_reported_borrowed_mb(node, gpu)
    return max(0, used - lent)


def owner_need_mb(state: MemoryState, node: NodeState, slot: GpuSlot, lent: int, params: BrokerParams) -> int | None:
    """The forecast of what the GPU's own job needs; None when it cannot be known yet (the job was
    placed or started within ``owner_warmup_s``), which lends nothing and revokes what is lent."""
    current = own_use_mb(state, node.node, slot.info.index, lent)
    owner = state.jobs.get(slot.job) if slot.job is not None else None
    if owner is None:
        return current  # a free GPU: only strays use it
    if owner.status != "running" or owner.started_at is None or state.now - owner.started_at < params.owner_warmup_s:
        return None
    # A worker that joined at a grow is as new on this GPU as a placed job: the same warm-up.
    joined_at = owner.rescaled_at if ev.worker_id(node.node, slot.info.index) in owner.joiners else None
    if joined_at is not None and state.now - joined_at < params.owner_warmup_s:
        return None
    return int(max(current, state.peak_mb.get(owner.job, 0)) * (1 + params.owner_headroom))


def spare_mb(state: MemoryState, node: NodeState, slot: GpuSlot, lent: int, params: BrokerParams) -> int:
    """What ``slot`` can lend beyond its current leases (0 for a GPU that does not lend)."""
    if not slot.healthy or node.status != "up" or _borrows(state, slot):
        return 0
    need = owner_need_mb(state, node, slot, lent, params)
    if need is None:
        return 0
    return max(0, slot.info.memory_mb - reserve_mb(slot, params) - need - lent)


def _borrows(state: MemoryState, slot: GpuSlot) -> bool:
    owner = state.jobs.get(slot.job) if slot.job is not None else None
    return owner is not None and owner.spec.memory is not None


# MiB granted earlier in the same pass, not yet folded: (node, lender GPU or None for host) -> MiB
Granting = dict[tuple[str, int | None], int]


def host_budget_mb(state: MemoryState, node: NodeState, params: BrokerParams, granting: Granting | None = None) -> int:
    taken = state.host_lent_mb(node.node) + (granting or {}).get((node.node, None), 0)
    return max(0, int(node.host_memory_mb * params.host_fraction) - taken)


def tier_between(node: NodeState, borrower: int, lender: int) -> ev.MemoryTier:
    peers = node.gpus[borrower].info.nvlink_peers if borrower < len(node.gpus) else ()
    return "nvlink" if lender in peers else "pcie"


# -- grants ----------------------------------------------------------------------------------------------


def water_fill(want: int, caps: list[int], min_share: int) -> list[int]:
    """Split ``want`` MiB over lenders with room ``caps`` as evenly as their room allows, using no
    more lenders than pieces of ``min_share`` fit in ``want``; each piece at least ``min_share``."""
    n = min(len(caps), max(1, want // max(1, min_share)))
    order = sorted(range(n), key=lambda i: caps[i])
    out = [0] * len(caps)
    left = want
    for k, i in enumerate(order):
        take = min(caps[i], left // (n - k))
        if take >= min_share:
            out[i] = take
            left -= take
    return out


def plan_shares(
    state: MemoryState, lease: LeaseState, want: int, params: BrokerParams, granting: Granting | None = None
) -> list[ev.MemoryShare]:
    """Shares that give ``lease`` up to ``want`` MiB more, fastest tier first."""
    node = state.nodes.get(lease.node)
    if node is None or node.status != "up" or want < params.min_share_mb:
        return []
    lent = state.lent_mb(node.node)
    for (name, gpu), mb in (granting or {}).items():
        if name == node.node and gpu is not None:
            lent[gpu] = lent.get(gpu, 0) + mb
    mine = set(lease.lenders())
    slots_left = params.max_neighbors - len(mine)
    shares: list[ev.MemoryShare] = []
    left = want
    for tier in ("nvlink", "pcie"):
        if tier not in lease.tiers or slots_left <= 0 or left < params.min_share_mb:
            continue
        candidates = [
            (spare, slot.info.index)
            for slot in node.gpus
            if slot.info.index != lease.gpu
            and slot.job != lease.job
            and slot.info.index not in mine
            and tier_between(node, lease.gpu, slot.info.index) == tier
            and (spare := spare_mb(state, node, slot, lent.get(slot.info.index, 0), params)) >= params.min_share_mb
        ]
        candidates.sort(key=lambda c: (-c[0], c[1]))
        candidates = candidates[:slots_left]
        pieces = water_fill(left, [c[0] for c in candidates], params.min_share_mb)
        for (_, gpu), mb in zip(candidates, pieces, strict=True):
            if mb:
                shares.append(ev.MemoryShare(tier=tier, mb=mb, gpu=gpu))  # type: ignore[arg-type]
                left -= mb
                slots_left -= 1
    if "host" in lease.tiers and left >= params.min_share_mb:
        host = min(left, host_budget_mb(state, node, params, granting))
        if host >= params.min_share_mb:
            shares.append(ev.MemoryShare(tier="host", mb=host))
    return shares


def most_a_node_lends(state: MemoryState, lease: LeaseState, params: BrokerParams) -> int:
    """What the lease could get at best on its node, were every neighbor idle: a request for more
    than this can never be met."""
    node = state.nodes.get(lease.node)
    if node is None:
        return 0
    rooms = sorted(
        (
            s.info.memory_mb - reserve_mb(s, params)
            for s in node.gpus
            if s.info.index != lease.gpu and tier_between(node, lease.gpu, s.info.index) in lease.tiers
        ),
        reverse=True,
    )
    host = int(node.host_memory_mb * params.host_fraction) if "host" in lease.tiers else 0
    return sum(rooms[: params.max_neighbors]) + host


def request_problem(state: MemoryState, e: ev.MemoryLeaseRequested, params: BrokerParams) -> str | None:
    """Why a request can never be granted, or None."""
    if e.mb <= 0 or e.min_mb < 0 or e.min_mb > e.mb:
        return f"asked for {e.mb} MiB with a minimum of {e.min_mb} MiB: need 0 <= min_mb <= mb and mb > 0"
    if not e.tiers:
        return "no memory tier accepted: name at least one of nvlink, pcie, host"
    gone = borrower_gone(state, state.leases.get(e.lease))
    if gone is not None:
        return gone
    too_small = below_min_share(state, e.mb, params)
    if too_small is not None:
        return too_small
    lease = state.leases[e.lease]
    best = most_a_node_lends(state, lease, params)
    if max(e.min_mb, params.min_share_mb) > best:
        return f"node {e.node} can lend at most {best} MiB over tiers {', '.join(e.tiers)}; asked for {e.min_mb} MiB"
    return None


def below_min_share(state: MemoryState, mb: int, params: BrokerParams) -> str | None:
    """Why a lease of ``mb`` MiB can never be granted by these parameters, or None. No share is
    smaller than ``min_share_mb`` (not worth a lender), and one bigger than asked would hold
    memory its lender's owner may need for nothing: such a request is denied, not left waiting."""
    if mb >= params.min_share_mb or not denies_requests_below_min_share(state):
        return None
    return (
        f"asks for {mb} MiB, below the broker's min_share_mb of {params.min_share_mb} MiB "
        f"(smaller pieces are not worth a lender): ask for at least {params.min_share_mb} MiB"
    )


def borrower_gone(state: MemoryState, lease: LeaseState | None) -> str | None:
    """Why a lease's borrower no longer holds its GPU (its attempt ended, it moved, its node was
    lost, it left its elastic job once the switch completed), or None while it does."""
    if lease is None:
        return "no such lease"
    job = state.jobs.get(lease.job)
    if job is None:
        return f"job {lease.job} has ended (or never existed)"
    if job.attempt != lease.attempt or job.status not in ACTIVE:
        return f"attempt {lease.attempt} of job {lease.job} has ended"
    # A worker leaving at the rescale in flight still runs: it takes part in the switch (its state
    # may be the one handed over) and exits once the rescale completed, when its GPU is released.
    held = (*job.allocations, *job.releasing) if keeps_leaving_workers_leases(state) else job.allocations
    if not any(a.node == lease.node and lease.gpu in a.gpus for a in held):
        return f"job {lease.job} no longer runs on GPU {lease.gpu} of {lease.node}"
    node = state.nodes.get(lease.node)
    if node is None or node.status == "lost":
        return f"node {lease.node} is lost"
    return None


# -- the pass --------------------------------------------------------------------------------------------


def decide(state: MemoryState, params: BrokerParams) -> Iterator[ev.Event]:
    """Everything the broker should do now: reclaim leases whose borrower is gone or that missed a
    deadline, revoke shares under pressure or expired, grant what pending leases lack."""
    now = state.now
    for lease in list(state.leases.values()):
        gone = borrower_gone(state, lease)
        if gone is not None:
            yield ev.MemoryLeaseReclaimed(lease=lease.lease, job=lease.job, reason=gone)
            continue
        # A waiting request that min_share_mb (raised since it was asked) outgrew is never granted.
        too_small = below_min_share(state, lease.mb, params) if lease.status == "pending" else None
        if too_small is not None:
            yield ev.MemoryLeaseDenied(lease=lease.lease, job=lease.job, reason=too_small)
            continue
        missed = [g for g, d in lease.revoking.items() if d <= now]
        if missed or (lease.ending_by is not None and lease.ending_by <= now):
            what = f"GPU {', '.join(map(str, sorted(missed)))}" if missed else "the lease"
            yield ev.MemoryLeaseReclaimed(
                lease=lease.lease,
                job=lease.job,
                reason=f"did not release its share of {what} on {lease.node} by the deadline",
                deadline_missed=True,
            )
            continue
        if lease.status == "active" and lease.ending_by is None and lease.expires_at <= now:
            yield ev.MemoryLeaseRevoked(
                lease=lease.lease,
                job=lease.job,
                deadline=now + params.revoke_deadline_s,
                reason=f"expired at {lease.expires_at:.0f}: not renewed",
            )
    yield from _revocations(state, params)
    yield from _grants(state, params)


def _live(state: MemoryState, lease: LeaseState) -> bool:
    return lease.ending_by is None and borrower_gone(state, lease) is None


def leaving(state: MemoryState, lease: LeaseState) -> bool:
    """The lease's worker leaves its elastic job at the rescale in flight (its GPU is released
    when the switch completes)."""
    job = state.jobs.get(lease.job)  # (the core fold keeps releasing apart from allocations)
    return job is not None and any(a.node == lease.node and lease.gpu in a.gpus for a in job.releasing)


def _revocations(state: MemoryState, params: BrokerParams) -> Iterator[ev.Event]:
    by_lender: dict[tuple[str, int], list[LeaseState]] = {}
    for lease in state.leases.values():
        if not _live(state, lease):
            continue
        for gpu in lease.lenders():
            if gpu not in lease.revoking:
                by_lender.setdefault((lease.node, gpu), []).append(lease)
    lent_by_node = {name: state.lent_mb(name) for name in {name for name, _ in by_lender}}
    for (node_name, gpu), leases in sorted(by_lender.items()):
        node = state.nodes[node_name]
        if gpu >= len(node.gpus):
            continue
        slot = node.gpus[gpu]
        lent = lent_by_node[node_name].get(gpu, 0)
        need = owner_need_mb(state, node, slot, lent, params)
        if need is None:
            over, why = lent, f"job {slot.job} was placed on GPU {gpu}: its need is not known yet"
        elif not slot.healthy:
            over, why = lent, f"GPU {gpu} is unhealthy"
        else:
            current = own_use_mb(state, node_name, gpu, lent)
            room = slot.info.memory_mb - reserve_mb(slot, params) // 2
            over = current + lent - room
            why = f"GPU {gpu}'s own use rose to {current} MiB"
            if trusts_reported_borrowed_mb(state):  # (the reason of rules 1 to 3 stays theirs: audits compare it)
                held = state.gpu_reported_borrowed_mb(node_name, gpu)
                why = (
                    f"GPU {gpu}'s own use rose to {current} MiB besides borrowers' {held} MiB: with "
                    f"{lent} MiB lent ({max(0, lent - held)} not allocated yet) it is over-committed "
                    f"by {over} MiB (past the {room} MiB it may hold: its memory less half its reserve)"
                )
        if over <= 0:
            continue
        # Shares already being revoked on it count as gone; the newest leases give back first.
        over -= sum(
            s.mb
            for lease in state.leases.values()
            if lease.node == node_name and gpu in lease.revoking
            for s in lease.shares
            if s.gpu == gpu
        )
        for lease in sorted(leases, key=lambda x: x.requested_at, reverse=True):
            if over <= 0:
                break
            yield ev.MemoryLeaseRevoked(
                lease=lease.lease, job=lease.job, gpus=(gpu,), deadline=state.now + params.revoke_deadline_s, reason=why
            )
            over -= sum(s.mb for s in lease.shares if s.gpu == gpu)


def _grants(state: MemoryState, params: BrokerParams) -> Iterator[ev.Event]:
    granting: Granting = {}  # so the next lease of this pass sees what the ones before took
    for lease in sorted(state.leases.values(), key=lambda x: x.requested_at):
        if not _live(state, lease) or lease.revoking:
            continue  # a top-up waits until revoked shares are given back
        if leaving(state, lease):
            continue  # keeps what it holds through the switch, gets no more: it is reclaimed after
        want = lease.mb - lease.granted_mb
        shares = plan_shares(state, lease, want, params, granting)
        got = sum(s.mb for s in shares)
        if not shares or (lease.status == "pending" and got < lease.min_mb):
            continue
        for share in shares:
            key = (lease.node, share.gpu)
            granting[key] = granting.get(key, 0) + share.mb
        what = ", ".join(f"{s.mb} MiB {s.tier}" + (f" GPU {s.gpu}" if s.gpu is not None else "") for s in shares)
        yield ev.MemoryLeaseGranted(
            lease=lease.lease,
            job=lease.job,
            attempt=lease.attempt,
            node=lease.node,
            gpu=lease.gpu,
            shares=tuple(shares),
            expires_at=state.now + params.lease_term_s,
            reason=f"{got} of {want} MiB: {what}",
        )
