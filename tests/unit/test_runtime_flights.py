"""The ordering core with batches in flight (``DecisionCore.dispatched``/``landed``): what it decides
while earlier batches are being appended, and that a log made so is what the audit re-decides."""

import random

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.fold.invariants import violations
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from gpuherd.runtime.core import DecisionCore, Flight, outputs_of
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission
from services.scheduler.state import SchedulerState
from tests.helpers import ended, node, submit

decider = SchedulerDecider()


def submission(seq: int, intake_id: str | None = None, gpus: int = 1, **more: object) -> Submission:
    body = {"name": f"s{seq}", "user": "u", "gpus": gpus, "duration_s": 5, **more}
    if intake_id is not None:
        body["intake_id"] = intake_id
    return Submission(source="t", seq=seq, data=msgspec.json.encode(body), at=1.0)


class World:
    """A log, a core reading it, and batches between the two: dispatched, stored, acknowledged."""

    def __init__(self, *events: ev.Event, serial: bool = False, decider_: SchedulerDecider = decider) -> None:
        self.log: list[Record] = []
        self.core = DecisionCore(decider_, serial=serial)
        self.flights: list[tuple[Flight, list[ev.Event]]] = []  # dispatched, not stored
        self.stored: list[tuple[Flight, list[int]]] = []  # stored, not acknowledged
        for event in events:
            self.store(event)
        self.read_all()

    def store(self, event: ev.Event) -> int:
        self.log.append(Record(len(self.log) + 1, event))
        return len(self.log)

    def read(self) -> None:
        self.core.fold(self.log[self.core.state.seq])

    def read_all(self) -> None:
        while self.core.state.seq < len(self.log):
            self.read()

    def decide(self) -> list:
        batch = self.core.next_batch()
        if batch:
            self.flights.append((self.core.dispatched(batch), outputs_of(batch)))
        return batch

    def land(self, n: int = 0) -> None:
        """Store the n-th batch in flight (the oldest by default) and acknowledge it."""
        flight, outputs = self.flights.pop(n)
        seqs = [self.store(output) for output in outputs]
        self.core.landed(flight, seqs)


def kinds(batch: list) -> list[tuple[str, str]]:
    """Each decision's type and job (an accepted submission's: its name)."""
    return [
        (type(o).__name__, o.spec.name if isinstance(o, ev.JobSubmitted) else getattr(o, "job", ""))
        for d in batch
        for o in d.outputs
    ]


def running(*jobs: str, decider_: SchedulerDecider = decider) -> World:
    """A world where ``jobs`` (1 GPU each) were placed on n1 (4 GPUs), and all of it is folded."""
    world = World(node("n1", 4), *(submit(job, 1) for job in jobs), decider_=decider_)
    world.decide()
    world.land()
    world.read_all()
    while world.core.waiting:
        assert world.decide() == []  # (placements, folded: nothing to decide)
    return world


def test_answers_and_other_jobs_settles_are_decided_while_a_pass_is_in_flight() -> None:
    world = running("a")
    world.store(submit("c", 1))
    world.read_all()
    assert kinds(world.decide()) == [("JobPlaced", "c")]
    world.core.offer(submission(1))
    world.store(ended("a", "n1"))
    world.store(submit("d", 1))  # a pass: waits for the pass in flight
    world.read_all()
    world.core.offer(submission(2))
    batch = world.decide()
    assert kinds(batch) == [("JobSubmitted", "s1"), ("JobFinished", "a"), ("JobSubmitted", "s2")]
    assert {o.based_on for d in batch for o in d.outputs} == {world.core.state.seq}, "on the state folded so far"
    assert world.decide() == [], "nothing else is decidable until a batch lands"
    assert world.core.in_flight == 2
    world.land()  # the pass is stored and acknowledged: not folded back yet
    assert world.decide() == []
    world.read_all()
    assert world.core.in_flight == 1, "the other batch is not stored yet"
    assert kinds(world.decide()) == [("JobPlaced", "d")], "beside the batch of other keys: the next pass"


def test_a_settle_waits_for_a_pass_in_flight_that_decides_about_its_job() -> None:
    class DecidesAboutA(SchedulerDecider):
        def keys_of(self, decisions: list[ev.Event]) -> set[str]:
            return {"a"}  # as if the pass preempted a

    world = running("a", "b", decider_=DecidesAboutA())
    world.store(submit("c", 1))
    world.read_all()
    world.decide()
    world.store(ended("a", "n1"))
    world.store(ended("b", "n1"))
    world.read_all()
    assert kinds(world.decide()) == [("JobFinished", "b")], "a's settle is held back, b's is not"
    world.land()
    world.read_all()
    assert kinds(world.decide()) == [("JobFinished", "a")]


def test_an_event_that_may_make_a_pass_waits_for_the_pass_in_flight_and_holds_nothing_back() -> None:
    """A prediction makes a pass only when the policy reads it (``only_passes``): while a pass is in
    flight it waits, like a pass, and the settle behind it is decided meanwhile."""
    world = running("a")
    world.store(submit("c", 1))
    world.read_all()
    world.decide()
    predicted = ev.JobDurationPredicted(id="analytics:9:0", at=0.0, source="analytics", job="c", seconds=3.0, model="m")
    world.store(predicted)
    world.store(ended("a", "n1"))
    world.read_all()
    assert kinds(world.decide()) == [("JobFinished", "a")]
    assert world.core.waiting == 1, "the prediction waits for the pass in flight"


def test_the_pass_after_a_pass_sees_its_placements() -> None:
    """No two passes on one state: the second waits until the first's placements are folded, so
    it never hands out the same GPUs again."""
    world = World(node("n1", 2), submit("a", 2))
    world.decide()
    world.store(submit("b", 2))
    world.read_all()
    assert world.decide() == []
    world.land()
    assert world.decide() == [], "stored, not folded back"
    world.read_all()
    assert world.decide() == [], "b waits for GPUs a holds"
    world.store(ended("a", "n1"))
    world.read_all()
    assert kinds(world.decide()) == [("JobFinished", "a")]
    world.land()
    world.read_all()
    assert kinds(world.decide()) == [("JobPlaced", "b")]


def test_a_key_in_flight_holds_back_its_later_inputs() -> None:
    """A second submission under an intake id whose verdict is in flight waits for it (and is then
    judged on a state that holds the first), and inputs behind it of other keys go on."""
    world = World(node("n1", 4))
    world.core.offer(submission(1, "same"))
    assert len(world.decide()) == 1
    world.core.offer(submission(2, "same"))
    world.core.offer(submission(3, "other"))
    batch = world.decide()
    assert [d.cause.seq for d in batch] == [3]
    world.land(0)
    world.read_all()
    world.land(0)
    world.read_all()
    (again,) = [d for d in world.core.next_batch() if d.cause.seq == 2]
    (rejected,) = again.outputs
    assert isinstance(rejected, ev.JobRejected) and "same" in rejected.reason, rejected.reason


def test_nothing_is_decided_beside_an_answer_of_no_key() -> None:
    """A workflow makes several jobs whose intake keys are not known before it is judged: nothing is
    decided beside it."""
    world = World(node("n1", 4))
    workflow = {"workflow": "w", "user": "u", "steps": {"a": {"gpus": 1, "duration_s": 5}}}
    world.core.offer(Submission(source="t", seq=1, data=msgspec.json.encode(workflow), at=1.0))
    (first,) = world.decide()
    assert first.key is None
    world.core.offer(submission(2))
    assert world.decide() == []
    world.land()
    world.read_all()
    assert [d.cause.seq for d in world.decide() if d.external] == [2]


def test_a_submission_naming_a_job_whose_verdict_was_sent_sees_that_job() -> None:
    """A verdict is sent once stored, before it is folded back: a client may name that job at once.
    A submission that depends on other jobs waits for every verdict sent before to be folded."""
    world = World(node("n1", 4))
    world.core.offer(submission(1, "a"))
    (a,) = world.decide()
    job = a.outputs[0].job
    world.land()  # stored and acknowledged: its submitter hears "accepted"
    world.core.offer(submission(2, "b", depends_on={"afterok": [job]}))
    assert world.decide() == []
    world.read_all()
    (b,) = world.decide()
    assert isinstance(b.outputs[0], ev.JobSubmitted), b.outputs[0]


def test_a_serial_core_decides_nothing_until_its_batch_is_folded_back() -> None:
    world = World(node("n1", 4), submit("a", 1), serial=True)
    world.decide()
    world.core.offer(submission(1))
    assert world.decide() == []
    world.land()
    assert world.decide() == []
    world.read_all()
    assert world.decide() != []


def test_a_batch_refused_or_stored_already_ends_its_flight() -> None:
    world = World(node("n1", 4), submit("a", 1))
    world.decide()
    flight, _ = world.flights.pop()
    world.core.landed(flight, [])
    assert world.core.in_flight == 0 and world.core.quiescent()


@given(st.integers(0, 2**32 - 1))
def test_a_log_decided_with_batches_in_flight_is_what_the_audit_decides_again(seed: int) -> None:
    """Inputs arrive, the reader lags, batches are stored in any order and acknowledged before or
    after they are read back: every decision is re-decided by the audit on ``based_on`` as it was
    made, no GPU is handed out twice, and every submission is answered once."""
    rng = random.Random(seed)
    world = World(node("n1", 4), node("n2", 8))
    answered: list[int] = []
    offered = 0
    unacked: list[tuple[Flight, list[int]]] = []

    def ack(n: int) -> None:
        flight, seqs = unacked.pop(n)
        world.core.landed(flight, seqs)

    for _ in range(120):
        action = rng.random()
        if action < 0.15 and offered < 25:
            offered += 1
            intake_id = f"i{rng.randrange(20)}" if rng.random() < 0.5 else None
            world.core.offer(submission(offered, intake_id, gpus=rng.choice([1, 2, 4, 8])))
        elif action < 0.3:
            running = _running_parts(world)
            if running:
                job, attempt, part = rng.choice(running)
                world.store(ended(job, part, attempt, outcome=rng.choice(["completed", "failed"]), exit_code=0))
        elif action < 0.5 and world.core.state.seq < len(world.log):
            world.read()
        elif action < 0.75:
            answered += [d.cause.seq for d in world.decide() if d.external]
        elif action < 0.9 and world.flights:
            flight, outputs = world.flights.pop(rng.randrange(len(world.flights)))
            unacked.append((flight, [world.store(o) for o in outputs]))
        elif unacked:
            ack(rng.randrange(len(unacked)))
    while world.flights or unacked or world.core.state.seq < len(world.log) or world.core.waiting:
        while world.flights:
            flight, outputs = world.flights.pop(0)
            unacked.append((flight, [world.store(o) for o in outputs]))
        while unacked:
            ack(0)
        world.read_all()
        answered += [d.cause.seq for d in world.decide() if d.external]
    assert world.core.quiescent()
    assert sorted(answered) == list(range(1, offered + 1)), "each submission answered once"
    report = audit(world.log, decider)
    assert report.ok, report.mismatches[:3]
    assert violations(world.log) == []


def _running_parts(world: World) -> list[tuple[str, int, str]]:
    state: SchedulerState = world.core.state
    return [
        (job.job, job.attempt, alloc.node)
        for job in state.jobs.values()
        if job.status in ("placed", "running")
        for alloc in job.allocations
        if alloc.node not in job.parts_ended
    ]
