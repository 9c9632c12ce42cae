"""The memory broker's own state: the core fold plus the leases (``gpuherd.fold.leases``), each
GPU's memory in use as its agent last reported it, each running job's peak use, and the broker's
parameters and rules as the log last recorded them."""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply
from gpuherd.fold import leases as lease_fold
from gpuherd.fold.leases import Leases, apply_lease


class MemoryState(ClusterState, kw_only=True, gc=False):
    leases: Leases = msgspec.field(default_factory=dict)  # leases not ended
    used_mb: dict[str, list[int]] = msgspec.field(default_factory=dict)  # node -> MiB in use per GPU
    # node -> MiB lent out of each GPU when its latest report was folded: the most of ``used_mb``
    # that can be borrowers' (a share granted after a report is not in it).
    reported_lent_mb: dict[str, list[int]] = msgspec.field(default_factory=dict)
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

    def gpu_reported_lent_mb(self, node: str, gpu: int) -> int:
        """MiB lent out of GPU ``gpu`` of ``node`` when its latest report was folded."""
        lent = self.reported_lent_mb.get(node)
        return lent[gpu] if lent is not None and gpu < len(lent) else 0


def evolve(state: MemoryState, seq: int, event: ev.Event, *, params_ok: bool) -> MemoryState:
    """Fold ``event``; ``params_ok``: a MemoryBrokerConfigured in it can be applied."""
    apply(state, seq, event)
    if apply_lease(state.leases, event):
        pass
    elif isinstance(event, ev.GpuMemoryReported):
        node = state.nodes.get(event.node)
        if node is not None:
            lent = state.lent_mb(event.node)
            state.used_mb[event.node] = list(event.used_mb[: len(node.gpus)])
            state.reported_lent_mb[event.node] = [lent.get(slot.info.index, 0) for slot in node.gpus]
            for slot, used in zip(node.gpus, event.used_mb, strict=False):
                job = state.jobs.get(slot.job) if slot.job is not None else None
                if job is not None and job.status == "running":
                    mine = used - lent.get(slot.info.index, 0)
                    state.peak_mb[job.job] = max(state.peak_mb.get(job.job, 0), mine)
    elif isinstance(event, ev.MemoryBrokerConfigured) and params_ok:
        state.params = dict(event.params)
        state.rules = event.rules
    elif isinstance(event, ev.JobFinished):
        state.peak_mb.pop(event.job, None)
    return state
