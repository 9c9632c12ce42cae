"""The node agent's reconcile step over generated histories and snapshots of what runs: what it
may and may not do, and that carrying out its actions converges (a second pass on the same log
asks for nothing that was already done). Examples of each rule are in ``test_reconcile.py``."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.fold import ACTIVE
from services.nodeagent import leases as lease_rules
from services.nodeagent.executors.base import TaskExit, TaskKey, TaskWorkers
from services.nodeagent.reconcile import (
    Action,
    AgentEvents,
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
    dead_rejoining,
    reconcile,
)
from services.nodeagent.state import AgentState, evolve, new_state
from services.nodeagent.taskfiles import WorkerDeath
from tests.helpers import node

ME, OTHER, JOB = "n1", "n2", "j"
GPUS = 4
PLACEMENTS = {  # a job's GPUs -> where the scheduler may put them
    1: [((ME, (0,)),), ((ME, (2,)),), ((OTHER, (0,)),)],
    2: [((ME, (0, 1)),), ((ME, (0,)), (OTHER, (0,))), ((OTHER, (0, 1)),)],
}
RENDEZVOUS = ev.Rendezvous("n1.local", 29500)
NOTHING_RUNS = Tasks(frozenset(), frozenset(), {})


def _allocations(pairs: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[ev.Allocation, ...]:
    return tuple(ev.Allocation(n, g) for n, g in pairs)


@st.composite
def histories(draw: st.DrawFn) -> tuple[AgentState, int]:
    """A log of one job (any of plain, elastic, with memory) as node ``n1``'s agent folds it, every
    event one the scheduler, the agents or the broker could write at that point; and its last
    attempt."""
    spec = ev.JobSpec(
        name=JOB,
        user="u",
        gpus=draw(st.sampled_from([1, 2])),
        duration_s=100.0,
        elastic=draw(st.sampled_from([None, ev.Elastic(min=1, max=4)])),
        memory=draw(st.sampled_from([None, ev.MemoryNeeds(extra_mb=1024)])),
    )
    ids = itertools.count()
    state = new_state(ME)
    seq = itertools.count(1)

    def fold(event: ev.Event) -> None:
        evolve(state, next(seq), event)

    fold(node(ME, GPUS))
    fold(node(OTHER, GPUS))
    fold(ev.JobSubmitted(id="sub", job=JOB, spec=spec, intake_source="t"))
    attempt, at = 0, 1.0
    for _ in range(draw(st.integers(0, 7))):
        job = state.jobs.get(JOB)
        if job is None:
            break  # it finished: an agent forgets it
        at += 1.0
        stamp = {"id": f"e{next(ids)}", "at": at}
        if job.status == "pending":
            where = draw(st.sampled_from(PLACEMENTS[spec.gpus]))
            fold(
                ev.JobPlaced(**stamp, job=JOB, attempt=attempt, allocations=_allocations(where), rendezvous=RENDEZVOUS)
            )
            continue
        nodes = job.nodes
        moves = ["start", "end", "requeue", "finish", "preempt", "cancel"]
        if spec.elastic is not None and job.status == "running":
            moves += ["grow", "shrink", "lose"]
        if spec.memory is not None and job.status == "running":
            moves += ["lease"]
        move = draw(st.sampled_from(moves))
        if move == "start":
            fold(ev.JobStarted(**stamp, job=JOB, attempt=attempt, node=draw(st.sampled_from(nodes))))
        elif move == "end":
            outcome = draw(st.sampled_from(["completed", "failed", "stopped"]))
            where = draw(st.sampled_from(nodes))
            fold(ev.TaskEnded(**stamp, job=JOB, attempt=attempt, node=where, outcome=outcome))  # type: ignore[arg-type]
        elif move == "requeue":
            fold(ev.JobRequeued(**stamp, job=JOB, attempt=attempt, reason="node lost"))
            attempt += 1
        elif move == "finish":
            fold(ev.JobFinished(**stamp, job=JOB, attempt=attempt, outcome="completed"))
        elif move == "preempt":
            fold(ev.JobPreempted(**stamp, job=JOB, attempt=attempt, reason="for k", by="k", grace_s=20.0))
        elif move == "cancel":
            fold(ev.JobCancelRequested(**stamp, job=JOB))
        elif move in ("grow", "shrink"):
            current = {a.node: a.gpus for a in job.allocations}
            grown = dict(current)
            if move == "grow":
                free = [(n, g) for n in (ME, OTHER) for g in range(GPUS) if g not in current.get(n, ())]
                n, g = draw(st.sampled_from(free))
                grown[n] = tuple(sorted((*grown.get(n, ()), g)))
                releasing: tuple[ev.Allocation, ...] = ()
            else:
                if sum(len(g) for g in current.values()) < 2:
                    continue
                n = draw(st.sampled_from(sorted(current)))
                gone = current[n][-1]
                grown[n] = current[n][:-1]
                releasing = (ev.Allocation(n, (gone,)),)
            allocations = tuple(ev.Allocation(n, g) for n, g in grown.items() if g)
            joiners = tuple(w for w in ev.workers_of(allocations) if w not in job.workers)
            fold(
                ev.JobResized(
                    **stamp,
                    job=JOB,
                    attempt=attempt,
                    generation=job.generation + 1,
                    allocations=allocations,
                    rendezvous=RENDEZVOUS,
                    state_from=job.workers[0],
                    joiners=joiners,
                    releasing=releasing,
                    kind=move,  # type: ignore[arg-type]
                )
            )
        elif move == "lose":
            mine = [(a.node, g) for a in job.allocations for g in a.gpus]
            n, g = draw(st.sampled_from(mine))
            fold(ev.WorkerLost(**stamp, job=JOB, attempt=attempt, node=n, gpu=g, exit_code=-9))
        elif move == "lease":
            gpus = [g for a in job.allocations if a.node == ME for g in a.gpus]
            if not gpus:
                continue
            gpu = draw(st.sampled_from(gpus))
            lease = lease_rules.lease_id(JOB, attempt, ME, gpu)
            fold(AgentEvents(ME).lease_requested(job, lease, gpu, at))
            if draw(st.booleans()):
                share = ev.MemoryShare(tier="host", mb=1024)
                fold(
                    ev.MemoryLeaseGranted(
                        id=f"g{next(ids)}",
                        at=at,
                        lease=lease,
                        job=JOB,
                        attempt=attempt,
                        node=ME,
                        gpu=gpu,
                        shares=(share,),
                        expires_at=at + 60.0,
                    )
                )
    return state, attempt


@st.composite
def snapshots(draw: st.DrawFn, state: AgentState, last_attempt: int) -> Tasks:
    """What may run on ``n1`` whatever the log says (an agent restarted, a shim outlived its
    attempt, a task ended a moment ago), and what the agent noted of it."""
    keys = [TaskKey(JOB, a) for a in range(last_attempt + 1)]
    some = st.sets(st.sampled_from(keys))
    running = draw(some)
    exited = draw(some) - running
    deadline_missed = {k: "kept leased memory" for k in draw(some) & running}
    workers = {
        k: TaskWorkers(
            launched=frozenset(draw(st.sets(st.integers(0, GPUS - 1)))),
            dead=tuple(
                draw(
                    st.lists(
                        st.builds(
                            WorkerDeath,
                            gpu=st.one_of(st.none(), st.integers(0, GPUS - 1)),
                            code=st.sampled_from([1, -9]),
                            reason=st.just("worker was killed"),
                        ),
                        max_size=3,
                    )
                )
            ),
        )
        for k in keys
        if draw(st.booleans())
    }
    job = state.jobs.get(JOB)
    generation = job.generation if job is not None else 0
    planned = {k: draw(st.sampled_from([generation, generation - 1])) for k in keys if draw(st.booleans())}
    files = {}
    for k in keys:
        if job is not None and draw(st.booleans()):
            current = lease_rules.lease_file(state.leases, job, ME)
            files[k, lease_rules.LEASES_FILE] = draw(st.sampled_from([current, "{}"]))
    asked = {
        lease_rules.lease_id(JOB, a, ME, g) for a in range(last_attempt + 1) for g in range(GPUS) if draw(st.booleans())
    }
    outcomes = st.sampled_from(["completed", "failed", "stopped"])
    unrecorded = {k: TaskExit(key=k, outcome=draw(outcomes), exit_code=0) for k in exited if draw(st.booleans())}
    return Tasks(
        frozenset(running),
        frozenset(exited),
        deadline_missed,
        workers=workers,
        planned=planned,
        files=files,
        asked=frozenset(asked),
        unrecorded=unrecorded,
        progress={k: {"step": 3.0} for k in keys if draw(st.booleans())},
    )


def step(state: AgentState, tasks: Tasks, *, simulated: bool, now: float = 100.0) -> list[Action]:
    return reconcile(state, ME, JOB, tasks, now, AgentEvents(ME), simulated=simulated, leases=state.leases)


@dataclass
class Node:
    """What carrying out the actions does to the node, as the agent notes it (a model of the
    executor and the agent's notes, to check that a second pass converges)."""

    running: set[TaskKey]
    exited: set[TaskKey]
    deadline_missed: dict[TaskKey, str]
    workers: dict[TaskKey, TaskWorkers]
    planned: dict[TaskKey, int]
    files: dict[tuple[TaskKey, str], str]
    asked: set[str]
    unrecorded: dict[TaskKey, TaskExit]
    progress: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tasks: Tasks) -> Node:
        return cls(
            *(copy.deepcopy(dict(v) if isinstance(v, dict) else set(v)) for v in tasks[:8]), dict(tasks.progress)
        )

    def carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case StartTask(launch, _):
                    self.running.add(launch.key)
                    if launch.elastic and not launch.resume:  # (one adopted has the workers its folder names)
                        self.workers[launch.key] = TaskWorkers(launched=frozenset(launch.gpus))
                case StopTask(key, _, _, report):
                    self.running.discard(key)
                    self.deadline_missed.pop(key, None)
                    if report is not None:  # a part stopped and reported is over for its attempt
                        self.exited.add(key)
                case WritePlan(key, plan):
                    self.planned[key] = plan.generation
                case WriteTaskFile(key, name, text):
                    self.files[key, name] = text
                case StartWorkers(launch):
                    before = self.workers.get(launch.key, TaskWorkers())
                    self.workers[launch.key] = TaskWorkers(
                        launched=before.launched | set(launch.gpus), dead=before.dead
                    )
                case RequestLease(event):
                    self.asked.add(event.lease)
                case RecordEnd(key, _):
                    self.unrecorded.pop(key)

    def tasks(self) -> Tasks:
        return Tasks(
            frozenset(self.running),
            frozenset(self.exited),
            self.deadline_missed,
            workers=self.workers,
            planned=self.planned,
            files=self.files,
            asked=frozenset(self.asked),
            unrecorded=self.unrecorded,
            progress=self.progress,
        )


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data(), histories(), st.booleans())
def test_reconcile_is_a_pure_function_of_the_log_and_what_runs(data, history, simulated: bool) -> None:
    state, last = history
    tasks = data.draw(snapshots(state, last))
    before = (copy.deepcopy(tasks), msgspec_bytes(state))
    first = step(state, tasks, simulated=simulated)
    assert step(state, tasks, simulated=simulated) == first
    assert (tasks, msgspec_bytes(state)) == before, "it changes neither its input nor the state"


@SETTINGS
@given(st.data(), histories(), st.booleans())
def test_what_it_starts_stops_and_records(data, history, simulated: bool) -> None:
    state, last = history
    tasks = data.draw(snapshots(state, last))
    actions = step(state, tasks, simulated=simulated)
    job = state.jobs.get(JOB)
    current = TaskKey(JOB, job.attempt) if job is not None else None
    starts = [a for a in actions if isinstance(a, StartTask)]
    assert len(starts) <= 1
    for start in starts:
        assert job is not None and start.launch.key == current
        assert current not in tasks.running and current not in tasks.exited
        assert job.status in ACTIVE and ME in job.nodes and ME not in job.parts_ended and not job.stopping()
        assert start.launch.gpus == job.allocations[job.nodes.index(ME)].gpus
        assert (start.started is None) == (ME in job.started_nodes), "adopted after a restart, never started twice"
        if start.launch.resume:
            assert start.started is None
    stopped = {a.key for a in actions if isinstance(a, StopTask)}
    assert stopped <= set(tasks.running) | {current}
    leaving = job is not None and job.status in ACTIVE and any(a.node == ME for a in job.releasing)
    for key in tasks.running:
        if key != current or job is None or job.status not in ACTIVE:
            assert key in stopped, "a task of an attempt that is over is stopped"
        elif ME not in job.nodes and not leaving:
            assert key in stopped, "a task of a job no longer here is stopped"
    reported = [a for a in actions if isinstance(a, StopTask) and a.report is not None]
    for stop in reported:
        assert stop.key == current and job is not None
        assert stop.report == ("failed" if current in tasks.deadline_missed and not job.stopping() else "stopped")
    # The ends not recorded yet come first, one each, as the executor said; each is preceded only by
    # the deaths of that task's elastic workers that the log does not know of (died while no agent
    # ran), so that the fold sees lost workers before the part's end.
    ends = [a for a in actions if isinstance(a, RecordEnd)]
    lead: list = []
    position = 0
    for end in ends:
        while isinstance(actions[position], Record) and isinstance(actions[position].event, ev.WorkerLost):
            lost = actions[position].event
            assert job is not None and job.spec.elastic is not None, "only an elastic job's workers are lost"
            assert (lost.job, lost.attempt, lost.node) == (JOB, end.key.attempt, ME)
            assert end.key == current, "a death of an attempt that is over is not news"
            lead.append(actions[position])
            position += 1
        assert actions[position] == end
        position += 1
    assert len(lead) + len(ends) == position
    assert [e.key for e in ends] == sorted(tasks.unrecorded)
    for end in ends:
        exit_ = tasks.unrecorded[end.key]
        assert (end.event.job, end.event.attempt, end.event.node) == (JOB, end.key.attempt, ME)
        assert end.event.outcome == exit_.outcome and end.event.metrics == tasks.progress.get(end.key)
        again = f":{job.generation}" if job is not None and end.key == current and job.generation else ""
        assert end.event.id == f"agent.{ME}:ended:{JOB}:{end.key.attempt}{again}", "a part back here ends anew"


@SETTINGS
@given(st.data(), histories(), st.booleans())
def test_plans_files_workers_and_leases_go_only_to_the_current_task_and_only_when_news(
    data, history, simulated: bool
) -> None:
    state, last = history
    tasks = data.draw(snapshots(state, last))
    actions = step(state, tasks, simulated=simulated)
    job = state.jobs.get(JOB)
    if simulated:
        assert not [a for a in actions if isinstance(a, WritePlan | WriteTaskFile | StartWorkers | ReportLostWorker)]
    if job is None:
        assert all(isinstance(a, StopTask | RecordEnd) for a in actions)
        return
    current = TaskKey(JOB, job.attempt)
    started = any(isinstance(a, StartTask) for a in actions)
    for action in actions:
        match action:
            case WritePlan(key, plan):
                assert key == current and plan == job.plan() and job.spec.elastic is not None
                assert started or tasks.planned.get(key) != plan.generation, "once per generation"
            case WriteTaskFile(key, name, text):
                assert (key, name) == (current, lease_rules.LEASES_FILE) and job.spec.memory is not None
                assert text == lease_rules.lease_file(state.leases, job, ME)
                assert started or tasks.files.get((key, name)) != text
            case StartWorkers(launch):
                assert launch.key == current and current in tasks.running and not simulated
                mine = job.allocations[job.nodes.index(ME)].gpus
                workers = tasks.workers.get(current, TaskWorkers())
                # A GPU gets a worker if it never had one, if its worker left at a rescale, or if its
                # worker died and the generation names it again as a joiner (the rule of b41b401).
                again = workers.left | dead_rejoining(job, ME, workers.dead)
                assert launch.gpus == tuple(g for g in mine if g not in workers.launched or g in again) and launch.gpus
            case RequestLease(event):
                assert job.spec.memory is not None and job.status == "running"
                assert event.lease not in tasks.asked and event.attempt == job.attempt and event.node == ME
                assert event.lease == lease_rules.lease_id(JOB, job.attempt, ME, event.gpu)
                assert event.gpu in job.allocations[job.nodes.index(ME)].gpus
                if job.spec.elastic is not None and not simulated and not started:
                    assert event.gpu in tasks.workers.get(current, TaskWorkers()).launched
            case ReportLostWorker(event):
                assert not job.stopping() and current in tasks.running
                worker = ev.worker_id(ME, event.gpu)
                assert worker in job.workers and worker not in job.lost_workers
                dead = tasks.workers[current].dead
                assert any(d.gpu == event.gpu and d.code == event.exit_code for d in dead)
            case Record(ev.WorkerLost() as event):
                # A death the shim of a task that ended while no agent ran recorded: before that end.
                assert current in tasks.unrecorded and job.spec.elastic is not None and not job.stopping()
                worker = ev.worker_id(ME, event.gpu)
                assert worker in job.workers and worker not in job.lost_workers
                assert any(d.gpu == event.gpu and d.code == event.exit_code for d in tasks.workers[current].dead)
            case Record(event):
                assert simulated and isinstance(event, ev.RescaleCompleted) and job.nodes[0] == ME
    leases = [a.event.lease for a in actions if isinstance(a, RequestLease)]
    reported = [a.event for a in actions if isinstance(a, ReportLostWorker | Record)]
    lost = [e.id for e in reported if isinstance(e, ev.WorkerLost)]
    assert len(leases) == len(set(leases)) and len(lost) == len(set(lost))


@SETTINGS
@given(st.data(), histories(), st.booleans())
def test_carrying_out_its_actions_converges_and_repeats_nothing(data, history, simulated: bool) -> None:
    """Passes on the same log, each carrying out the last one's actions, come to rest within a few
    (a task adopted, then its missing workers, then their leases) on what only the log can settle
    (a stopping part's report, a lost worker, a simulated rescale), and no action is taken twice."""
    state, last = history
    here = Node.of(data.draw(snapshots(state, last)))
    done: list[Action] = []
    for _ in range(4):
        actions = step(state, here.tasks(), simulated=simulated)
        news = [a for a in actions if not settled_by_the_log(a)]
        if not news:
            break
        assert not [a for a in news if a in done], "an action carried out is asked for again"
        done += news
        here.carry_out(actions)
    else:
        raise AssertionError(f"no rest after 4 passes: {actions}")


def settled_by_the_log(action: Action) -> bool:
    stopping = isinstance(action, StopTask) and action.report == "stopped"
    return stopping or isinstance(action, ReportLostWorker | Record)


def msgspec_bytes(state: AgentState) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(state)
