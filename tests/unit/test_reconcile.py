"""The node agent's reconcile step, as the pure function it is: what the log says should run here
against what runs, to actions. And the agent's own fold: only what concerns its node."""

from __future__ import annotations

import itertools

from gpuherd import events as ev
from services.nodeagent.executors.base import TaskKey
from services.nodeagent.reconcile import (
    AgentEvents,
    HandPlan,
    PowerMove,
    Record,
    StartTask,
    StopTask,
    SyncLeases,
    Tasks,
    power,
    reconcile,
)
from services.nodeagent.state import AgentState, evolve, new_state
from tests.helpers import finish, node, submit

_seq = itertools.count(1)
NO_TASKS = Tasks(set(), set(), {})


def fold(*events: ev.Event, state: AgentState | None = None, me: str = "n1") -> AgentState:
    state = state if state is not None else new_state(me)
    for event in events:
        evolve(state, next(_seq), event)
    return state


def placed(job: str, *allocs: tuple[str, tuple[int, ...]], attempt: int = 0, at: float = 1.0) -> ev.JobPlaced:
    allocations = tuple(ev.Allocation(n, g) for n, g in allocs)
    return ev.JobPlaced(id=f"p-{job}-{attempt}", at=at, job=job, attempt=attempt, allocations=allocations)


def started(job: str, node_name: str, attempt: int = 0, at: float = 2.0) -> ev.JobStarted:
    return ev.JobStarted(id=f"s-{job}-{node_name}-{attempt}", at=at, job=job, attempt=attempt, node=node_name)


def act(state: AgentState, job: str, tasks: Tasks = NO_TASKS, *, now: float = 10.0, simulated: bool = False) -> list:
    return reconcile(state, state.node, job, tasks, now, AgentEvents(state.node), simulated=simulated)


def test_a_part_placed_here_is_started_and_its_start_recorded_once() -> None:
    state = fold(node("n1", 4), node("n2", 4), submit("a", 4, nodes=2), placed("a", ("n1", (0, 1)), ("n2", (0, 1))))
    (start, leases) = act(state, "a")
    assert isinstance(start, StartTask) and isinstance(leases, SyncLeases)
    launch = start.launch
    assert (launch.key, launch.gpus, launch.group_rank, launch.world_size, launch.resume) == (
        TaskKey("a", 0),
        (0, 1),
        0,
        4,
        False,
    )
    assert start.started is not None and start.started.id == "agent.n1:start:a:0" and start.started.node == "n1"
    running = fold(started("a", "n1"), state=state)
    assert act(running, "a", Tasks({TaskKey("a", 0)}, set(), {})) == [SyncLeases(TaskKey("a", 0))]
    # After an agent restart, a part the log says started here is adopted, never started twice.
    (adopt, _) = act(running, "a", now=12.0)
    assert adopt.launch.resume and adopt.started is None and adopt.launch.elapsed_s == 10.0


def test_a_part_that_ended_on_its_own_is_not_started_again() -> None:
    state = fold(node("n1", 2), submit("a", 1), placed("a", ("n1", (0,))), started("a", "n1"))
    assert act(state, "a", Tasks(set(), {TaskKey("a", 0)}, {})) == []


def test_a_stopping_attempt_is_stopped_and_reported_with_the_grace_a_preemption_gets() -> None:
    base = fold(node("n1", 2), submit("a", 1), placed("a", ("n1", (0,))), started("a", "n1"))
    running = Tasks({TaskKey("a", 0)}, set(), {})
    preempted = fold(
        ev.JobPreempted(id="pre", at=3.0, job="a", attempt=0, reason="for b", by="b", grace_s=30.0), state=base
    )
    assert act(preempted, "a", running) == [StopTask(TaskKey("a", 0), "for b", 30.0, report="stopped")]
    cancelled = fold(ev.JobCancelRequested(id="c", at=4.0, job="a"), state=preempted)
    assert act(cancelled, "a", running) == [StopTask(TaskKey("a", 0), "cancelled on request", 0.0, report="stopped")]


def test_tasks_of_an_ended_attempt_or_job_are_stopped_without_a_report() -> None:
    state = fold(node("n1", 2), submit("a", 1), placed("a", ("n1", (0,))), started("a", "n1"))
    requeued = fold(ev.JobRequeued(id="r", at=3.0, job="a", attempt=0, reason="node lost"), state=state)
    old = TaskKey("a", 0)
    assert act(requeued, "a", Tasks({old}, set(), {})) == [StopTask(old, "its attempt ended")]
    ended = fold(finish("a", attempt=0), state=requeued)  # (a stale attempt's end changes nothing)
    assert "a" in ended.jobs
    done = fold(placed("a", ("n1", (0,)), attempt=1), started("a", "n1", attempt=1), finish("a", 1), state=ended)
    assert "a" not in done.jobs, "an agent drops a job once it ended"
    assert act(done, "a", Tasks({TaskKey("a", 1)}, set(), {})) == [StopTask(TaskKey("a", 1), "its attempt ended")]


def test_a_task_that_kept_a_revoked_lease_past_its_deadline_is_stopped_as_failed() -> None:
    state = fold(node("n1", 2), submit("a", 1), placed("a", ("n1", (0,))), started("a", "n1"))
    key = TaskKey("a", 0)
    actions = act(state, "a", Tasks({key}, set(), {key: "kept leased memory"}))
    assert actions == [StopTask(key, "kept leased memory", report="failed")]


def test_a_requeued_sim_job_runs_only_what_is_left_of_its_work() -> None:
    state = fold(node("n1", 2), submit("a", 1, duration=100.0), placed("a", ("n1", (0,)), at=0.0))
    state = fold(
        started("a", "n1", at=0.0), ev.JobRequeued(id="r", at=40.0, job="a", attempt=0, reason="x"), state=state
    )
    state = fold(placed("a", ("n1", (1,)), attempt=1, at=50.0), state=state)
    (start, _) = act(state, "a", now=50.0)
    assert start.launch.attained_s == 40.0 and start.launch.key == TaskKey("a", 1)


ELASTIC = ev.JobSpec(name="el", user="u", gpus=2, duration_s=50.0, elastic=ev.Elastic(min=1, max=4))


def test_an_elastic_job_s_leaving_workers_get_the_plan_and_a_simulated_rescale_is_done_by_its_leader() -> None:
    n1_n2 = [node("n1", 2), node("n2", 2), ev.JobSubmitted(id="s", job="e", spec=ELASTIC, intake_source="t")]
    state = fold(*n1_n2, placed("e", ("n1", (0, 1))), started("e", "n1"))
    grow = ev.JobResized(
        id="g",
        at=5.0,
        job="e",
        attempt=0,
        generation=1,
        allocations=(ev.Allocation("n1", (0, 1)), ev.Allocation("n2", (0,))),
    )
    leader = fold(grow, state=state)
    key = TaskKey("e", 0)
    (_, done) = act(leader, "e", Tasks({key}, set(), {}), simulated=True)
    assert isinstance(done, Record) and isinstance(done.event, ev.RescaleCompleted)
    assert (done.event.generation, done.event.world, done.event.world_before) == (1, 3, 2)
    joiner = fold(*n1_n2, placed("e", ("n1", (0, 1))), started("e", "n1"), grow, me="n2")
    (start, plan, _) = act(joiner, "e", simulated=False)
    assert isinstance(start, StartTask) and start.launch.gpus == (0,) and plan == HandPlan(key, again=True)
    shrink = ev.JobResized(
        id="s1", at=9.0, job="e", attempt=0, generation=2, allocations=(ev.Allocation("n1", (0, 1)),),
        releasing=(ev.Allocation("n2", (0,)),), kind="shrink",
    )  # fmt: skip
    leaving = fold(started("e", "n2"), shrink, state=joiner)
    assert act(leaving, "e", Tasks({key}, set(), {})) == [HandPlan(key)]


def test_a_draining_node_powers_down_once_empty_and_a_booting_one_powers_up() -> None:
    state = fold(node("n1", 2), submit("a", 1), placed("a", ("n1", (0,))))
    state = fold(ev.NodePowerDownRequested(id="d", at=3.0, node="n1"), state=state)
    assert power(state, "n1") is None, "a job still holds a GPU"
    state = fold(finish("a"), state=state)
    assert power(state, "n1") == PowerMove("down")
    state = fold(ev.NodePoweredDown(id="off", at=4.0, node="n1"), ev.NodeWakeRequested(id="w", node="n1"), state=state)
    assert power(state, "n1") == PowerMove("up")


def test_an_agent_folds_its_own_node_and_no_other() -> None:
    state = fold(node("n1", 2), node("n2", 8), ev.NodeDrained(id="d", node="n2"), me="n1")
    assert set(state.nodes) == {"n1"} and state.seq > 0
    state = fold(submit("a", 8), placed("a", ("n2", tuple(range(8)))), state=state)
    assert state.jobs["a"].status == "placed", "a job placed elsewhere is still folded (it may come here)"
    state = fold(ev.NodeLost(id="l", node="n2", reason="silent"), state=state)
    assert state.jobs["a"].stopping(), "its part on the lost node ended"
