"""The node agents of a simulated cluster: the live agent's reconcile step (``services.nodeagent``)
with the ``sim`` executor's task bookkeeping (``SimTasks``), on the simulation's virtual clock.

Each job event is reconciled on every node it concerns, exactly as each node's agent would, and the
actions are carried out here: a started task is a timer at its end, a stopped one is cancelled, and
what an agent would append is returned to append. The agents read the scheduler's fold of the log
(the same core fold each agent keeps of its node), taken at the record they react to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from apps.sim.elastic import ElasticRuns
from gpuherd import events as ev
from gpuherd.fold import ACTIVE, ClusterState, JobState
from gpuherd.log import Record
from services.nodeagent.executors.base import TaskKey
from services.nodeagent.executors.sim import SimTasks, remaining_s
from services.nodeagent.reconcile import (
    AgentEvents,
    RequestLease,
    StartTask,
    StopTask,
    Tasks,
    power,
    reconcile,
)
from services.nodeagent.reconcile import (
    Record as RecordAction,
)

# (when, what, payload): the simulation keeps these on its clock and hands them back to ``fire``.
Timer = tuple[float, str, tuple]

# (Looked up by type, once per record: no subclass of an event type is ever written.)
_POWER_EVENTS = frozenset({ev.NodePowerDownRequested, ev.NodePowerUpRequested, ev.NodeWakeRequested})
# Job events an agent has nothing to do about: the job is not placed anywhere by them.
NOT_FOR_AGENTS = frozenset({ev.JobSubmitted, ev.JobDurationPredicted, ev.ProfileRequested, ev.ProfileReported})
# Job events after which a task's exits are no longer needed, and a draining node may be empty.
_ENDS_ATTEMPT = frozenset({ev.JobFinished, ev.JobRequeued})


@dataclass
class SimAgents:
    """Every node's agent, with a ``sim`` executor each."""

    boot_s: float = 300.0  # a powered-down node's time from power-up request to serving again
    checkpoint_cost: Callable[[int], float] | None = None  # a preempted job's restore time, by its GPUs
    tasks: dict[str, SimTasks] = field(default_factory=dict)  # node -> its executor's tasks
    exited: dict[str, set[TaskKey]] = field(default_factory=dict)  # node -> tasks that ended on their own
    events: dict[str, AgentEvents] = field(default_factory=dict)
    views: dict[str, Tasks] = field(default_factory=dict)  # node -> what reconcile reads of its tasks
    booting: set[str] = field(default_factory=set)
    asked: set[str] = field(default_factory=set)  # leases requested (an agent asks once per lease)
    running_on: dict[str, dict[str, None]] = field(default_factory=dict)  # job -> nodes running a task of it
    # Elastic jobs that declare their scaling run by it (their work in samples, each rescale's cost);
    # None: every sim job runs its duration, whatever its size.
    elastic: ElasticRuns | None = None
    rescaling: set[tuple[str, int, int]] = field(default_factory=set)  # (job, attempt, generation) under way

    def _of(self, node: str) -> tuple[SimTasks, set[TaskKey], AgentEvents]:
        if node not in self.tasks:
            tasks = self.tasks[node] = SimTasks(self.checkpoint_cost)
            exited = self.exited[node] = set()
            self.events[node] = AgentEvents(node)
            self.views[node] = Tasks(tasks.ends.keys(), exited, {}, asked=self.asked)  # (live views)
        return self.tasks[node], self.exited[node], self.events[node]

    def nodes_of(self, state: ClusterState, job_id: str) -> dict[str, None]:
        """The nodes an event about ``job_id`` concerns (in order, as keys): where it holds GPUs,
        where it runs tasks."""
        job = state.jobs.get(job_id)
        nodes = dict.fromkeys([a.node for a in job.allocations]) if job is not None else {}
        if job is not None and job.releasing:
            nodes.update(dict.fromkeys([a.node for a in job.releasing]))
        running = self.running_on.get(job_id)
        if running:
            nodes.update(running)
        return nodes

    def observe(
        self, record: Record, state: ClusterState, job_id: str | None, before: Iterable[str], now: float
    ) -> tuple[list[ev.Event], list[Timer]]:
        """What the agents append (and the timers they set) once ``record`` is folded into ``state``;
        ``job_id``: the job it is about, if any; ``before``: the nodes its job concerned before it
        was folded."""
        event = record.event
        out: list[ev.Event] = []
        timers: list[Timer] = []
        kind = type(event)
        if kind in NOT_FOR_AGENTS:
            return out, timers
        if job_id is not None:
            nodes = self.nodes_of(state, job_id)
            if before:
                nodes = {**dict.fromkeys(before), **nodes}
            for node in nodes:
                self._reconcile(state, node, job_id, now, out, timers)
            if kind is ev.JobFinished and self.elastic is not None:
                self.elastic.forget(job_id)
            if kind in _ENDS_ATTEMPT:
                for node in nodes:  # a draining node may now be empty
                    self._power(state, node, now, out, timers)
                for node in nodes:  # what its tasks' exits were is no longer needed
                    exited = self.exited.get(node)
                    if exited:
                        exited.difference_update([k for k in exited if k.job == job_id])
        elif kind in _POWER_EVENTS:
            self._power(state, event.node, now, out, timers)  # type: ignore[attr-defined]
        return out, timers

    def _reconcile(
        self, state: ClusterState, node: str, job_id: str, now: float, out: list[ev.Event], timers: list[Timer]
    ) -> None:
        tasks = self.tasks.get(node)  # (every reconcile: the node's executor, once it has one, is read directly)
        if tasks is None:
            tasks = self._of(node)[0]
        events = self.events[node]
        job = state.jobs.get(job_id)
        # (Only an elastic job can be modelled: most jobs are not, and are not asked.)
        modelled = (
            self.elastic is not None and job is not None and job.spec.elastic is not None and self.elastic.models(job)
        )
        for action in reconcile(state, node, job_id, self.views[node], now, events, simulated=True):
            if isinstance(action, StartTask):
                end = tasks.start(action.launch, now)
                if action.started is not None:
                    out.append(action.started)
                if end is not None and modelled:  # it runs by its scaling: its end is its work's
                    end = tasks.ends[action.launch.key] = self.elastic.start(job, end - remaining_s(action.launch))  # type: ignore[union-attr,arg-type]
                if end is not None:
                    timers.append((end, "task-end", (node, action.launch.key, end)))
                    self.running_on.setdefault(job_id, {})[node] = None
            elif isinstance(action, StopTask):
                if tasks.stop(action.key):
                    self._gone(job_id, node, tasks)
                    if modelled and (job.status not in ACTIVE or job.stopping()):  # type: ignore[union-attr]
                        self.elastic.stop(job_id, now)  # type: ignore[union-attr]  # (not a leaving worker's node)
                    if action.report is None and _left_at_a_shrink(job, node, action.key):
                        # Live, a leaving part's workers exit by themselves once the switch is done,
                        # and the agent records that end: so does the simulated one.
                        out.append(events.ended(action.key, "completed", now, exit_code=0, job=job))
                if action.report is not None:
                    out.append(events.ended(action.key, action.report, now, reason=action.reason, job=job))
            elif isinstance(action, RequestLease):
                self.asked.add(action.event.lease)
                out.append(action.event)
            elif isinstance(action, RecordAction):
                if modelled and isinstance(action.event, ev.RescaleCompleted):
                    self._rescale(job, action.event, now, timers)  # type: ignore[arg-type]
                else:
                    out.append(action.event)
            # (A simulated reconcile writes no plan or file and starts no worker: there are no processes.)

    def _rescale(self, job: JobState, done: ev.RescaleCompleted, now: float, timers: list[Timer]) -> None:
        """A modelled elastic job's new generation: it completes at its first step at the new size
        (the rescale's cost), reporting the throughput it had before; every task of the job ends
        when its work is done at the new rate."""
        key = (job.job, job.attempt, job.generation)
        if key in self.rescaling:
            return  # (its completion is on the clock already)
        self.rescaling.add(key)
        assert self.elastic is not None
        first_step, before, end = self.elastic.rescale(job, now)
        decided = job.rescaled_at or now
        still = max(decided, first_step - self.elastic.costs.pause_s)  # it trains at its old size until then
        times = ev.complete_phase_times({"decided": decided, "quiesced": still, "first_step": first_step})
        report = msgspec.structs.replace(done, at=first_step, times=times, samples_per_s_before=before)
        timers.append((first_step, "rescaled", (key, report)))
        for node in job.nodes:
            task = TaskKey(job.job, job.attempt)
            tasks = self.tasks.get(node)
            if tasks is not None and task in tasks.ends:
                tasks.ends[task] = end
                timers.append((end, "task-end", (node, task, end)))

    def _gone(self, job_id: str, node: str, tasks: SimTasks) -> None:
        """A task of ``job_id`` on ``node`` no longer runs."""
        if not any(key.job == job_id for key in tasks.ends):
            nodes = self.running_on.get(job_id)
            if nodes is not None:
                nodes.pop(node, None)
                if not nodes:
                    del self.running_on[job_id]

    def _power(self, state: ClusterState, node: str, now: float, out: list[ev.Event], timers: list[Timer]) -> None:
        move = power(state, node)
        if move is None or node in self.booting:
            return
        if move.action == "down":
            out.append(self._powered(node, now, up=False))
        else:
            self.booting.add(node)
            timers.append((now + self.boot_s, "booted", (node,)))

    def _powered(self, node: str, now: float, *, up: bool) -> ev.Event:
        kind = ev.NodePoweredUp if up else ev.NodePoweredDown
        stamp = self._of(node)[2].stamp(f"power-{kind.__name__}", f"{now:.3f}", at=now)
        return kind(**stamp, node=node)  # type: ignore[arg-type]

    def fire(self, kind: str, payload: tuple, state: ClusterState, now: float) -> list[ev.Event]:
        """What a timer's moment brings."""
        if kind == "task-end":
            node, key, end = payload
            tasks, exited, events = self._of(node)
            if not tasks.finish(key, end):
                return []  # stopped (or started again) before it could end
            self._gone(key.job, node, tasks)
            exited.add(key)
            return [events.ended(key, "completed", now, exit_code=0, job=state.jobs.get(key.job))]
        if kind == "rescaled":
            key, report = payload
            self.rescaling.discard(key)
            return [report]
        if kind == "booted":
            (node,) = payload
            self.booting.discard(node)
            return [self._powered(node, now, up=True)]
        raise ValueError(f"unknown timer {kind!r}")


def _left_at_a_shrink(job: JobState | None, node: str, key: TaskKey) -> bool:
    """Whether the stopped part is one a rescale moved off ``node`` while its attempt goes on."""
    return job is not None and job.status in ACTIVE and key.attempt == job.attempt and node not in job.nodes
