"""Audit: re-run a decider at every decision it recorded and report what it would not decide again.

For each batch of decisions (all caused by one event), the audit folds the log up to the batch's
``based_on``, runs ``decide`` on the cause (on ``Decider.audit_state`` of that state), stamps the
result exactly as the runtime does, and compares. Answers to inputs from outside the log (intake
verdicts) are re-judged on the state at their ``based_on`` by the decider's ``recheck``. Any
difference, or an event that claims the decider as source but is none of its decisions, is a
mismatch. An untampered log has none. The log is read twice, a record at a time (``Audit``): a
year's log need not fit in memory, only the decider's own decisions.

Fencing is checked too: a decision stored after a ``LeadershipTaken`` of its service but made on a
state from before it (``based_on`` earlier) came from a former leader that lost the lead: a
``stale`` mismatch. The runtime's fence keeps such appends out of the log.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.decider import Decider, cause_seq_of, decide_stamped

# Events a service's shell writes, by the kind in their id (``<service>:<kind>:...``): inputs it
# recorded (its timer, its start-up parameters), decided on like any other event but not decisions.
_RECORDED_INPUTS: dict[str, tuple[type[ev.Event], ...]] = {
    "tick": (ev.Tick,),
    "policy": (ev.PolicyConfigured,),  # the scheduler's --policy at start
    "config": (ev.ElasticConfigured, ev.MemoryBrokerConfigured),  # a service's --params at start
    "leader": (ev.LeadershipTaken,),  # an instance took the lead (its fence)
    "rules": (ev.ElasticConfigured, ev.MemoryBrokerConfigured),  # the rules a service runs by, when they changed
}
_DECISION_ID = re.compile(r"^[^:]+:\d+:\d+$")


class Mismatch(msgspec.Struct, frozen=True):
    seq: int
    event_id: str
    kind: str  # "differs" | "missing" | "unexpected" | "unattributable" | "answer" | "stale"
    detail: str


class AuditReport(msgspec.Struct):
    decider: str
    events: int = 0
    batches_checked: int = 0
    decisions_checked: int = 0
    answers_checked: int = 0
    mismatches: list[Mismatch] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _brief(event: ev.Event) -> str:
    data = msgspec.to_builtins(event)
    for key in ("id", "at", "source", "v", "based_on", "cause"):
        data.pop(key, None)
    return msgspec.json.encode(data).decode()


class Audit:
    """One audit, in two reads of the log, a record at a time (the log itself is never held): the
    first (``see``) takes the decider's own decisions and answers, the second (``fold``) folds the
    log and re-decides each batch once the state reaches its ``based_on``. What it holds is the
    decider's recorded decisions, and of the rest of the log only the causes it still has to
    re-decide. ``report`` once both reads are done."""

    def __init__(self, decider: Decider[Any]) -> None:
        self.decider = decider
        self.report = AuditReport(decider=decider.name)
        self._batches: dict[int, list[Record]] = defaultdict(list)  # cause seq -> recorded decisions
        self._answers: dict[int, list[Record]] = defaultdict(list)  # based_on -> recorded answers to outside inputs
        self._fence = 0  # the sequence of the service's latest LeadershipTaken so far
        self._checkpoints: dict[int, list[int]] = {}  # based_on -> cause seqs (made by the first read's end)
        self._causes: dict[int, Record | None] = {}  # cause seq -> its record, once the second read met it
        self._state: Any = None
        self._reached: set[int] = {0}  # the based_on positions the second read met

    def see(self, record: Record) -> None:
        """The first read: the decider's decisions, by the event that caused them."""
        report, decider, event = self.report, self.decider, record.event
        report.events += 1
        if isinstance(event, ev.LeadershipTaken) and event.service == decider.name:
            self._fence = record.seq
        if event.source != decider.name:
            return
        if isinstance(event, ev.Decision) and event.based_on < self._fence:
            report.mismatches.append(
                Mismatch(
                    record.seq,
                    event.id,
                    "stale",
                    f"decided on the log up to {event.based_on}, "
                    f"stored after a newer leader took over at {self._fence}",
                )
            )
        cause = cause_seq_of(event, decider.name)
        if cause is not None and _DECISION_ID.match(event.id):
            self._batches[cause].append(record)
            return
        kind = event.id.split(":")[1] if event.id.count(":") >= 2 else ""
        if isinstance(event, ev.Decision) and decider.answers(event):
            self._answers[event.based_on].append(record)
        elif not isinstance(event, _RECORDED_INPUTS.get(kind, ())):
            report.mismatches.append(
                Mismatch(
                    record.seq, event.id, "unattributable", f"not a decision {decider.name} makes: {_brief(event)}"
                )
            )

    def _start_folding(self) -> None:
        checkpoints: dict[int, list[int]] = defaultdict(list)
        for cause, recorded in self._batches.items():
            checkpoints[getattr(recorded[0].event, "based_on", 0)].append(cause)
        self._checkpoints = checkpoints
        self._causes = dict.fromkeys(self._batches)
        self._state = self.decider.initial_state()
        for answer in self._answers.get(0, ()):  # answered before anything was folded
            _recheck(self.report, self.decider, self._state, answer)

    def fold(self, record: Record) -> None:
        """The second read: the log folded, each batch re-decided on the state of its ``based_on``."""
        if self._state is None:
            self._start_folding()
        decider, report, seq = self.decider, self.report, record.seq
        state = self._state = decider.evolve(self._state, seq, record.event)
        if seq in self._causes:
            self._causes[seq] = record
        causes = self._checkpoints.get(seq)
        answers = self._answers.get(seq)
        if causes is None and answers is None:
            return
        self._reached.add(seq)
        for cause in causes or ():
            batch = self._batches[cause]
            trigger = self._causes.pop(cause, None)
            report.batches_checked += 1
            report.decisions_checked += len(batch)
            if trigger is None:  # (not in the log, or after the state the batch says it was decided on)
                why = f"cause {cause} is not in the log up to its based_on {seq}"
                report.mismatches.extend(Mismatch(r.seq, r.event.id, "unattributable", why) for r in batch)
                continue
            recorded = [r.event for r in batch]
            _compare(report, batch, decide_stamped(decider, decider.audit_state(state, recorded), trigger))
        for answer in answers or ():
            _recheck(report, decider, state, answer)

    def finish(self) -> AuditReport:
        """The report, once both reads are done: with the decisions based on a position the log
        does not hold (forged provenance)."""
        if self._state is None:
            self._start_folding()
        report = self.report
        for based_on, causes in self._checkpoints.items():
            if (
                based_on not in self._reached or based_on == 0
            ):  # (a decision folds its cause first: never based on nothing)
                for cause in causes:
                    for r in self._batches[cause]:
                        report.mismatches.append(
                            Mismatch(r.seq, r.event.id, "unattributable", f"based_on {based_on} is not in the log")
                        )
        for based_on, recorded_answers in self._answers.items():
            if based_on not in self._reached:
                for r in recorded_answers:
                    report.mismatches.append(
                        Mismatch(r.seq, r.event.id, "unattributable", f"based_on {based_on} is not in the log")
                    )
        report.mismatches.sort(key=lambda m: m.seq)
        return report


def audit(
    records: Sequence[Record], decider: Decider[Any], progress: Callable[[int], None] | None = None
) -> AuditReport:
    """``Audit`` of records in hand (``progress`` is told the records folded so far)."""
    check = Audit(decider)
    for record in records:
        check.see(record)
    for i, record in enumerate(records):
        check.fold(record)
        if progress is not None and i % 1000 == 0:
            progress(i)
    return check.finish()


def _recheck(report: AuditReport, decider: Decider[Any], state: Any, record: Record) -> None:
    report.answers_checked += 1
    problem = decider.recheck(state, record.event)
    if problem is not None:
        report.mismatches.append(Mismatch(record.seq, record.event.id, "answer", problem))


def _compare(report: AuditReport, recorded: list[Record], expected: list[ev.Event]) -> None:
    expected_by_id = {e.id: e for e in expected}
    for r in recorded:
        again = expected_by_id.pop(r.event.id, None)
        if again is None:
            report.mismatches.append(
                Mismatch(r.seq, r.event.id, "unexpected", f"would not be decided again: {_brief(r.event)}")
            )
        elif again != r.event:
            report.mismatches.append(
                Mismatch(r.seq, r.event.id, "differs", f"recorded {_brief(r.event)}; would decide {_brief(again)}")
            )
    for missing in expected_by_id.values():
        seq = recorded[0].seq if recorded else 0
        report.mismatches.append(Mismatch(seq, missing.id, "missing", f"would also decide {_brief(missing)}"))
