"""The scheduler decider: a pure function of (cluster state, event).

On every event it (1) reacts to what the event changes, then (2) tries to
start waiting jobs in the policy's order, each on a whole gang of GPUs.

- A clock tick that shows a node silent for too long -> ``NodeLost``.
- A lost node's jobs, a failed part, a cancel: the attempt must end on every
  node. Agents stop their parts and report ``TaskEnded``; once every part of
  the attempt has ended (a lost node's part counts as ended: its agent fences
  its processes before the loss can be declared) the attempt is *settled*:
  ``JobFinished`` (completed, cancelled, or failed once retries are used up)
  or ``JobRequeued``. GPUs are given back only then, so a new attempt never
  runs next to the remains of the old one.

Decisions within one call are made against a scratch copy of the free GPUs,
so one call never gives a GPU twice; the next call sees them in the state.
"""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.decider import Decider
from gpuherd.state import ACTIVE, ClusterState, JobState, apply, decode_state, encode_state
from services.scheduler.placement import place, views
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
        if isinstance(event, ev.ClockTicked):
            decisions += lost_nodes(state, event)
        elif isinstance(event, ev.NodeLost):
            decisions += self._settle_all(state, _jobs_on(state, event.node))
        elif isinstance(event, ev.TaskEnded):
            decisions += self._settle_all(state, [event.job])
        elif isinstance(event, ev.JobCancelRequested):
            job = state.jobs.get(event.job)
            if job is not None and job.status == "pending":
                decisions.append(
                    ev.JobFinished(
                        job=job.job, attempt=job.attempt, outcome="cancelled", reason="cancelled while waiting"
                    )
                )
            else:
                decisions += self._settle_all(state, [event.job])
        decided = {d.job for d in decisions if isinstance(d, ev.JobFinished | ev.JobRequeued)}
        decisions += self._schedule(state, decided)
        return decisions

    # -- ending attempts ---------------------------------------------------------------------

    def _settle_all(self, state: ClusterState, job_ids: list[str]) -> list[ev.Event]:
        out = []
        for job_id in job_ids:
            job = state.jobs.get(job_id)
            if job is not None and job.status in ACTIVE and job.all_parts_ended():
                out.append(settle(job))
        return out

    # -- placing waiting jobs ------------------------------------------------------------------

    def _schedule(self, state: ClusterState, skip: set[str]) -> list[ev.Event]:
        if not state.queue:
            return []
        free = views(state)
        ports = _ports_in_use(state)
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
                view = free[alloc.node]
                islands = tuple(tuple(i for i in island if i not in used) for island in view.islands)
                free[alloc.node] = type(view)(view.name, view.rack, tuple(i for i in islands if i), view.runs_processes)
            rendezvous = choose_rendezvous(state, job, placement.allocations[0].node, ports)
            placed.append(
                ev.JobPlaced(
                    job=job.job,
                    attempt=job.attempt,
                    allocations=placement.allocations,
                    reason=placement.reason,
                    locality=placement.locality,
                    rendezvous=rendezvous,
                )
            )
        return placed


def lost_nodes(state: ClusterState, tick: ev.ClockTicked) -> list[ev.Event]:
    """Nodes the tick shows silent for longer than its timeout. A node that registered after the
    last word the ticker heard counts from its registration."""
    out: list[ev.Event] = []
    for name, node in sorted(state.nodes.items()):
        if node.status == "lost":
            continue
        heard = max(tick.last_heard.get(name, node.registered_at), node.registered_at)
        silent = tick.at - heard
        if silent > tick.lost_after_s:
            out.append(ev.NodeLost(node=name, reason=f"no heartbeat for {silent:.0f}s"))
    return out


def _jobs_on(state: ClusterState, node_name: str) -> list[str]:
    node = state.nodes.get(node_name)
    if node is None:
        return []
    return sorted({slot.job for slot in node.gpus if slot.job is not None})


def settle(job: JobState) -> ev.JobFinished | ev.JobRequeued:
    """The end of an attempt whose parts have all ended."""
    parts = [(a.node, job.parts_ended[a.node]) for a in job.allocations]
    leader = parts[0][1]
    if job.cancel_requested:
        return ev.JobFinished(
            job=job.job,
            attempt=job.attempt,
            outcome="cancelled",
            reason="cancelled on request",
            metrics=leader.metrics,
            output_tail=leader.output_tail,
        )
    if all(p.outcome == "completed" for _, p in parts):
        return ev.JobFinished(
            job=job.job,
            attempt=job.attempt,
            outcome="completed",
            node=parts[0][0],
            exit_code=leader.exit_code,
            metrics=leader.metrics,
            output_tail=leader.output_tail,
        )
    failed = [(node, p) for node, p in parts if p.outcome == "failed"]
    if failed:
        node, part = failed[0]
        why = f"on {node}: {part.reason or f'exit code {part.exit_code}'}"
        if job.failures < job.spec.max_retries:
            retry = job.failures + 1
            return ev.JobRequeued(
                job=job.job, attempt=job.attempt, reason=f"failed {why}; retry {retry} of {job.spec.max_retries}"
            )
        return ev.JobFinished(
            job=job.job,
            attempt=job.attempt,
            outcome="failed",
            node=node,
            exit_code=part.exit_code,
            reason=f"failed {why}" + (f" after {job.failures} retries" if job.failures else ""),
            output_tail=part.output_tail,
            metrics=leader.metrics,
        )
    # Nothing failed on its own: a node was lost (or a part was stopped for one). Not the job's fault.
    ended = sorted((p for _, p in parts if p.outcome != "completed"), key=lambda p: p.outcome != "lost")
    return ev.JobRequeued(job=job.job, attempt=job.attempt, reason=ended[0].reason or ended[0].outcome)


# -- rendezvous ------------------------------------------------------------------------------------


def _ports_in_use(state: ClusterState) -> dict[str, set[int]]:
    used: dict[str, set[int]] = {}
    for job in state.jobs.values():
        if job.status in ACTIVE and job.rendezvous is not None and job.allocations:
            used.setdefault(job.allocations[0].node, set()).add(job.rendezvous.port)
    return used


def choose_rendezvous(
    state: ClusterState, job: JobState, leader: str, in_use: dict[str, set[int]]
) -> ev.Rendezvous | None:
    """MASTER_ADDR/PORT of an attempt: the leader node's address and a port of its declared range
    that no running job there holds. The first port tried depends on (job, attempt), so a retry does
    not reuse the port of the attempt before it (it may linger in TIME_WAIT)."""
    node = state.nodes[leader]
    if node.port_range is None or not node.address:
        return None  # a node without processes (sim) needs no rendezvous
    first, last = node.port_range
    size = last - first + 1
    taken = in_use.setdefault(leader, set())
    start = int(ev.stable_id(job.job, str(job.attempt), length=8), 16) % size
    for offset in range(size):
        port = first + (start + offset) % size
        if port not in taken:
            taken.add(port)
            return ev.Rendezvous(addr=node.address, port=port)
    return None
