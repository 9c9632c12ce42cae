"""The scheduler decider: a pure function of (cluster state, event).

On every event it (1) reacts to what the event changes (a lost node's jobs
are requeued, a waiting job's cancellation is final), then (2) tries to
start waiting jobs in the policy's order, each on a whole gang of GPUs.
Decisions within one call are made against a scratch copy of the free GPUs,
so one call never gives a GPU twice; the next call sees them in the state.
"""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.decider import Decider
from gpuherd.state import ACTIVE, ClusterState, apply, decode_state, encode_state
from services.scheduler.placement import free_by_node, place
from services.scheduler.policy import Fifo, Policy


class SchedulerDecider(Decider[ClusterState]):
    name = "scheduler"

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Fifo()

    def initial_state(self) -> ClusterState:
        return ClusterState()

    def evolve(self, state: ClusterState, seq: int, event: ev.Event) -> ClusterState:
        return apply(state, seq, event)

    def encode_state(self, state: ClusterState) -> bytes:
        return encode_state(state)

    def decode_state(self, data: bytes) -> ClusterState:
        return decode_state(data)

    def decide(self, state: ClusterState, event: ev.Event) -> list[ev.Event]:
        decisions: list[ev.Event] = []
        if isinstance(event, ev.NodeLost):
            decisions += self._requeue_lost(state, event.node)
        elif isinstance(event, ev.JobCancelRequested):
            job = state.jobs.get(event.job)
            if job is not None and job.status == "pending":
                decisions.append(
                    ev.JobFinished(
                        job=job.job, attempt=job.attempt, outcome="cancelled", reason="cancelled while waiting"
                    )
                )
        decided = {d.job for d in decisions if isinstance(d, ev.JobFinished | ev.JobRequeued)}
        decisions += self._schedule(state, decided)
        return decisions

    def _requeue_lost(self, state: ClusterState, node_name: str) -> list[ev.Event]:
        node = state.nodes.get(node_name)
        if node is None or node.status != "lost":
            return []
        out: list[ev.Event] = []
        holders = sorted({slot.job for slot in node.gpus if slot.job is not None})
        for job_id in holders:
            job = state.jobs[job_id]
            if job.status not in ACTIVE:
                continue
            if job.cancel_requested:
                out.append(
                    ev.JobFinished(
                        job=job_id,
                        attempt=job.attempt,
                        outcome="cancelled",
                        reason=f"cancelled; node {node_name} was lost",
                    )
                )
            else:
                out.append(
                    ev.JobRequeued(job=job_id, attempt=job.attempt, reason=f"node {node_name} lost: {node.reason}")
                )
        return out

    def _schedule(self, state: ClusterState, skip: set[str]) -> list[ev.Event]:
        if not state.queue:
            return []
        free = free_by_node(state)
        placed: list[ev.Event] = []
        for job in self.policy.order(state):
            if job.job in skip or job.cancel_requested:
                continue
            placement = place(job.spec, free)
            if placement is None:
                if self.policy.blocking:
                    break
                continue
            for alloc in placement.allocations:
                used = set(alloc.gpus)
                free[alloc.node] = [i for i in free[alloc.node] if i not in used]
            placed.append(
                ev.JobPlaced(
                    job=job.job, attempt=job.attempt, allocations=placement.allocations, reason=placement.reason
                )
            )
        return placed
