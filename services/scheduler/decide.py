"""The scheduler decider: a pure function of (cluster state, event).

On every event it (1) reacts to what the event changes, then (2) runs a
scheduling pass (``schedule.py``): waiting jobs in the policy's order, each
on a whole gang of GPUs, within VC quotas, with backfill and preemption.
The policy is the log's latest ``PolicyConfigured`` (this decider's default
before there is one), so a replay uses the policy each decision was made with.

- A clock tick that shows a node silent for too long -> ``NodeLost``.
- A GPU turning unhealthy -> its job is preempted (no grace) and requeued.
- A lost node's jobs, a failed part, a cancel: the attempt must end on every
  node. Agents stop their parts and report ``TaskEnded``; once every part of
  the attempt has ended (a lost node's part counts as ended: its agent fences
  its processes before the loss can be declared) the attempt is *settled*:
  ``JobFinished`` (completed, cancelled, or failed once retries are used up)
  or ``JobRequeued`` (also after a preemption, which is not a failure).
  GPUs are given back only then, so a new attempt never runs next to the
  remains of the old one.

Decisions within one call are made against a scratch copy of the free GPUs,
so one call never gives a GPU twice; the next call sees them in the state.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuherd import events as ev
from gpuherd.decider import Decider
from gpuherd.state import ACTIVE, ClusterState, JobState, apply, decode_state, encode_state
from services.scheduler.placement import ViewCache
from services.scheduler.policy import POLICIES, Fifo, Policy, make_policy
from services.scheduler.resize import on_failed, on_proposal, on_worker_lost
from services.scheduler.schedule import Plan, plan

# Events after which a pass can place nothing the pass before could not: no GPU freed, no job,
# node, quota, order or time changed. (JobPlaced: the pass that placed it placed all it could.)
NOTHING_TO_PLACE: frozenset[type[ev.Event]] = frozenset(
    {
        ev.JobPlaced,
        ev.JobRejected,
        ev.JobStarted,
        ev.TaskEnded,
        ev.JobPreempted,
        ev.NodeDrained,
        ev.NodePowerDownRequested,
        ev.NodePoweredDown,
        ev.ProfileRequested,
        ev.ProfileReported,
        ev.RescaleFailed,
        ev.WorkerLost,
    }
)


# Events whose only decisions are a scheduling pass (no branch of ``decide`` looks at them): of
# several waiting at once, the runner lets the last one make the pass (``coalescible``).
PASS_ONLY: frozenset[type[ev.Event]] = frozenset(
    {
        ev.JobSubmitted,
        ev.JobFinished,
        ev.JobRequeued,
        ev.NodeRegistered,
        ev.NodeUndrained,
        ev.VcConfigured,
        ev.PolicyConfigured,
    }
)


# Of those, the ones it still reacts to (settling an attempt, committing an elastic job's new generation).
REACTS_TO: frozenset[type[ev.Event]] = frozenset({ev.TaskEnded, ev.RescaleFailed, ev.WorkerLost})


class SchedulerDecider(Decider[ClusterState]):
    name = "scheduler"

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Fifo()
        self._policy_cache: tuple[tuple, Policy] | None = None
        self._views = ViewCache()

    def initial_state(self) -> ClusterState:
        return ClusterState()

    def evolve(self, state: ClusterState, seq: int, event: ev.Event) -> ClusterState:
        return apply(state, seq, event)

    def coalescible(self, event: ev.Event) -> bool:
        return type(event) in PASS_ONLY

    def independent(self, event: ev.Event) -> str | None:
        # Settling a task's attempt reads and decides about that job alone (and makes no pass).
        return event.job if type(event) is ev.TaskEnded else None

    def encode_state(self, state: ClusterState) -> bytes:
        return encode_state(state)

    def decode_state(self, data: bytes) -> ClusterState:
        return decode_state(data)

    def decide(self, state: ClusterState, event: ev.Event) -> list[ev.Event]:
        kind = type(event)
        if kind in NOTHING_TO_PLACE and kind not in REACTS_TO:
            return []  # (the common case first: most events are these)
        decisions: list[ev.Event] = []
        if isinstance(event, ev.RescaleProposed):
            return on_proposal(state, event)  # a pass waits until the resize is folded (it takes GPUs)
        if isinstance(event, ev.RescaleFailed):
            return on_failed(state, event)
        if isinstance(event, ev.WorkerLost):
            return on_worker_lost(state, event)
        if isinstance(event, ev.ClockTicked):
            decisions += lost_nodes(state, event)
        elif isinstance(event, ev.NodeLost):
            decisions += self._settle_all(state, _jobs_on(state, event.node))
        elif isinstance(event, ev.GpuHealthChanged) and not event.healthy:
            decisions += _off_unhealthy_gpu(state, event)
        elif isinstance(event, ev.TaskEnded):
            # Settling frees no GPU until its JobFinished or JobRequeued is folded: the pass that
            # can use them is that event's (of several waiting at once, the last one's), not this one.
            return self._settle_all(state, [event.job])
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
        if kind in NOTHING_TO_PLACE and not decisions:
            return decisions
        if any(type(d) is ev.NodeLost for d in decisions):
            return decisions  # pass once the loss is folded: this state still shows the node up
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

    def policy_for(self, state: ClusterState) -> Policy:
        """The policy in force: the log's latest PolicyConfigured, else this decider's default."""
        config = state.scheduling
        if config.policy is None:
            return self.policy
        key = (config.policy, tuple(sorted(config.params.items())))
        if self._policy_cache is None or self._policy_cache[0] != key:
            try:
                policy = make_policy(config.policy, _policy_params(config.policy, config.params))
            except (ValueError, TypeError):
                # A name or parameter the CLI would have refused (appended by hand): it must not stop
                # the scheduler on every restart. The decider's default stays in force, as before it.
                policy = self.policy
            self._policy_cache = (key, policy)
        return self._policy_cache[1]

    def plan(self, state: ClusterState, skip: frozenset[str] | set[str] = frozenset()) -> Plan:
        """This state's scheduling pass: placements, preemptions, and why the rest wait."""
        return plan(state, self.policy_for(state), backfill=state.scheduling.backfill, skip=skip)

    def _schedule(self, state: ClusterState, skip: set[str]) -> list[ev.Event]:
        if not state.queue:
            return []
        policy = self.policy_for(state)
        result = plan(state, policy, backfill=state.scheduling.backfill, skip=skip, cache=self._views, explain=False)
        return [*result.preempted, *result.placed, *power_up(state, result, self._views.asleep)]


def power_up(state: ClusterState, result: Plan, candidates: Iterable[str] | None = None) -> list[ev.Event]:
    """Demand is back: jobs wait for GPUs (not for quota) while nodes are powered down to save
    energy. Wake as many as the waiting jobs need beyond the free and already-booting GPUs;
    nodes still draining first (they serve again at once), then powered-off ones. ``candidates``:
    the names of every node that may be asleep (by default all)."""
    nodes = state.nodes.values() if candidates is None else (state.nodes[name] for name in candidates)
    asleep = [n for n in nodes if n.status == "up" and n.power in ("draining", "off")]
    if not asleep:
        return []
    waiting = [state.jobs[j] for j, p in result.pending.items() if p.kind in ("gang", "powered-down")]
    if not waiting:
        return []
    wanted = sum(j.spec.gpus for j in waiting)
    coming = sum(len(n.free_gpus()) for n in state.nodes.values() if n.status == "up" and n.power == "booting")
    need = wanted - coming - sum(len(n.free_gpus()) for n in state.nodes.values() if n.accepts_work())
    out: list[ev.Event] = []
    reason = f"{len(waiting)} jobs wait for {wanted} GPUs"
    for node in sorted(asleep, key=lambda n: (n.power != "draining", n.node)):
        if need <= 0:
            break
        out.append(ev.NodePowerUpRequested(node=node.node, reason=reason))
        need -= len(node.gpus)
    return out


def _policy_params(name: str, params: dict[str, float]) -> dict[str, float]:
    """The params the policy takes (PolicyConfigured also carries cluster-wide ones: CLUSTER_PARAMS)."""
    known = POLICIES[name].PARAMS if name in POLICIES else ()
    return {k: v for k, v in params.items() if k in known}


def lost_nodes(state: ClusterState, tick: ev.ClockTicked) -> list[ev.Event]:
    """Nodes the tick shows silent for longer than its timeout. A node that registered after the
    last word the ticker heard counts from its registration."""
    out: list[ev.Event] = []
    cutoff = tick.at - tick.lost_after_s  # heard from before this: lost
    if cutoff <= 0:
        return out  # no node can have been silent that long (simulations tick this way)
    for name, node in sorted(state.nodes.items()):
        if node.status == "lost" or node.registered_at >= cutoff or node.power in ("off", "booting"):
            continue  # a powered-down node is silent by design
        heard = max(tick.last_heard.get(name, node.registered_at), node.registered_at)
        silent = tick.at - heard
        if silent > tick.lost_after_s:
            out.append(ev.NodeLost(node=name, reason=f"no heartbeat for {silent:.0f}s"))
    return out


def _off_unhealthy_gpu(state: ClusterState, event: ev.GpuHealthChanged) -> list[ev.Event]:
    """A job on a GPU that turned unhealthy must move: it is preempted at once (no grace) and
    requeued when its parts have stopped; the GPU gets no new work until it is healthy again."""
    node = state.nodes.get(event.node)
    if node is None or not 0 <= event.index < len(node.gpus):
        return []
    holder = state.jobs.get(node.gpus[event.index].job or "")
    if holder is None or holder.status not in ACTIVE or holder.preempt_reason is not None:
        return []
    reason = f"GPU {event.node}/{event.index} unhealthy: {event.reason}"
    return [ev.JobPreempted(job=holder.job, attempt=holder.attempt, reason=reason, grace_s=0.0)]


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
    if job.preempt_reason is not None:
        return ev.JobRequeued(job=job.job, attempt=job.attempt, reason=job.preempt_reason)
    # Nothing failed on its own: a node was lost (or a part was stopped for one). Not the job's fault.
    ended = sorted((p for _, p in parts if p.outcome != "completed"), key=lambda p: p.outcome != "lost")
    return ev.JobRequeued(job=job.job, attempt=job.attempt, reason=ended[0].reason or ended[0].outcome)
