"""The memory broker's own state: the core fold plus the leases (``gpuherd.fold.leases``), each
GPU's memory in use as its agent last reported it, each running job's peak use, and the broker's
parameters and rules as the log last recorded them."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState, NodeState, apply
from gpuherd.fold import leases as lease_fold
from gpuherd.fold.leases import Leases, apply_lease


class MemoryState(ClusterState, kw_only=True, gc=False):
    leases: Leases = msgspec.field(default_factory=dict)  # leases not ended
    used_mb: dict[str, list[int]] = msgspec.field(default_factory=dict)  # node -> MiB in use per GPU
    # node -> MiB of each GPU's latest reported use that is borrowers' buffers: what the report says
    # they had allocated (``borrowed_mb``, rules 4), else what was lent out of it when the report
    # was folded, the most of it that can be theirs (a share granted after a report is not in it).
    reported_borrowed_mb: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # The most memory one of its GPUs held for the job itself (leases lent out of it not counted),
    # over every report while it ran: the broker's forecast of what the job needs.
    peak_mb: dict[str, int] = msgspec.field(default_factory=dict)
    params: dict[str, float] | None = None  # the latest applied MemoryBrokerConfigured (None: the default)
    # The policy's rules in force (``events.MEMORY_RULES``): the latest applied MemoryBrokerConfigured's.
    # 1 until one is: brokers before the rules were versioned recorded none (a broker records its own
    # at start), so an old log is re-derived by the rules it was decided by.
    rules: int = 1

    def lent_mb(self, node: str) -> dict[int, int]:
        """MiB lent out of each GPU of ``node`` by the leases that hold shares on it."""
        return lease_fold.lent_mb(self.leases, node)

    def host_lent_mb(self, node: str) -> int:
        return lease_fold.host_lent_mb(self.leases, node)

    def gpu_used_mb(self, node: str, gpu: int) -> int | None:
        used = self.used_mb.get(node)
        return used[gpu] if used is not None and gpu < len(used) else None

    def gpu_reported_borrowed_mb(self, node: str, gpu: int) -> int:
        """MiB of GPU ``gpu`` of ``node``'s latest reported use that is borrowers' buffers."""
        borrowed = self.reported_borrowed_mb.get(node)
        return borrowed[gpu] if borrowed is not None and gpu < len(borrowed) else 0


def trusts_reported_borrowed_mb(state: MemoryState) -> bool:
    """Rules 4: a report that says what borrowers had allocated on each GPU (``borrowed_mb``) is
    taken at its word; rules 1 to 3 took every share lent when it was folded as allocated, so a
    share not yet allocated hid as much of the owner's or strays' growth."""
    return state.rules >= 4


def borrowed_in_report(state: MemoryState, node: NodeState, event: ev.GpuMemoryReported) -> list[int]:
    """MiB of each GPU's reported use that is borrowers': what the report says they had allocated
    (rules 4; never more than the GPU's reported use), else every share lent out of it now."""
    said = event.borrowed_mb if trusts_reported_borrowed_mb(state) else None
    if said is None or len(said) < len(node.gpus) or len(event.used_mb) < len(node.gpus):
        lent = state.lent_mb(event.node)
        return [lent.get(slot.info.index, 0) for slot in node.gpus]
    return [max(0, min(said[slot.info.index], event.used_mb[slot.info.index])) for slot in node.gpus]


def evolve(state: MemoryState, seq: int, event: ev.Event, *, params_ok: bool) -> MemoryState:
    """Fold ``event``; ``params_ok``: a MemoryBrokerConfigured in it can be applied."""
    apply(state, seq, event)
    if apply_lease(state.leases, event):
        pass
    elif isinstance(event, ev.GpuMemoryReported):
        node = state.nodes.get(event.node)
        if node is not None:
            borrowed = borrowed_in_report(state, node, event)
            state.used_mb[event.node] = list(event.used_mb[: len(node.gpus)])
            state.reported_borrowed_mb[event.node] = borrowed
            for slot, used, theirs in zip(node.gpus, event.used_mb, borrowed, strict=False):
                job = state.jobs.get(slot.job) if slot.job is not None else None
                if job is not None and job.status == "running":
                    state.peak_mb[job.job] = max(state.peak_mb.get(job.job, 0), used - theirs)
    elif isinstance(event, ev.MemoryBrokerConfigured) and params_ok:
        state.params = dict(event.params)
        state.rules = event.rules
    elif isinstance(event, ev.JobFinished):
        state.peak_mb.pop(event.job, None)
    return state
