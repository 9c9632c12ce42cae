"""An elastic worker shrunk off a GPU, whose lease the broker reclaimed, and grown back onto the same
GPU in the same attempt asks for its lease again, and the log takes that request: it has an id of its
own (the generation's), where it had the first request's id and the log dropped it as a duplicate,
so the worker ran without the memory it declared. A retry of the same request still deduplicates."""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply
from gpuherd.log import InProcessLog
from services.nodeagent.executors.base import TaskKey
from services.nodeagent.leases import lease_id
from services.nodeagent.reconcile import AgentEvents, RequestLease, Tasks, sync_leases

SPEC = ev.JobSpec(
    name="el",
    user="ana",
    gpus=2,
    command=("python", "t.py"),
    elastic=ev.Elastic(min=1, max=2),
    memory=ev.MemoryNeeds(extra_mb=10240),
)
KEY = TaskKey("el", 0)
LEASE_OF_GPU1 = lease_id("el", 0, "n1", 1)


def stamped(cls: type[ev.Event], at: float, **fields: object) -> ev.Event:
    return cls(id=f"t{at}-{cls.__name__}", at=at, source="test", **fields)  # type: ignore[call-arg]


def fold(state: ClusterState, *events: ev.Event) -> ClusterState:
    for event in events:
        apply(state, state.seq + 1, event)
    return state


def requests(state: ClusterState, now: float, asked: frozenset[str]) -> dict[int, ev.MemoryLeaseRequested]:
    tasks = Tasks(running={KEY}, exited=set(), deadline_missed={}, asked=asked)
    actions = sync_leases(state.jobs["el"], "n1", KEY, tasks, {0, 1}, now, AgentEvents("n1"), {}, simulated=False)
    return {a.event.gpu: a.event for a in actions if isinstance(a, RequestLease)}


def test_a_worker_grown_back_onto_its_gpu_asks_again_under_an_id_the_log_takes() -> None:
    gpus = tuple(ev.declared_gpus("n1", 4, island=2, model="H100", memory_mb=81920))
    state = fold(
        ClusterState(retain_finished=False),
        stamped(ev.NodeRegistered, 0.0, node="n1", gpus=gpus, executor="cpu"),
        stamped(ev.JobSubmitted, 1.0, job="el", spec=SPEC, intake_source="t"),
        stamped(ev.JobPlaced, 2.0, job="el", attempt=0, allocations=(ev.Allocation("n1", (0, 1)),)),
        stamped(ev.JobStarted, 3.0, job="el", attempt=0, node="n1"),
    )
    log = InProcessLog()
    first = requests(state, 10.0, frozenset())[1]
    assert first.lease == LEASE_OF_GPU1
    assert not log.append_now([first]).duplicate
    retry = requests(state, 11.0, frozenset())[1]
    assert retry.id == first.id and log.append_now([retry]).duplicate, "a retry of the same request"

    # Shrunk off GPU 1 (its lease reclaimed once the rescale completed), then grown back onto it.
    fold(
        state,
        stamped(ev.JobResized, 20.0, job="el", attempt=0, generation=1, allocations=(ev.Allocation("n1", (0,)),),
                releasing=(ev.Allocation("n1", (1,)),), kind="shrink"),
        stamped(ev.RescaleCompleted, 21.0, job="el", attempt=0, generation=1, node="n1", world=1, world_before=2),
        stamped(ev.MemoryLeaseReclaimed, 22.0, lease=LEASE_OF_GPU1, job="el", reason="worker left"),
        stamped(ev.JobResized, 300.0, job="el", attempt=0, generation=2, allocations=(ev.Allocation("n1", (0, 1)),),
                joiners=("n1/1",), state_from="n1/0"),
    )  # fmt: skip
    again = requests(state, 301.0, frozenset({lease_id("el", 0, "n1", 0)}))[1]
    assert again.lease == LEASE_OF_GPU1, "the same lease, asked for anew"
    assert again.id != first.id
    assert not log.append_now([again]).duplicate, "the log takes the new request"
