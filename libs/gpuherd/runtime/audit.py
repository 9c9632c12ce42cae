"""Audit: re-run a decider at every decision it recorded and report what it would not decide again.

For each batch of decisions (all caused by one event), the audit folds the log up to the batch's
``based_on``, runs ``decide`` on the cause (on ``Decider.audit_state`` of that state), stamps the
result exactly as the runtime does, and compares. Answers to inputs from outside the log (intake
verdicts) are re-judged on the state at their ``based_on`` by the decider's ``recheck``. Any
difference, or an event that claims the decider as source but is none of its decisions, is a
mismatch. An untampered log has none.

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


def audit(
    records: Sequence[Record], decider: Decider[Any], progress: Callable[[int], None] | None = None
) -> AuditReport:
    report = AuditReport(decider=decider.name, events=len(records))
    by_seq = {r.seq: r for r in records}
    batches: dict[int, list[Record]] = defaultdict(list)  # cause seq -> recorded decisions
    answers: dict[int, list[Record]] = defaultdict(list)  # based_on -> recorded answers to outside inputs
    fence = 0  # the sequence of the service's latest LeadershipTaken so far
    for record in records:
        event = record.event
        if isinstance(event, ev.LeadershipTaken) and event.service == decider.name:
            fence = record.seq
        if event.source != decider.name:
            continue
        if isinstance(event, ev.Decision) and event.based_on < fence:
            report.mismatches.append(
                Mismatch(
                    record.seq,
                    event.id,
                    "stale",
                    f"decided on the log up to {event.based_on}, stored after a newer leader took over at {fence}",
                )
            )
        cause = cause_seq_of(event, decider.name)
        if cause is not None and _DECISION_ID.match(event.id):
            batches[cause].append(record)
            continue
        kind = event.id.split(":")[1] if event.id.count(":") >= 2 else ""
        if isinstance(event, ev.Decision) and decider.answers(event):
            answers[event.based_on].append(record)
        elif not isinstance(event, _RECORDED_INPUTS.get(kind, ())):
            report.mismatches.append(
                Mismatch(
                    record.seq, event.id, "unattributable", f"not a decision {decider.name} makes: {_brief(event)}"
                )
            )
    checkpoints: dict[int, list[int]] = defaultdict(list)  # based_on -> cause seqs
    for cause, recorded in batches.items():
        first = recorded[0].event
        checkpoints[getattr(first, "based_on", 0)].append(cause)

    state = decider.initial_state()
    for at in answers.get(0, ()):  # answered before anything was folded
        _recheck(report, decider, state, at)
    for i, record in enumerate(records):
        state = decider.evolve(state, record.seq, record.event)
        for cause in checkpoints.get(record.seq, ()):
            recorded = [r.event for r in batches[cause]]
            trigger = by_seq.get(cause)
            report.batches_checked += 1
            report.decisions_checked += len(recorded)
            if trigger is None:
                for r in batches[cause]:
                    report.mismatches.append(Mismatch(r.seq, r.event.id, "unattributable", f"cause {cause} not in log"))
                continue
            _compare(report, batches[cause], decide_stamped(decider, decider.audit_state(state, recorded), trigger))
        for answer in answers.get(record.seq, ()):
            _recheck(report, decider, state, answer)
        if progress is not None and i % 1000 == 0:
            progress(i)
    # Decisions whose based_on never appeared in the log (forged provenance).
    seen = {r.seq for r in records} | {0}
    for based_on, causes in checkpoints.items():
        if based_on not in seen or based_on == 0:  # (a decision folds its cause first: never based on nothing)
            for cause in causes:
                for r in batches[cause]:
                    report.mismatches.append(
                        Mismatch(r.seq, r.event.id, "unattributable", f"based_on {based_on} is not in the log")
                    )
    for based_on, recorded_answers in answers.items():
        if based_on not in seen:
            for r in recorded_answers:
                report.mismatches.append(
                    Mismatch(r.seq, r.event.id, "unattributable", f"based_on {based_on} is not in the log")
                )
    report.mismatches.sort(key=lambda m: m.seq)
    return report


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
