"""The agent's side of memory leases: what it asks the broker for, what it tells the job.

- It reports its GPUs' memory in use to the log (``GpuMemoryReported``) when a GPU's use moved by
  more than a step, or the borrowers' part of it changed: the broker's view of spare memory,
  without a log entry per telemetry sample. The borrowers' part (``borrowed_mb``) is what their
  runtimes said they hold on each lender GPU (``control.LeaseHeld``) before the sample was taken,
  so a share granted but not yet allocated is not taken for use, and an owner's or strays' growth
  meanwhile is not hidden from the broker.
- For each worker of a job that declares ``memory``, it asks for a lease (``MemoryLeaseRequested``,
  one per worker GPU; the id is derived from job, attempt, node and GPU, so asking twice is a no-op).
- It keeps the task's lease file (``jobenv.MEMORY_LEASES_FILE``) in step with the log: the shares
  granted, and revocations with their deadlines. The runtime (``gpuherd.train.memory``) reads it.
- It renews the leases of tasks that run here, and relays the runtime's acknowledgments of
  revocations as ``MemoryLeaseReleased``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from gpuherd import events as ev
from gpuherd import jobenv
from gpuherd.fold import ClusterState, JobState
from gpuherd.fold.leases import Leases

LEASES_FILE = jobenv.MEMORY_LEASES_FILE

MIN_REPORT_STEP_MB = 256
REPORT_STEP_FRACTION = 0.02  # of the GPU's memory


def lease_id(job: str, attempt: int, node: str, gpu: int) -> str:
    return ev.stable_id("lease", job, str(attempt), node, str(gpu))


def host_memory_mb() -> int:
    """This machine's RAM in MiB (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (ValueError, OSError):
        return 0


class LeaseHoldings:
    """What the borrowers' runtimes on this node last said they hold of their leases on each lender
    GPU (``control.LeaseHeld``). A runtime says so whenever it reads its lease file, so a share not
    mentioned is not allocated yet; unless it was granted before this agent started and its
    runtime has not spoken since (it may hold it): then what borrowers hold cannot be told."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self._held: dict[str, dict[int, int]] = {}  # lease -> lender GPU -> MiB allocated there

    def said(self, lease: str, held_mb: Mapping[int, int]) -> None:
        self._held[lease] = {gpu: mb for gpu, mb in held_mb.items() if mb > 0}

    def borrowed_mb(self, leases: Leases, node: str, gpu_count: int) -> tuple[int, ...] | None:
        """MiB borrowers hold on each of ``node``'s GPUs, or None while it cannot be told."""
        mine = {lease.lease: lease for lease in leases.values() if lease.node == node}
        for gone in set(self._held) - set(mine):
            del self._held[gone]  # (ended: its runtime holds nothing of it any more)
        for lease in mine.values():
            granted_at = lease.expires_at - lease.term_s  # (its latest grant or renewal)
            if lease.lenders() and lease.lease not in self._held and granted_at < self.started_at:
                return None
        out = [0] * gpu_count
        for held in self._held.values():
            for gpu, mb in held.items():
                if 0 <= gpu < gpu_count:
                    out[gpu] += mb
        return tuple(out)


class MemoryReporter:
    """Decides when a node's GPU memory use is worth a log entry."""

    def __init__(self) -> None:
        self.last: list[int] | None = None
        self.last_borrowed: tuple[int, ...] | None = None

    def changed(
        self, state: ClusterState, node: str, used: list[float | None], borrowed: tuple[int, ...] | None = None
    ) -> tuple[int, ...] | None:
        """The use to report now, or None while no GPU moved by more than its step and what
        borrowers hold (``borrowed``, by GPU; None: not known) is as last reported."""
        me = state.nodes.get(node)
        if me is None or not used or any(u is None for u in used):
            return None
        now = [int(u) for u in used]  # type: ignore[arg-type]
        if self.last is not None and len(self.last) == len(now) and borrowed == self.last_borrowed:
            steps = [
                max(MIN_REPORT_STEP_MB, int(REPORT_STEP_FRACTION * slot.info.memory_mb)) for slot in me.gpus[: len(now)]
            ]
            if all(abs(a - b) < step for a, b, step in zip(now, self.last, steps, strict=False)):
                return None
        self.last, self.last_borrowed = now, borrowed
        return tuple(now)


def wanted_requests(job: JobState, node: str, gpus: set[int]) -> list[tuple[str, int]]:
    """(lease id, GPU) for each worker of ``job`` on ``node`` among ``gpus`` (those with a process)."""
    if job.spec.memory is None or job.status != "running":
        return []
    mine = [g for a in job.allocations if a.node == node for g in a.gpus]
    return [(lease_id(job.job, job.attempt, node, g), g) for g in mine if g in gpus]


def lease_file(leases: Leases, job: JobState, node: str) -> str:
    """The task's lease file: every lease of the job's attempt on ``node``, with its shares and
    revocations (``revoke_by``: a lender share's deadline; ``ending_by``: the whole lease's)."""
    out = {}
    for lease in leases.values():
        if lease.job != job.job or lease.attempt != job.attempt or lease.node != node:
            continue
        out[lease.lease] = {
            "gpu": lease.gpu,
            "status": lease.status,
            "shares": [
                {
                    "tier": s.tier,
                    "gpu": s.gpu,
                    "mb": s.mb,
                    "revoke_by": lease.revoking.get(s.gpu) if s.gpu is not None else None,
                }
                for s in lease.shares
            ],
            "ending_by": lease.ending_by,
            "expires_at": lease.expires_at,
        }
    return json.dumps({"job": job.job, "attempt": job.attempt, "leases": out}, sort_keys=True)


def renewals_due(leases: Leases, node: str, running: set[tuple[str, int]], now: float) -> list[tuple[str, str]]:
    """(lease, job) of the active leases of tasks running here that are past half their term."""
    out = []
    for lease in leases.values():
        if lease.node != node or (lease.job, lease.attempt) not in running:
            continue
        if lease.status == "active" and lease.ending_by is None and lease.expires_at - now < lease.term_s / 2:
            out.append((lease.lease, lease.job))
    return out
