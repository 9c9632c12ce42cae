"""The node agent's reconcile step, as the pure function it is: what the log says should run here
against what runs, to actions. And the agent's own fold: only what concerns its node."""

from __future__ import annotations

import asyncio
import itertools

from gpuherd import events as ev
from gpuherd.log import InProcessLog
from gpuherd.log.records import AppendResult
from services.nodeagent import leases as lease_rules
from services.nodeagent.executors.base import TaskExit, TaskKey, TaskWorkers
from services.nodeagent.reconcile import (
    AgentEvents,
    PowerMove,
    Record,
    RecordEnd,
    ReportLostWorker,
    RequestLease,
    StartTask,
    StartWorkers,
    StopTask,
    Tasks,
    WritePlan,
    WriteTaskFile,
    power,
    reconcile,
)
from services.nodeagent.state import AgentState, evolve, new_state
from services.nodeagent.taskfiles import WorkerDeath
from tests.helpers import finish, node, submit

_seq = itertools.count(1)
NO_TASKS = Tasks(set(), set(), {})


def fold(*events: ev.Event, state: AgentState | None = None, me: str = "n1") -> AgentState:
    state = state if state is not None else new_state(me)
    for event in events:
        evolve(state, next(_seq), event)
    return state


RENDEZVOUS = ev.Rendezvous("n1.local", 29500)


def placed(
    job: str, *allocs: tuple[str, tuple[int, ...]], attempt: int = 0, at: float = 1.0, rendezvous: bool = False
) -> ev.JobPlaced:
    allocations = tuple(ev.Allocation(n, g) for n, g in allocs)
    return ev.JobPlaced(
        id=f"p-{job}-{attempt}",
        at=at,
        job=job,
        attempt=attempt,
        allocations=allocations,
        rendezvous=RENDEZVOUS if rendezvous else None,
    )


def started(job: str, node_name: str, attempt: int = 0, at: float = 2.0) -> ev.JobStarted:
    return ev.JobStarted(id=f"s-{job}-{node_name}-{attempt}", at=at, job=job, attempt=attempt, node=node_name)


def act(state: AgentState, job: str, tasks: Tasks = NO_TASKS, *, now: float = 10.0, simulated: bool = False) -> list:
    return reconcile(
        state, state.node, job, tasks, now, AgentEvents(state.node), simulated=simulated, leases=state.leases
    )


def test_a_part_placed_here_is_started_and_its_start_recorded_once() -> None:
    state = fold(node("n1", 4), node("n2", 4), submit("a", 4, nodes=2), placed("a", ("n1", (0, 1)), ("n2", (0, 1))))
    (start,) = act(state, "a")
    assert isinstance(start, StartTask)
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
    assert act(running, "a", Tasks({TaskKey("a", 0)}, set(), {})) == []
    # After an agent restart, a part the log says started here is adopted, never started twice.
    (adopt,) = act(running, "a", now=12.0)
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
    (start,) = act(state, "a", now=50.0)
    assert start.launch.attained_s == 40.0 and start.launch.key == TaskKey("a", 1)


ELASTIC = ev.JobSpec(name="el", user="u", gpus=2, duration_s=50.0, elastic=ev.Elastic(min=1, max=4))


def test_an_elastic_job_s_leaving_workers_get_the_plan_and_a_simulated_rescale_is_done_by_its_leader() -> None:
    n1_n2 = [node("n1", 2), node("n2", 2), ev.JobSubmitted(id="s", job="e", spec=ELASTIC, intake_source="t")]
    state = fold(*n1_n2, placed("e", ("n1", (0, 1)), rendezvous=True), started("e", "n1"))
    grow = ev.JobResized(
        id="g",
        at=5.0,
        job="e",
        attempt=0,
        generation=1,
        allocations=(ev.Allocation("n1", (0, 1)), ev.Allocation("n2", (0,))),
        rendezvous=RENDEZVOUS,
    )
    leader = fold(grow, state=state)
    key = TaskKey("e", 0)
    (done,) = act(leader, "e", Tasks({key}, set(), {}), simulated=True)
    assert isinstance(done, Record) and isinstance(done.event, ev.RescaleCompleted)
    assert (done.event.generation, done.event.world, done.event.world_before) == (1, 3, 2)
    joiner = fold(*n1_n2, placed("e", ("n1", (0, 1)), rendezvous=True), started("e", "n1"), grow, me="n2")
    (start, plan) = act(joiner, "e", simulated=False)
    assert (
        isinstance(start, StartTask) and start.launch.gpus == (0,) and plan == WritePlan(key, joiner.jobs["e"].plan())
    )
    shrink = ev.JobResized(
        id="s1", at=9.0, job="e", attempt=0, generation=2, allocations=(ev.Allocation("n1", (0, 1)),),
        releasing=(ev.Allocation("n2", (0,)),), kind="shrink", rendezvous=RENDEZVOUS,
    )  # fmt: skip
    leaving = fold(started("e", "n2"), shrink, state=joiner)
    assert act(leaving, "e", Tasks({key}, set(), {})) == [WritePlan(key, leaving.jobs["e"].plan())]
    assert act(leaving, "e", Tasks({key}, set(), {}, planned={key: 2})) == [], "written once per generation"


def test_a_task_that_ended_by_itself_has_its_end_recorded_first_and_once() -> None:
    state = fold(node("n1", 2), submit("a", 1), placed("a", ("n1", (0,))), started("a", "n1"))
    key = TaskKey("a", 0)
    exit_ = TaskExit(key=key, outcome="failed", exit_code=3, reason="local rank 0 exited with code 3", output_tail="x")
    tasks = Tasks(set(), {key}, {}, unrecorded={key: exit_}, progress={key: {"step": 7.0}})
    (end,) = act(state, "a", tasks)
    assert isinstance(end, RecordEnd) and end.key == key
    assert (end.event.outcome, end.event.exit_code, end.event.reason, end.event.output_tail) == (
        "failed",
        3,
        "local rank 0 exited with code 3",
        "x",
    )
    assert end.event.metrics == {"step": 7.0} and end.event.id == "agent.n1:ended:a:0"
    assert act(state, "a", Tasks(set(), {key}, {})) == [], "recorded: nothing more, and not started again"
    # An old attempt's end is recorded too, before the current attempt is looked after.
    requeued = fold(ev.JobRequeued(id="r", at=3.0, job="a", attempt=0, reason="x"), state=state)
    again = fold(placed("a", ("n1", (1,)), attempt=1), state=requeued)
    (end, start) = act(again, "a", tasks)
    assert isinstance(end, RecordEnd) and end.key == key and start.launch.key == TaskKey("a", 1)


def elastic_running(*, memory: ev.MemoryNeeds | None = None) -> AgentState:
    spec = ev.JobSpec(name="e", user="u", gpus=2, duration_s=50.0, elastic=ev.Elastic(min=1, max=4), memory=memory)
    submitted = ev.JobSubmitted(id="s", job="e", spec=spec, intake_source="t")
    return fold(node("n1", 4), submitted, placed("e", ("n1", (0, 1)), rendezvous=True), started("e", "n1", at=3.0))


def test_a_running_elastic_task_gets_each_generation_once_and_the_workers_a_grow_adds() -> None:
    state = elastic_running()
    key = TaskKey("e", 0)
    both = TaskWorkers(launched=frozenset({0, 1}))
    plan = state.jobs["e"].plan()
    assert act(state, "e", Tasks({key}, set(), {}, workers={key: both})) == [WritePlan(key, plan)]
    assert act(state, "e", Tasks({key}, set(), {}, workers={key: both}, planned={key: 0})) == []
    grow = ev.JobResized(
        id="g", at=5.0, job="e", attempt=0, generation=1, allocations=(ev.Allocation("n1", (0, 1, 3)),),
        rendezvous=RENDEZVOUS, state_from="n1/0", joiners=("n1/3",),
    )  # fmt: skip
    grown = fold(grow, state=state)
    (write, workers) = act(grown, "e", Tasks({key}, set(), {}, workers={key: both}, planned={key: 0}))
    assert write == WritePlan(key, grown.jobs["e"].plan()) and write.plan.generation == 1
    assert isinstance(workers, StartWorkers) and workers.launch.gpus == (3,) and workers.launch.key == key
    assert act(grown, "e", Tasks({key}, set(), {}, workers={key: TaskWorkers(launched=frozenset({0, 1, 3}))},
               planned={key: 1})) == []  # fmt: skip
    # Simulated: no processes, so no plan and no workers; its leader says the rescale is done.
    (done,) = act(grown, "e", Tasks({key}, set(), {}), simulated=True)
    assert isinstance(done, Record) and isinstance(done.event, ev.RescaleCompleted)


def test_a_worker_that_died_is_reported_once_unless_the_log_knows_or_the_attempt_is_ending() -> None:
    state = elastic_running()
    key = TaskKey("e", 0)
    dead = (
        WorkerDeath(gpu=1, code=-9, reason="worker was killed by SIGKILL"),
        WorkerDeath(gpu=1, code=-9, reason="worker was killed by SIGKILL"),  # (recorded twice by the shim)
        WorkerDeath(gpu=None, code=127, reason="worker did not start"),  # no GPU: not a worker of the job
        WorkerDeath(gpu=2, code=1, reason="worker exited with code 1"),  # not one of the job's workers
    )
    tasks = Tasks({key}, set(), {}, workers={key: TaskWorkers(launched=frozenset({0, 1}), dead=dead)}, planned={key: 0})
    (lost,) = act(state, "e", tasks)
    assert isinstance(lost, ReportLostWorker)
    assert (lost.event.gpu, lost.event.exit_code, lost.event.id) == (1, -9, "agent.n1:worker-lost:e:0:1:0")
    known = fold(lost.event, state=state)
    assert act(known, "e", tasks) == []
    cancelled = fold(ev.JobCancelRequested(id="c", at=6.0, job="e"), state=state)
    assert [type(a) for a in act(cancelled, "e", tasks)] == [StopTask]


def test_leases_are_asked_for_once_per_worker_and_the_lease_file_written_when_it_changes() -> None:
    state = elastic_running(memory=ev.MemoryNeeds(extra_mb=2048, min_mb=512))
    key = TaskKey("e", 0)
    one = TaskWorkers(launched=frozenset({0}))  # the worker of GPU 1 has not started yet
    (request, file, workers) = act(state, "e", Tasks({key}, set(), {}, workers={key: one}, planned={key: 0}))
    lease = lease_rules.lease_id("e", 0, "n1", 0)
    assert isinstance(request, RequestLease) and request.event.lease == lease and request.event.gpu == 0
    assert (request.event.mb, request.event.min_mb, request.event.id) == (2048, 512, f"agent.n1:lease:{lease}")
    assert file == WriteTaskFile(key, lease_rules.LEASES_FILE, lease_rules.lease_file({}, state.jobs["e"], "n1"))
    assert isinstance(workers, StartWorkers) and workers.launch.gpus == (1,)
    written = {(key, lease_rules.LEASES_FILE): file.text}
    settled = Tasks({key}, set(), {}, workers={key: one}, planned={key: 0}, files=written, asked={lease})
    assert act(state, "e", settled) == [workers], "the second worker's lease waits for its process"
    both = settled._replace(workers={key: TaskWorkers(launched=frozenset({0, 1}))})
    (second,) = act(state, "e", both)
    assert isinstance(second, RequestLease) and second.event.gpu == 1
    asked = fold(request.event, state=state)  # the file now names the lease: written again
    (second_again, again) = act(asked, "e", both._replace(asked=frozenset(asked.leases)))
    assert second_again == second, "asked for until the log has it (the same id: stored once)"
    assert isinstance(again, WriteTaskFile) and lease in again.text
    # Simulated (no processes): every worker is there at once, and no file is written.
    simulated = act(state, "e", Tasks({key}, set(), {}), simulated=True)
    assert [a.event.gpu for a in simulated if isinstance(a, RequestLease)] == [0, 1]
    assert not [a for a in simulated if isinstance(a, WriteTaskFile)]


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


def test_an_elastic_job_back_on_a_node_it_left_has_its_second_end_recorded_too() -> None:
    """A node's part that left at a shrink and came back at a grow ends twice in one attempt: the
    second end must not share the first one's id (the log would drop it as a repeat, and the job
    would wait for that part forever)."""
    submitted = ev.JobSubmitted(id="s", job="e", spec=ELASTIC, intake_source="t")
    both = (ev.Allocation("n1", (0, 1)), ev.Allocation("n2", (0,)))
    state = fold(
        node("n1", 2), node("n2", 2), submitted, placed("e", *((a.node, a.gpus) for a in both), rendezvous=True),
        started("e", "n1"), started("e", "n2"), me="n2",
    )  # fmt: skip
    key = TaskKey("e", 0)
    shrink = ev.JobResized(
        id="s1", at=5.0, job="e", attempt=0, generation=1, allocations=both[:1], releasing=both[1:],
        kind="shrink", rendezvous=RENDEZVOUS,
    )  # fmt: skip
    state = fold(shrink, state=state)
    left = TaskExit(key=key, outcome="completed", exit_code=0)  # its worker took part in the switch, then left
    (first,) = act(state, "e", Tasks(set(), {key}, {}, unrecorded={key: left}))
    assert isinstance(first, RecordEnd)
    done = ev.RescaleCompleted(id="rc1", at=6.0, job="e", attempt=0, generation=1, node="n1", world=2, world_before=3)
    grow = ev.JobResized(
        id="g2", at=7.0, job="e", attempt=0, generation=2, allocations=both, rendezvous=RENDEZVOUS, joiners=("n2/0",)
    )
    state = fold(first.event, done, grow, state=state)
    # A second copy of the first end (a relay's page and the agent's own append) lands now: it does
    # not speak for the part that came back, which is started.
    state = fold(first.event, state=state)
    assert "n2" not in state.jobs["e"].parts_ended
    (start, _plan) = act(state, "e")
    assert isinstance(start, StartTask) and start.started is not None
    state = fold(start.started, state=state)
    failed = TaskExit(key=key, outcome="failed", exit_code=1, reason="local rank 0 exited with code 1")
    (second,) = act(state, "e", Tasks(set(), {key}, {}, unrecorded={key: failed}))
    assert isinstance(second, RecordEnd) and second.event.outcome == "failed"
    log = InProcessLog()
    stored = asyncio.run(_append_each(log, first.event, second.event))
    assert [r.duplicate for r in stored] == [False, False], "a repeat of the first end's id is dropped by the log"
    state = fold(second.event, state=state)
    assert state.jobs["e"].parts_ended["n2"].outcome == "failed"


def test_a_start_of_a_part_that_left_its_elastic_job_changes_nothing() -> None:
    """Folded after the shrink (late, or its second copy), a start of the part that left would
    read as started when the job comes back to that node, and the new part would not be started."""
    submitted = ev.JobSubmitted(id="s", job="e", spec=ELASTIC, intake_source="t")
    both = (ev.Allocation("n1", (0, 1)), ev.Allocation("n2", (0,)))
    shrink = ev.JobResized(
        id="s1", at=5.0, job="e", attempt=0, generation=1, allocations=both[:1], releasing=both[1:],
        kind="shrink", rendezvous=RENDEZVOUS,
    )  # fmt: skip
    state = fold(
        node("n1", 2), node("n2", 2), submitted, placed("e", *((a.node, a.gpus) for a in both), rendezvous=True),
        started("e", "n1"), started("e", "n2"), shrink, me="n2",
    )  # fmt: skip
    assert state.jobs["e"].started_nodes == ["n1"]
    state = fold(started("e", "n2"), state=state)
    assert state.jobs["e"].started_nodes == ["n1"]


async def _append_each(log: InProcessLog, *events: ev.Event) -> list[AppendResult]:
    return [await log.append([event]) for event in events]
