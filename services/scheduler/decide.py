"""The scheduler decider: a pure function of (its state, an event).

Its routing is one table (``ROUTES``): for each event type it follows, what it reacts with, and
whether a scheduling pass (``schedule.py``) follows. The pass places waiting jobs in the policy's
order, each on a whole gang of GPUs, within VC quotas, with backfill and preemption. The policy
is the log's latest applied ``PolicyConfigured`` (this decider's default before there is one),
so a replay uses the policy each decision was made with.

- A tick of its own timer -> a pass; one that shows a node silent for too long -> ``NodeLost``;
  a running attempt past its time limit -> ``JobTimeLimitReached`` (its parts stop, then it is
  settled as ``timeout``). The live timer ticks when the earliest time limit is reached. An elastic
  rescale in flight past ``rescale_timeout_s`` -> its rollback (``resize.py``, rules 12).
- A waiting job whose dependency can no longer be met (``afterok`` on a job that failed, ...) is
  cancelled (``JobFinished``, with the reason) before the pass, unless it said
  ``kill_on_invalid_dep: false``; the pass holds back jobs whose dependencies are not met yet.
- A GPU turning unhealthy -> its job is preempted (no grace) and requeued.
- A lost node's jobs, a failed part, a cancel: the attempt must end on every node. Agents stop
  their parts and report ``TaskEnded``; once every part of the attempt has ended (a lost node's
  part counts as ended: its agent fences its processes before the loss can be declared) the
  attempt is *settled*: ``JobFinished`` (completed, cancelled, or failed once retries are used
  up) or ``JobRequeued`` (also after a preemption, which is not a failure). GPUs are given back
  only then, so a new attempt never runs next to the remains of the old one.
- Operator commands (VCs, the policy, drains, cancels) are checked here, where they are applied:
  one that cannot be applied gets ``CommandRefused`` with the reason, and changes nothing.
- Submissions from intake are judged in turn (``take``): ``JobSubmitted`` or ``JobRejected``.

Decisions within one call are made against a scratch copy of the free GPUs, so one call never
gives a GPU twice; the next call sees them in the state. ``decide`` itself is total (an event it
does not follow still gets a pass): the audit re-runs it on whatever a recorded decision names
as its cause, including causes older versions followed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from gpuherd import events as ev
from gpuherd.fold import ACTIVE, JobState, vc_problem
from gpuherd.obs import get_logger
from gpuherd.runtime.decider import Answer, Decider, refused
from services.scheduler import intake
from services.scheduler.placement import ViewCache
from services.scheduler.policy import Fifo, Policy, check_policy, make_policy, policy_params
from services.scheduler.ranks import RankIndex
from services.scheduler.resize import on_failed, on_proposal, on_worker_lost, overdue_rescales
from services.scheduler.schedule import Plan, VictimMemo, plan
from services.scheduler.state import SchedulerState, SchedulingConfig, evolve, new_state

log = get_logger("gpuherd.scheduler")

Reaction = Callable[[SchedulerState, Any], list[ev.Event]]


PassCheck = Callable[[SchedulerState, Policy, Any], bool]


class Route(NamedTuple):
    """What the scheduler does with an event type: ``react`` (its own decisions about the event),
    then a pass over the waiting jobs if ``passes`` (or, when it is a function, if it says so of
    the state, the policy in force and the event). A route with no reaction that always makes a
    pass is ``coalescible``: of several waiting at once, only the last is decided."""

    react: Reaction | None = None
    passes: bool | PassCheck = True


def _prediction_matters(state: SchedulerState, policy: Policy, e: ev.JobDurationPredicted) -> bool:
    """A prediction changes what a pass places only where it is used: for a job of unknown duration
    (backfill, SJF and SRTF order; every job where declared durations are not trusted), or under a
    policy that ranks by predictions (QSSF). (Before
    scheduling rules 3, every prediction made a pass.)"""
    if state.scheduling.rules < 3:
        return True
    job = state.jobs.get(e.job)
    return job is not None and (
        job.spec.duration_s is None or policy.ranks_by_prediction or not state.scheduling.trusts_declared
    )


def _on_tick(state: SchedulerState, tick: ev.ClockTicked) -> list[ev.Event]:
    return [*lost_nodes(state, tick), *time_limits(state, tick), *overdue_rescales(state, tick)]


def _begins_a_dependency(state: SchedulerState, policy: Policy, e: ev.JobPlaced) -> bool:
    """A placement makes a pass only when a waiting job depends on the job beginning (``after``)."""
    if e.attempt != 0:
        return False
    job = state.jobs.get(e.job)
    member = job.spec.array_of if job is not None else None
    return e.job in state.dependants or (member is not None and member.array in state.dependants)


def _settle_on_node(state: SchedulerState, e: ev.NodeLost) -> list[ev.Event]:
    return settle_all(state, jobs_on_node(state, e.node))


def _settle_task(state: SchedulerState, e: ev.TaskEnded) -> list[ev.Event]:
    return settle_all(state, [e.job])


def _unhealthy(state: SchedulerState, e: ev.GpuHealthChanged) -> list[ev.Event]:
    return [] if e.healthy else off_unhealthy_gpu(state, e)


ROUTES: dict[type[ev.Event], Route] = {
    # demand and supply changed: a pass, nothing else
    ev.JobSubmitted: Route(),
    ev.JobFinished: Route(),
    ev.JobRequeued: Route(),
    ev.JobDurationPredicted: Route(passes=_prediction_matters),  # SJF and QSSF order, backfill ends
    ev.NodeRegistered: Route(),
    ev.NodePowerUpRequested: Route(),  # a draining node serves again at once
    ev.NodeWakeRequested: Route(),
    ev.NodePoweredUp: Route(),
    ev.RescaleCompleted: Route(),  # a shrink's GPUs are given back
    ev.JobResized: Route(),
    # its own reactions
    ev.JobPlaced: Route(passes=_begins_a_dependency),  # `after` dependencies are met once a job begins
    ev.ClockTicked: Route(_on_tick),
    ev.NodeLost: Route(_settle_on_node),
    ev.GpuHealthChanged: Route(_unhealthy),
    ev.TaskEnded: Route(_settle_task, passes=False),  # settling frees GPUs only once folded: that event passes
    ev.RescaleProposed: Route(on_proposal, passes=False),  # a pass waits until the resize is folded
    ev.RescaleFailed: Route(on_failed, passes=False),
    ev.WorkerLost: Route(on_worker_lost, passes=False),
    # operator commands, checked where they are applied
    ev.VcConfigured: Route(lambda s, e: _check(e, vc_problem(e))),
    ev.PolicyConfigured: Route(lambda s, e: _check(e, check_policy(e.policy, e.params, rules=e.rules))),
    ev.NodeDrained: Route(lambda s, e: _check(e, _node_problem(s, e.node)), passes=False),
    ev.NodeUndrained: Route(lambda s, e: _check(e, _node_problem(s, e.node))),
    ev.JobCancelRequested: Route(lambda s, e: cancel(s, e)),
}

# Events all ``decide`` makes of is a pass (no reaction of its own): of several waiting, the last decides.
COALESCIBLE: frozenset[type[ev.Event]] = frozenset(k for k, r in ROUTES.items() if r.react is None and r.passes is True)
# Events all ``decide`` may make of is a pass, maybe only on a condition (a placement, a prediction).
PASSES_ONLY: frozenset[type[ev.Event]] = frozenset(k for k, r in ROUTES.items() if r.react is None)

# Events after which a pass can place nothing the pass before could not (no GPU freed, no job,
# node, quota or order changed): ``decide`` answers them with nothing. Every other event it does
# not follow gets a pass: not live (the runtime never hands it one), but in an audit of a log
# recorded when every event made one.
NOTHING_TO_PLACE: frozenset[type[ev.Event]] = frozenset(
    {
        ev.JobRejected,
        ev.JobStarted,
        ev.JobPreempted,
        ev.NodePowerDownRequested,
        ev.NodePoweredDown,
        ev.ProfileRequested,
        ev.ProfileReported,
        ev.CommandRefused,
    }
)


class SchedulerDecider(Decider[SchedulerState]):
    name = "scheduler"
    # 8: active jobs indexed by VC; 9: running jobs by expected end; 10: dependencies, arrays, per-user
    # counts, time limits; 11: predictions' spread; 12: queue changes (the order kept between passes);
    # 13: changes of each VC's placed and running jobs (the preemption scans kept between passes);
    # 14: the latest rejections (a redelivered submission is answered from them), and the jobs with a
    # rescale in flight
    STATE_FORMAT = 14
    # Intake judges a spec against VCs, node sizes and known jobs: judged beside a pass, it is judged
    # as it would have been just before the pass (the audit re-judges it on that same state).
    TAKES_BESIDE_PASSES = True
    FOLLOWS = frozenset(ROUTES)
    REFUSES = frozenset({ev.VcConfigured, ev.PolicyConfigured, ev.NodeDrained, ev.NodeUndrained, ev.JobCancelRequested})
    EMITS = frozenset(
        {
            ev.JobSubmitted,
            ev.JobRejected,
            ev.JobPlaced,
            ev.JobPreempted,
            ev.JobRequeued,
            ev.JobFinished,
            ev.JobTimeLimitReached,
            ev.JobResized,
            ev.NodeLost,
            ev.NodeWakeRequested,
            ev.CommandRefused,
            ev.ClockTicked,  # its timer (recorded by its shell)
        }
    )

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Fifo()
        # The config the policy was last built for (held: its id stays its own), its key, the policy.
        self._policy_cache: tuple[SchedulingConfig, tuple, Policy] | None = None
        self._views = ViewCache()
        self._ranks = RankIndex()
        self._victimless = VictimMemo()
        self._sizes: tuple[tuple[int, int], intake.NodeSizes] | None = None

    def initial_state(self) -> SchedulerState:
        return new_state()

    def state_type(self) -> type[SchedulerState]:
        return SchedulerState

    def evolve(self, state: SchedulerState, seq: int, event: ev.Event) -> SchedulerState:
        if type(event) is ev.PolicyConfigured:  # judged with the rules it names, as ``decide`` judges it
            return evolve(state, seq, event, policy_problem=functools.partial(check_policy, rules=event.rules))
        return evolve(state, seq, event, policy_problem=check_policy)

    def coalescible(self, event: ev.Event) -> bool:
        return type(event) in COALESCIBLE

    def only_passes(self, event: ev.Event) -> bool:
        return type(event) in PASSES_ONLY

    def independent(self, event: ev.Event) -> str | None:
        # Settling a task's attempt reads and decides about that job alone (and makes no pass).
        return event.job if type(event) is ev.TaskEnded else None

    def keys_of(self, decisions: Sequence[ev.Event]) -> set[str]:
        # A pass decides about jobs (placed, preempted, ended as doomed) and nodes (woken), never
        # about a job's task: it may share a batch with settles of other jobs' tasks.
        return {job for d in decisions if (job := getattr(d, "job", None)) is not None}

    # -- decisions on the log's events ----------------------------------------------------------------

    def decide(self, state: SchedulerState, event: ev.Event) -> list[ev.Event]:
        route = ROUTES.get(type(event))
        if route is None:
            if type(event) in NOTHING_TO_PLACE:
                return []
            route = Route()
        decisions = route.react(state, event) if route.react is not None else []
        passes = route.passes
        if passes is not True and passes is not False:  # (a check of the state, the policy and the event)
            passes = passes(state, self.policy_for(state), event)
        if not passes:
            return decisions
        if decisions:  # (most passes follow an event with no reaction of its own: nothing to look through)
            if any(type(d) is ev.NodeLost for d in decisions):
                return decisions  # pass once the loss is folded: this state still shows the node up
            if any(type(d) is ev.JobResized for d in decisions):
                return decisions  # (an overdue rescale's rollback) its fold makes the pass, which sees its port
        if state.doomed:
            decisions += doomed(state, decisions)
        decided = {d.job for d in decisions if isinstance(d, ev.JobFinished | ev.JobRequeued)} if decisions else set()
        return decisions + self._schedule(state, decided)

    # -- submissions from intake ------------------------------------------------------------------------

    def take(self, state: SchedulerState, external: intake.Submission) -> Answer:
        key = (id(state.nodes), state.registrations)
        if self._sizes is None or self._sizes[0] != key:
            self._sizes = (key, intake.node_sizes(state))  # the nodes' sizes change only when one registers
        if (recorded := intake.recorded_rejection(state, external)) is not None:
            return Answer([], recorded)  # delivered again: its rejection is in the log already
        try:
            verdict = intake.judge(state, external, service=self.name, sizes=self._sizes[1])
        except Exception as exc:  # a bug must not turn one submission into a crash loop
            reason = f"the scheduler failed to judge this submission ({type(exc).__name__}: {exc}); please report it"
            verdict = intake.rejection(state, external, reason, service=self.name)
        return Answer(verdict.events(), verdict.reply())

    def external_key(self, external: intake.Submission) -> str | None:
        return intake.submission_key(external)

    def answers(self, event: ev.Decision) -> bool:
        return isinstance(event, ev.JobSubmitted | ev.JobRejected)

    def recheck(self, state: SchedulerState, answer: ev.Decision) -> str | None:
        assert isinstance(answer, ev.JobSubmitted | ev.JobRejected)
        return intake.recheck(state, answer, service=self.name)

    # -- placing waiting jobs ------------------------------------------------------------------

    def policy_for(self, state: SchedulerState) -> Policy:
        """The policy in force: the log's latest applied PolicyConfigured, else this decider's default
        (also for one that cannot be built from what the log or a snapshot holds: recorded unchecked,
        before commands were checked, or applied under looser checks, e.g. LAS with queues=1e12)."""
        config = state.scheduling
        cached = self._policy_cache
        if cached is not None and cached[0] is config:
            return cached[2]  # (asked at every pass: a config never changes once made, a new one replaces it)
        if config.policy is None:
            return self.policy
        key = (config.policy, tuple(sorted(config.params.items())))
        if cached is None or cached[1] != key:
            try:
                policy = make_policy(config.policy, policy_params(config.policy, config.params))
            except Exception as exc:  # whatever the log holds, it must not stop the scheduler at every pass
                log.warning(
                    "policy in the log cannot be built: the default is in force",
                    policy=config.policy,
                    params=config.params,
                    error=f"{type(exc).__name__}: {exc}",
                    default=self.policy.name,
                )
                policy = self.policy
            self._policy_cache = (config, key, policy)
        else:
            self._policy_cache = (config, key, cached[2])  # (the same parameters in a new config: a snapshot)
        return self._policy_cache[2]

    def plan(self, state: SchedulerState, skip: frozenset[str] | set[str] = frozenset()) -> Plan:
        """This state's scheduling pass, explained: placements, preemptions, and why the rest wait."""
        return plan(state, self.policy_for(state), backfill=state.scheduling.backfill, skip=skip)

    def _schedule(self, state: SchedulerState, skip: set[str]) -> list[ev.Event]:
        if not state.queue:
            return []
        policy = self.policy_for(state)
        result = plan(
            state,
            policy,
            backfill=state.scheduling.backfill,
            skip=skip,
            cache=self._views,
            ranks=self._ranks,
            victimless=self._victimless,
            explain=False,
        )
        asleep = self._views.asleep  # (nearly always none: then there is nothing to wake)
        return [*result.preempted, *result.placed, *(wake_up(state, result, asleep) if asleep else ())]


# -- operator commands --------------------------------------------------------------------------------


def _check(command: ev.Command, problem: str | None) -> list[ev.Event]:
    """Refuse a command that cannot be applied (commands recorded unchecked were applied as they were)."""
    if problem is None or command.unchecked:
        return []
    return [refused(command, problem)]


def _node_problem(state: SchedulerState, node: str) -> str | None:
    return None if node in state.nodes else f"no node {node!r} has registered; see `gpuherd nodes`"


def cancel(state: SchedulerState, e: ev.JobCancelRequested) -> list[ev.Event]:
    """A waiting job ends at once; a placed or running one stops on every node, then settles."""
    job = state.jobs.get(e.job)
    if job is None:
        return _check(e, f"no job {e.job!r} waits or runs (an unknown id, or it has ended)")
    if job.status == "pending":
        return [ev.JobFinished(job=job.job, attempt=job.attempt, outcome="cancelled", reason="cancelled while waiting")]
    return settle_all(state, [e.job])


def doomed(state: SchedulerState, decided: list[ev.Event]) -> list[ev.Event]:
    """Waiting jobs whose dependency can no longer be met are cancelled, with the reason."""
    if not state.doomed:
        return []
    ended = {d.job for d in decided if isinstance(d, ev.JobFinished)}
    out: list[ev.Event] = []
    for job_id, never in state.doomed.items():
        job = state.jobs.get(job_id)
        if job is not None and job.status == "pending" and job_id not in ended:
            out.append(ev.JobFinished(job=job_id, attempt=job.attempt, outcome="cancelled", reason=never))
    return out


# -- time limits -------------------------------------------------------------------------------------


def time_limits(state: SchedulerState, tick: ev.ClockTicked) -> list[ev.Event]:
    """Running attempts past their time limit at the tick's time: each is stopped and ends as ``timeout``."""
    out: list[ev.Event] = []
    for deadline, job_id in state.deadlines:
        if deadline > tick.at:
            break
        job = state.jobs[job_id]
        if job.stopping() or job.spec.time_limit_s is None:
            continue  # already stopping for another reason: that one stands
        out.append(ev.JobTimeLimitReached(job=job_id, attempt=job.attempt, limit_s=job.spec.time_limit_s))
    return out


# -- ending attempts ---------------------------------------------------------------------


def settle_all(state: SchedulerState, job_ids: list[str]) -> list[ev.Event]:
    out: list[ev.Event] = []
    for job_id in job_ids:
        job = state.jobs.get(job_id)
        if job is not None and job.status in ACTIVE and job.all_parts_ended():
            out.append(settle(job))
    return out


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
    if job.time_limit_reached:  # (its parts were stopped for it; a rank that died of the stop is no failure)
        return ev.JobFinished(
            job=job.job,
            attempt=job.attempt,
            outcome="timeout",
            node=parts[0][0],
            reason=f"time limit of {job.spec.time_limit_s:g}s reached",
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


# -- nodes ---------------------------------------------------------------------------------------------


def wake_up(state: SchedulerState, result: Plan, candidates: Iterable[str] | None = None) -> list[ev.Event]:
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
        out.append(ev.NodeWakeRequested(node=node.node, reason=reason))
        need -= len(node.gpus)
    return out


def lost_nodes(state: SchedulerState, tick: ev.ClockTicked) -> list[ev.Event]:
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


def off_unhealthy_gpu(state: SchedulerState, event: ev.GpuHealthChanged) -> list[ev.Event]:
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


def jobs_on_node(state: SchedulerState, node_name: str) -> list[str]:
    node = state.nodes.get(node_name)
    if node is None:
        return []
    return sorted({slot.job for slot in node.gpus if slot.job is not None})
