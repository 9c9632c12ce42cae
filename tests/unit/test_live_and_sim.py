"""One runtime for live and simulation: the same inputs, fed to the live runner on the in-memory log
(intake through the intake stream) and to the simulator, give the same log, record for record.

The inputs: node registrations, submissions (good, bad, duplicate, several at once), agents'
reports (starts, ends, a failure), a cancel, a drain and a policy change, arriving in bursts so that
coalescing and batching matter. Agents are played by the test: at each step it reports what the
log so far asks of them, which is the same for both runs as long as their logs are the same.
"""

from __future__ import annotations

import asyncio
import itertools

import msgspec

from apps.sim.engine import Simulation
from gpuherd import events as ev
from gpuherd.log import REPLY_HEADER, InProcessLog, Record
from gpuherd.runtime.runner import DeciderRunner
from services.scheduler import service
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission
from tests.helpers import node

SOURCE = "ci"


def spec(name: str, gpus: int, duration: float = 100.0, **more: object) -> bytes:
    return msgspec.json.encode({"name": name, "user": "ana", "gpus": gpus, "duration_s": duration, **more})


# (time, events appended at once, submissions arriving at once)
STEPS: list[tuple[float, list[ev.Event], list[bytes]]] = [
    (0.0, [node("n1", 8, at=0.0), node("n2", 8, at=0.0), node("n3", 4, at=0.0)], []),
    (1.0, [], [spec("a", 8), spec("b", 8, intake_id="b"), spec("c", 4), b"{not json", spec("huge", 64)]),
    (2.0, [], [spec("b again", 8, intake_id="b"), spec("d", 2, 5.0), spec("e", 12, nodes=2)]),
    (
        3.0,
        [ev.PolicyConfigured(id="sjf", at=3.0, source="op", policy="sjf")],
        [spec("f", 1, 1.0, max_retries=1), spec("g", 16)],
    ),
    (4.0, [ev.NodeDrained(id="drain", at=4.0, source="op", node="n3", reason="fix")], []),
    (10.0, [], []),
    (20.0, [ev.JobCancelRequested(id="cancel", at=20.0, source="op", job="PLACEHOLDER")], [spec("h", 4)]),
    (30.0, [ev.NodeUndrained(id="undrain", at=30.0, source="op", node="n3")], []),
    (50.0, [], []),
    (120.0, [], []),
    (250.0, [], []),
]


class Agents:
    """Every node's agent, played from the log: start what is placed, end it once its duration is
    up (the job named ``f`` fails once), stop what is stopping."""

    def __init__(self) -> None:
        self.started: dict[tuple[str, int, str], float] = {}
        self.ended: set[tuple[str, int, str]] = set()
        self.ids = itertools.count()

    def reports(self, records: list[Record], now: float) -> list[ev.Event]:
        jobs: dict[str, ev.JobSubmitted] = {}
        stopping: set[tuple[str, int]] = set()
        out: list[ev.Event] = []
        for record in records:
            e = record.event
            if isinstance(e, ev.JobSubmitted):
                jobs[e.job] = e
            elif isinstance(e, ev.JobPlaced):
                for alloc in e.allocations:
                    key = (e.job, e.attempt, alloc.node)
                    if key not in self.started:
                        self.started[key] = now
                        out.append(self._event(ev.JobStarted, now, job=e.job, attempt=e.attempt, node=alloc.node))
            elif isinstance(e, ev.JobPreempted | ev.JobCancelRequested):
                stopping.add((e.job, getattr(e, "attempt", -1)))
        for (job, attempt, node_name), since in sorted(self.started.items()):
            key = (job, attempt, node_name)
            if key in self.ended:
                continue
            duration = jobs[job].spec.duration_s or 0.0
            failing = jobs[job].spec.name == "f" and attempt == 0
            if (job, attempt) in stopping or (job, -1) in stopping:
                outcome = "stopped"
            elif now - since >= duration:
                outcome = "failed" if failing else "completed"
            else:
                continue
            self.ended.add(key)
            out.append(self._event(ev.TaskEnded, now, job=job, attempt=attempt, node=node_name, outcome=outcome))
        return out

    def _event(self, kind: type[ev.Event], at: float, **fields: object) -> ev.Event:
        return kind(id=f"agent:{next(self.ids)}", at=at, source=f"agent.{fields['node']}", **fields)  # type: ignore[call-arg]


def _cancel_target(records: list[Record]) -> str:
    """The job the cancel goes to: ``c`` (its id is known only once it was submitted)."""
    return next(r.event.job for r in records if isinstance(r.event, ev.JobSubmitted) and r.event.spec.name == "c")


def _inputs(step: tuple, records: list[Record]) -> list[ev.Event]:
    events = step[1]
    return [
        msgspec.structs.replace(e, job=_cancel_target(records)) if isinstance(e, ev.JobCancelRequested) else e
        for e in events
    ]


def simulated(fence: ev.Event | None = None) -> list[ev.Event]:
    """``fence``: the live runner's ``LeadershipTaken``, first in its log (a simulation has one
    leader and fences nothing): given as the first input, so the sequences line up."""
    sim = Simulation([SchedulerDecider()], agents=False)
    agents = Agents()
    seq = itertools.count(1)
    for n, step in enumerate(STEPS):
        at, _, payloads = step
        records = list(sim.records)
        events = (
            ([fence] if fence is not None and n == 0 else []) + _inputs(step, records) + agents.reports(records, at)
        )
        subs = [Submission(source=SOURCE, seq=next(seq), data=p, at=at, msg_id=None) for p in payloads]
        sim.step(at, events, subs)
    return [r.event for r in sim.records]


async def live() -> list[ev.Event]:
    now = 0.0
    log = InProcessLog(clock=lambda: now, duplicate_window=0)
    runner = DeciderRunner(log, SchedulerDecider(), instance="live")
    service.setup(runner, ack_wait_s=3600)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    agents = Agents()
    inbox = itertools.count()
    try:
        await _until(lambda: runner.caught_up.is_set())
        for step in STEPS:
            now, _, payloads = step
            records = list(log.records)
            events = _inputs(step, records) + agents.reports(records, now)
            if events:
                await log.append(events)
            for payload in payloads:
                await log.publish_intake(SOURCE, payload, {REPLY_HEADER: f"inbox.{next(inbox)}"})
            answered = len(log.replies) + len(payloads)
            await _until(lambda answered=answered: len(log.replies) == answered)
            await _until(lambda: runner.core.quiescent() and runner.state.seq == len(log.records))
            await asyncio.sleep(0.05)  # (anything still to come would come now)
            await _until(lambda: runner.core.quiescent() and runner.state.seq == len(log.records))
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    return [r.event for r in log.records]


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not reached"
        await asyncio.sleep(0.005)


async def test_the_same_inputs_give_the_same_log_live_and_in_simulation() -> None:
    got = await live()
    assert isinstance(got[0], ev.LeadershipTaken), "the live runner fences its leadership first"
    expected = simulated(fence=got[0])
    kinds = {type(e).__name__ for e in expected}
    assert {"JobSubmitted", "JobRejected", "JobPlaced", "JobFinished", "JobRequeued"} <= kinds, kinds
    assert len({e.based_on for e in expected if isinstance(e, ev.JobSubmitted)}) < len(
        [e for e in expected if isinstance(e, ev.JobSubmitted)]
    ), "several submissions were decided together"
    for n, (a, b) in enumerate(zip(got, expected, strict=False), 1):
        assert a == b, f"record {n} differs:\n live: {a}\n  sim: {b}"
    assert len(got) == len(expected)
