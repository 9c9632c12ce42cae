"""The nemesis' checker: judges a run from the outside, as Jepsen's checkers do.

Its evidence: the client's records (every acknowledged submission), the jobs' own run records
(each process wrote when it started and, every 50 ms, that it still ran: monotonic time, which no
clock skew touches, on which GPU of which node), and the log read after every fault healed.

- ``lost``: acknowledged, but never in the log, or never reaching a terminal state;
- ``duplicated``: one intake id accepted as two jobs;
- ``double_booked``: one GPU running processes of two jobs at one instant (run records), or
  given to two jobs at once by the log (``violations``);
- ``overlapping_attempts``: two attempts of one job running at one instant (run records);
- ``audit_mismatches``: decisions the scheduler would not make again on the state they claim,
  or stored after a newer leader's fence (``gpuherd replay --audit``'s audit).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuherd import events as ev
from gpuherd.fold.invariants import unfinished, violations
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider


@dataclass(frozen=True)
class Run:
    """One process of a job attempt, as it recorded itself."""

    job: str
    attempt: int
    node: str
    gpus: tuple[int, ...]
    start: float
    last: float  # its last sign of life (monotonic)

    def overlaps(self, other: Run) -> bool:
        return self.start < other.last and other.start < self.last


def read_acks(path: Path) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The client's records: intake id -> job id of each acknowledgement, and everything else."""
    acks: dict[str, str] = {}
    other: list[dict[str, Any]] = []
    if not path.exists():
        return acks, other
    for line in path.read_text().splitlines():
        with_ack = json.loads(line) if line.strip() else {}
        if "job" in with_ack:
            acks[with_ack["intake"]] = with_ack["job"]
        elif with_ack and "done" not in with_ack:
            other.append(with_ack)
    return acks, other


def read_runs(runs_dir: Path) -> list[Run]:
    runs = []
    for path in sorted(runs_dir.iterdir()) if runs_dir.exists() else []:
        job, attempt, node, _pid = path.name.split(".")
        lines = path.read_text().splitlines()
        if not lines or not lines[0].startswith("start "):
            continue
        first = lines[0].split()
        gpus = tuple(int(g) for g in first[2].split(",") if g) if len(first) > 2 else ()
        last = float(first[1])
        for line in reversed(lines):
            parts = line.split()
            if len(parts) >= 2:
                try:
                    last = float(parts[1])
                    break
                except ValueError:
                    continue
        runs.append(Run(job, int(attempt), node, gpus, float(first[1]), last))
    return runs


def overlapping_attempts(runs: list[Run]) -> list[str]:
    by_job: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_job[run.job].append(run)
    out = []
    for job, mine in by_job.items():
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if a.attempt != b.attempt and a.overlaps(b):
                    out.append(
                        f"{job}: attempt {a.attempt} on {a.node} and attempt {b.attempt} on {b.node} ran at once"
                    )
    return out


def double_booked(runs: list[Run]) -> list[str]:
    by_gpu: dict[tuple[str, int], list[Run]] = defaultdict(list)
    for run in runs:
        for gpu in run.gpus:
            by_gpu[(run.node, gpu)].append(run)
    out = []
    for (node, gpu), mine in by_gpu.items():
        mine.sort(key=lambda r: r.start)
        for i, a in enumerate(mine):
            for b in mine[i + 1 :]:
                if b.start >= a.last:
                    break
                if a.job != b.job and a.overlaps(b):
                    out.append(f"{node} GPU {gpu}: {a.job} and {b.job} ran at once")
    return out


def recovery(records: list[Record], healed: float) -> float | None:
    """From a fault's heal to the first placement the log stored after it (None: none came)."""
    for record in records:
        if isinstance(record.event, ev.JobPlaced) and record.stored_at is not None and record.stored_at >= healed:
            return record.stored_at - healed
    return None


def judge(acks_path: Path, runs_dir: Path, records: list[Record]) -> dict[str, Any]:
    acks, other = read_acks(acks_path)
    submitted: dict[str, list[str]] = defaultdict(list)  # intake id -> job ids accepted for it
    in_log: set[str] = set()
    finished: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    for record in records:
        event = record.event
        if isinstance(event, ev.JobSubmitted):
            in_log.add(event.job)
            if event.spec.intake_id:
                submitted[event.spec.intake_id].append(event.job)
        elif isinstance(event, ev.JobFinished):
            finished[event.job] += 1
            outcomes[event.outcome] += 1
    open_jobs = set(unfinished(records))
    missing = sorted(job for job in acks.values() if job not in in_log)
    never_ended = sorted(job for job in acks.values() if job in in_log and job in open_jobs)
    duplicated = sorted(intake for intake, jobs in submitted.items() if len(set(jobs)) > 1)
    duplicated += sorted(i for i, job in acks.items() if submitted.get(i) and job not in submitted[i])
    runs = read_runs(runs_dir)
    booked = double_booked(runs) + [f"log: {v}" for v in violations(records)]
    overlaps = overlapping_attempts(runs)
    report = audit(records, SchedulerDecider())
    return {
        "acknowledged": len(acks),
        "not_acknowledged": len(other),
        "lost": len(missing) + len(never_ended),
        "lost_jobs": {"not_in_log": missing[:20], "never_ended": never_ended[:20]},
        "duplicated": len(duplicated),
        "duplicated_intakes": duplicated[:20],
        "double_booked": len(booked),
        "double_bookings": booked[:20],
        "overlapping_attempts": len(overlaps),
        "overlaps": overlaps[:20],
        "finished_twice": sum(1 for n in finished.values() if n > 1),
        "audit_mismatches": len(report.mismatches),
        "audit": [f"{m.seq} {m.kind}: {m.detail[:200]}" for m in report.mismatches[:10]],
        "decisions_audited": report.decisions_checked,
        "outcomes": dict(outcomes),
        "processes": len(runs),
        "events": len(records),
    }
