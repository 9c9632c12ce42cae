"""A discrete-event simulation of a gpuherd cluster: the live deciders on a virtual clock.

Nothing here decides anything. The engine

* keeps a virtual clock and a heap of what happens next (a trace job is
  submitted, a simulated task ends, the clock ticks, a node finishes booting);
* appends those happenings to an in-memory log (``MemoryLog``), stamped with
  the virtual time;
* feeds every record of the log, in order, to each decider it was given, the
  way ``DeciderRunner`` does live: fold, then decide, and decide nothing more
  until the decider's own outputs are folded; outputs get the same
  deterministic ids and provenance (``decide_stamped``), so the simulated log
  can be replayed and audited like a live one;
* plays the node agents with ``sim`` executors (``SimAgents``): a placed part
  starts at once, ends after its job's duration, stops when preempted or
  cancelled, and a node drains and powers down or boots when asked to.

The deciders are the production classes (the CLI passes the scheduler's and
the analytics service's), so a simulation exercises exactly the code that
runs live: there is no second copy of any policy.

Work carried across preemption: a sim job checkpoints when it is preempted
(live agents send SIGUSR1 and wait its grace), so its next attempt runs only
what is left of its duration. Jobs are deterministic: the same inputs give
the same log, record for record.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.decider import Decider, decide_stamped
from gpuherd.errors import GpuherdError
from gpuherd.log.base import Record
from gpuherd.log.memory import MemoryLog


class SimulationError(GpuherdError):
    """The simulation cannot go on (a decider failed, or it cannot finish)."""


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """A run keeps every record and job state it makes: millions of long-lived objects and no
    reference cycles. CPython's default thresholds collect every 700 allocations and keep
    rescanning them (a third of the run time on philly.csv), so a run collects every 100,000
    instead; the thresholds are put back after it."""
    before = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*before)


class _Runner:
    """One decider against the log, with ``DeciderRunner``'s ordering rule."""

    def __init__(self, decider: Decider[Any], log: MemoryLog) -> None:
        self.decider = decider
        self.log = log
        self.state = decider.initial_state()
        self.pending: collections.deque[Record] = collections.deque()
        self.wait_until = 0
        self.decisions = 0

    def feed(self, record: Record) -> None:
        self.state = self.decider.evolve(self.state, record.seq, record.event)
        self.pending.append(record)
        while self.pending and self.state.seq >= self.wait_until:
            cause = self.pending.popleft()
            outputs = decide_stamped(self.decider, self.state, cause)
            if outputs:
                result = self.log.append_now(outputs)
                self.decisions += len(outputs)
                if result.seqs:
                    self.wait_until = max(result.seqs)


@dataclass
class _Part:
    started_at: float
    nodes: tuple[str, ...]


@dataclass
class SimAgents:
    """The node agents of a simulated cluster, all ``sim`` executors.

    It follows the log as live agents do (only the events agents act on) and
    returns what they would append, plus timers for what happens later."""

    boot_s: float = 300.0  # a powered-down node's time from power-up request to serving again
    durations: dict[str, float] = field(default_factory=dict)  # job -> trace duration
    attained: dict[str, float] = field(default_factory=dict)  # job -> seconds run by ended attempts
    running: dict[tuple[str, int], _Part] = field(default_factory=dict)
    node_jobs: dict[str, set[str]] = field(default_factory=dict)  # node -> jobs with a part there
    power: dict[str, str] = field(default_factory=dict)  # node -> "up" | "draining" | "off" | "booting"
    open_jobs: int = 0  # submitted and not finished

    def _event_id(self, node: str, *parts: object) -> str:
        return ":".join(("agent", node, *map(str, parts)))

    def observe(self, event: ev.Event, now: float) -> tuple[list[ev.Event], list[tuple[float, str, tuple]]]:
        """(events to append now, timers (at, kind, payload)) caused by ``event``."""
        out: list[ev.Event] = []
        timers: list[tuple[float, str, tuple]] = []
        if isinstance(event, ev.JobSubmitted):
            self.open_jobs += 1
            self.durations[event.job] = event.spec.duration_s or 0.0
        elif isinstance(event, ev.JobFinished):
            self.open_jobs -= 1
            self.durations.pop(event.job, None)
            self.attained.pop(event.job, None)
        elif isinstance(event, ev.JobPlaced):
            nodes = tuple(a.node for a in event.allocations)
            self.running[(event.job, event.attempt)] = _Part(started_at=now, nodes=nodes)
            left = max(0.0, self.durations.get(event.job, 0.0) - self.attained.get(event.job, 0.0))
            for node in nodes:
                self.node_jobs.setdefault(node, set()).add(event.job)
                out.append(
                    ev.JobStarted(
                        id=self._event_id(node, "start", event.job, event.attempt),
                        at=now,
                        source=f"agent:{node}",
                        job=event.job,
                        attempt=event.attempt,
                        node=node,
                    )
                )
                timers.append((now + left, "task-end", (event.job, event.attempt, node)))
        elif isinstance(event, ev.JobPreempted | ev.JobCancelRequested):
            attempt = getattr(event, "attempt", None)
            out += self._stop(event.job, attempt, now, reason=getattr(event, "reason", "") or "stopped")
        elif isinstance(event, ev.JobRequeued):
            self.running.pop((event.job, event.attempt), None)
        elif isinstance(event, ev.NodePowerDownRequested):
            if self.power.get(event.node, "up") == "up":
                self.power[event.node] = "draining"
                out += self._maybe_off(event.node, now)
        elif isinstance(event, ev.NodePowerUpRequested):
            state = self.power.get(event.node, "up")
            if state == "draining":  # never went down: serve again at once
                self.power[event.node] = "up"
                out.append(self._powered(event.node, now, up=True, cause=event.id))
            elif state == "off":
                self.power[event.node] = "booting"
                timers.append((now + self.boot_s, "booted", (event.node, event.id)))
        return out, timers

    def _stop(self, job: str, attempt: int | None, now: float, *, reason: str) -> list[ev.Event]:
        keys = [k for k in self.running if k[0] == job and (attempt is None or k[1] == attempt)]
        out: list[ev.Event] = []
        for key in keys:
            part = self.running.pop(key)
            self.attained[job] = self.attained.get(job, 0.0) + (now - part.started_at)  # checkpointed
            for node in part.nodes:
                out += self._part_ended(key, node, now, outcome="stopped", reason=reason)
        return out

    def _part_ended(self, key: tuple[str, int], node: str, now: float, *, outcome: str, reason: str = "") -> list:
        job, attempt = key
        jobs = self.node_jobs.get(node)
        if jobs is not None:
            jobs.discard(job)
        ended = ev.TaskEnded(
            id=self._event_id(node, "end", job, attempt),
            at=now,
            source=f"agent:{node}",
            job=job,
            attempt=attempt,
            node=node,
            outcome=outcome,  # type: ignore[arg-type]
            exit_code=0 if outcome == "completed" else None,
            reason=reason,
        )
        return [ended, *self._maybe_off(node, now)]

    def _maybe_off(self, node: str, now: float) -> list[ev.Event]:
        if self.power.get(node) == "draining" and not self.node_jobs.get(node):
            self.power[node] = "off"
            return [self._powered(node, now, up=False, cause="")]
        return []

    def _powered(self, node: str, now: float, *, up: bool, cause: str) -> ev.Event:
        kind = "up" if up else "down"
        return (ev.NodePoweredUp if up else ev.NodePoweredDown)(
            id=self._event_id(node, f"power-{kind}", f"{now:.3f}"),
            at=now,
            source=f"agent:{node}",
            node=node,
            cause=cause,
        )

    def fire(self, kind: str, payload: tuple, now: float) -> list[ev.Event]:
        """What a timer's moment brings."""
        if kind == "task-end":
            job, attempt, node = payload
            part = self.running.get((job, attempt))
            if part is None or node not in part.nodes:
                return []  # stopped before it could end
            out = self._part_ended((job, attempt), node, now, outcome="completed")
            if all(job not in self.node_jobs.get(n, ()) for n in part.nodes):
                self.running.pop((job, attempt), None)
            return out
        if kind == "booted":
            node, _cause = payload
            if self.power.get(node) != "booting":
                return []
            self.power[node] = "up"
            return [self._powered(node, now, up=True, cause=_cause)]
        raise SimulationError(f"unknown timer {kind!r}")


class Simulation:
    """A cluster on a virtual clock: setup events, then trace submissions, until every job ends."""

    def __init__(
        self,
        deciders: Sequence[Decider[Any]],
        *,
        tick_s: float | None = 300.0,
        boot_s: float = 300.0,
        admit: Callable[[ev.JobSubmitted], str | None] | None = None,
    ) -> None:
        self.now = 0.0
        self.log = MemoryLog(clock=lambda: self.now, duplicate_window=0.0)
        self.runners = [_Runner(d, self.log) for d in deciders]
        self.agents = SimAgents(boot_s=boot_s)
        self.tick_s = tick_s
        self.admit = admit
        self._heap: list[tuple[float, int, str, Any]] = []
        self._order = itertools.count()
        self._fed = 0  # records handed to agents and deciders so far
        self._more_jobs = False
        self.submitted = 0
        self.rejected = 0

    # -- the loop --------------------------------------------------------------------------------

    def _push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, payload))

    def _append(self, events: Iterable[ev.Event]) -> None:
        batch = list(events)
        if batch:
            self.log.append_now(batch)

    def _drain(self) -> None:
        """Hand every new record to the agents and the deciders, until nothing new is appended."""
        records = self.log.records
        while self._fed < len(records):
            record = records[self._fed]
            self._fed += 1
            out, timers = self.agents.observe(record.event, self.now)
            for at, kind, payload in timers:
                self._push(at, kind, payload)
            self._append(out)
            for runner in self.runners:
                try:
                    runner.feed(record)
                except Exception as exc:
                    raise SimulationError(
                        f"decider {runner.decider.name} failed on record {record.seq} "
                        f"({type(record.event).__name__} at t={record.event.at:.0f}): {exc!r}"
                    ) from exc

    def setup(self, events: Iterable[ev.Event], *, at: float = 0.0) -> None:
        """Cluster set-up before the workload: nodes, VCs, the policy. Events get ``at`` and ids."""
        self.now = at
        stamped = []
        for n, event in enumerate(events):
            fields: dict[str, Any] = {"at": at}
            if not event.id:
                fields["id"] = f"sim:setup:{n}"
            if not event.source:
                fields["source"] = "sim"
            stamped.append(msgspec.structs.replace(event, **fields))
        self._append(stamped)
        self._drain()

    def run(
        self,
        submissions: Iterable[ev.JobSubmitted],
        *,
        on_submit: Callable[[int], None] | None = None,
        until: float | None = None,
    ) -> None:
        """Submit each job at its ``at`` and run until every job has ended (or ``until``)."""
        with _few_collections():
            self._run(iter(submissions), on_submit, until)

    def _run(
        self, jobs: Iterator[ev.JobSubmitted], on_submit: Callable[[int], None] | None, until: float | None
    ) -> None:
        self._next_submission(jobs)
        if self.tick_s:
            self._push(self.now + self.tick_s, "tick", None)
        while self._heap:
            at, _, kind, payload = heapq.heappop(self._heap)
            if until is not None and at > until:
                break
            self.now = max(self.now, at)
            if kind == "submit":
                self._submit(payload)
                self._next_submission(jobs)
                if on_submit is not None:
                    on_submit(1)
            elif kind == "tick":
                if not self._busy():
                    continue  # nothing left to happen: stop ticking
                self._append([self._tick()])
                self._push(self.now + self.tick_s, "tick", None)
            else:
                self._append(self.agents.fire(kind, payload, self.now))
            self._drain()
        if until is None and self.agents.open_jobs:
            raise SimulationError(
                f"{self.agents.open_jobs} jobs never finished: nothing left to happen while they wait "
                "(jobs no node of the cluster can run; check the cluster spec and admission)"
            )

    def _busy(self) -> bool:
        return self.agents.open_jobs > 0 or self._more_jobs

    def _next_submission(self, jobs: Iterator[ev.JobSubmitted]) -> None:
        job = next(jobs, None)
        self._more_jobs = job is not None
        if job is not None:
            self._push(max(job.at, self.now), "submit", job)

    def _submit(self, job: ev.JobSubmitted) -> None:
        self.submitted += 1
        why = self.admit(job) if self.admit is not None else None
        if why is None:
            self._append([msgspec.structs.replace(job, at=self.now)])
            return
        self.rejected += 1
        self._append(
            [
                ev.JobRejected(
                    id=f"{job.id}:rejected",
                    at=self.now,
                    source=job.source,
                    intake_source=job.intake_source,
                    intake_seq=job.intake_seq,
                    intake_id=job.spec.intake_id,
                    reason=why,
                )
            ]
        )

    def _tick(self) -> ev.ClockTicked:
        return ev.ClockTicked(
            id=f"sim:tick:{self.now:.0f}",
            at=self.now,
            source="sim",
            last_heard={},
            lost_after_s=ev.TICK_ONLY_TIMEOUT_S,
        )

    # -- results ---------------------------------------------------------------------------------

    @property
    def records(self) -> Sequence[Record]:
        return self.log.records

    def state_of(self, name: str) -> Any:
        for runner in self.runners:
            if runner.decider.name == name:
                return runner.state
        raise KeyError(f"no decider named {name!r} in this simulation")
