"""Audit: re-run a decider at every decision it recorded and report what it would not decide again.

For each batch of decisions (all caused by one event), the audit folds the
log up to the batch's ``based_on``, runs ``decide`` on the cause, stamps the
result exactly as the runner does, and compares. Any difference, or an event
that claims the decider as source but is none of its decisions, is a
mismatch. An untampered log has none.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.decider import Decider, cause_seq_of, decide_stamped
from gpuherd.log.base import Record

# Events a service's shell (not its decider) writes: checked by kind, not by re-running decide.
_SHELL_EVENTS: dict[str, tuple[type[ev.Event], ...]] = {
    "intake": (ev.JobSubmitted,),
    "rejected": (ev.JobRejected,),
    "tick": (ev.ClockTicked,),  # the service's timer: an observation, decided on like any input
    "policy": (ev.PolicyConfigured,),  # the scheduler's --policy at start, recorded as an input
    "config": (ev.ElasticConfigured, ev.MemoryBrokerConfigured),  # a service's --params at start, as an input
    "lost": (ev.NodeLost,),  # written by the shell before node loss became a decision (older logs)
}
_DECISION_ID = re.compile(r"^[^:]+:\d+:\d+$")


class Mismatch(msgspec.Struct, frozen=True):
    seq: int
    event_id: str
    kind: str  # "differs" | "missing" | "unexpected" | "unattributable"
    detail: str


class AuditReport(msgspec.Struct):
    decider: str
    events: int = 0
    batches_checked: int = 0
    decisions_checked: int = 0
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
    for record in records:
        event = record.event
        if event.source != decider.name:
            continue
        cause = cause_seq_of(event, decider.name)
        if cause is not None and _DECISION_ID.match(event.id):
            batches[cause].append(record)
            continue
        kind = event.id.split(":")[1] if event.id.count(":") >= 2 else ""
        if not isinstance(event, _SHELL_EVENTS.get(kind, ())):
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
            expected = decide_stamped(decider, state, trigger)
            _compare(report, batches[cause], expected)
        if progress is not None and i % 1000 == 0:
            progress(i)
    # Decisions whose based_on never appeared in the log (forged provenance).
    seen = {r.seq for r in records}
    for based_on, causes in checkpoints.items():
        if based_on not in seen:
            for cause in causes:
                for r in batches[cause]:
                    report.mismatches.append(
                        Mismatch(r.seq, r.event.id, "unattributable", f"based_on {based_on} is not in the log")
                    )
    report.mismatches.sort(key=lambda m: m.seq)
    return report


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
