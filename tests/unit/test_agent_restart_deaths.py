"""An elastic task whose workers died while no agent ran (they ended during an agent restart): the
new agent records the deaths its shim wrote down before the task's end, as a live agent would
have, so the job goes on with the survivors rather than stopping its whole gang."""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply
from services.nodeagent.executors.base import TaskExit, TaskKey, TaskWorkers
from services.nodeagent.reconcile import AgentEvents, Record, RecordEnd, Tasks, reconcile
from services.nodeagent.state import evolve, new_state
from services.nodeagent.taskfiles import WorkerDeath
from tests.helpers import node

KEY = TaskKey("e", 0)
DEATH = WorkerDeath(gpu=0, code=3, reason="worker exited with code 3")
ENDED = TaskExit(key=KEY, outcome="failed", exit_code=3, reason="local rank 0 exited with code 3")


def elastic_on_two_nodes() -> list[ev.Event]:
    """Job ``e`` with one worker on n1/0 (this agent's) and one on n2/0, both started; at least 1."""
    spec = ev.JobSpec(name="e", user="u", gpus=2, command=("python", "-c", ""), elastic=ev.Elastic(min=1, max=2))
    both = (ev.Allocation("n2", (0,)), ev.Allocation("n1", (0,)))
    return [
        node("n1", 2, executor="cpu"),
        node("n2", 2, executor="cpu"),
        ev.JobSubmitted(id="s", job="e", spec=spec, intake_source="t"),
        ev.JobPlaced(id="p", at=1.0, job="e", attempt=0, allocations=both, rendezvous=ev.Rendezvous("h", 29500)),
        ev.JobStarted(id="st-n2", at=2.0, job="e", attempt=0, node="n2"),
        ev.JobStarted(id="st-n1", at=2.0, job="e", attempt=0, node="n1"),
    ]


def act(history: list[ev.Event], tasks: Tasks) -> list:
    state = new_state("n1")
    for seq, event in enumerate(history, 1):
        evolve(state, seq, event)
    return reconcile(state, "n1", "e", tasks, 10.0, AgentEvents("n1"), simulated=False)


def cluster(history: list[ev.Event]) -> ClusterState:
    state = ClusterState()
    for seq, event in enumerate(history, 1):
        apply(state, seq, event)
    return state


def test_a_worker_that_died_during_a_restart_is_recorded_lost_before_its_task_s_end() -> None:
    history = elastic_on_two_nodes()
    folder = TaskWorkers(launched=frozenset({0}), dead=(DEATH,))
    tasks = Tasks(set(), {KEY}, {}, workers={KEY: folder}, unrecorded={KEY: ENDED})
    (lost, end) = act(history, tasks)
    assert isinstance(lost, Record) and isinstance(lost.event, ev.WorkerLost), "appended before the end, in order"
    assert (lost.event.node, lost.event.gpu, lost.event.exit_code) == ("n1", 0, 3)
    assert lost.event.id == "agent.n1:worker-lost:e:0:0:0", "the id a live agent gives it: recorded once"
    assert isinstance(end, RecordEnd) and end.event.outcome == "failed"
    job = cluster([*history, lost.event, end.event]).jobs["e"]
    assert not job.stopping() and "n1" not in job.parts_ended, "the job goes on with n2/0"
    assert job.lost_workers == ["n1/0"]


def test_a_death_the_log_knows_of_is_not_recorded_again_with_the_end() -> None:
    history = elastic_on_two_nodes()
    folder = TaskWorkers(launched=frozenset({0}), dead=(DEATH,))
    tasks = Tasks(set(), {KEY}, {}, workers={KEY: folder}, unrecorded={KEY: ENDED})
    (lost, _) = act(history, tasks)
    assert [type(a) for a in act([*history, lost.event], tasks)] == [RecordEnd]
    cancelled = ev.JobCancelRequested(id="c", at=5.0, job="e")
    assert not any(isinstance(a, Record) for a in act([*history, cancelled], tasks)), "the attempt ends anyway"


def test_the_end_of_a_task_without_dead_workers_is_recorded_alone() -> None:
    completed = TaskExit(key=KEY, outcome="completed", exit_code=0)
    tasks = Tasks(set(), {KEY}, {}, workers={KEY: TaskWorkers(launched=frozenset({0}))}, unrecorded={KEY: completed})
    assert [type(a) for a in act(elastic_on_two_nodes(), tasks)] == [RecordEnd]
