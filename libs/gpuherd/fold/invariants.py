"""Invariants of a cluster history, checked from the log alone.

Used by crash and chaos tests, and usable on any production log:
- no GPU is ever given to two jobs at once;
- every job attempt is placed at most once, and every placement names real, free GPUs;
- a job reaches at most one terminal state, and nothing happens to it after.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gpuherd import events as ev
from gpuherd.fold.core import apply
from gpuherd.fold.state import ACTIVE, TERMINAL, ClusterState
from gpuherd.log import Record


def violations(records: Iterable[Record]) -> list[str]:
    state = ClusterState()
    problems: list[str] = []
    placed: Counter[tuple[str, int]] = Counter()
    terminal: Counter[str] = Counter()
    for record in records:
        event = record.event
        if isinstance(event, ev.JobResized):
            job = state.jobs.get(event.job)
            if job is not None and job.status in ACTIVE and event.generation == job.generation + 1:
                for alloc in event.allocations:
                    node = state.nodes.get(alloc.node)
                    for index in alloc.gpus:
                        holder = node.gpus[index].job if node is not None and index < len(node.gpus) else "?"
                        if holder not in (None, event.job):
                            problems.append(
                                f"seq {record.seq}: {event.job} grew onto {alloc.node}/{index}, held by {holder}"
                            )
        if isinstance(event, ev.JobPlaced):
            job = state.jobs.get(event.job)
            if job is not None and job.status == "pending" and job.attempt == event.attempt:
                placed[(event.job, event.attempt)] += 1
                for alloc in event.allocations:
                    node = state.nodes.get(alloc.node)
                    if node is None:
                        problems.append(f"seq {record.seq}: {event.job} placed on unknown node {alloc.node}")
                        continue
                    if not node.accepts_work():
                        problems.append(
                            f"seq {record.seq}: {event.job} placed on {alloc.node}, which is "
                            f"{node.status} and powered {node.power}"
                        )
                    for index in alloc.gpus:
                        if index >= len(node.gpus):
                            problems.append(f"seq {record.seq}: {event.job} placed on missing GPU {alloc.node}/{index}")
                        elif node.gpus[index].job is not None:
                            problems.append(
                                f"seq {record.seq}: GPU {alloc.node}/{index} double-booked: "
                                f"{node.gpus[index].job} and {event.job}"
                            )
            elif job is not None and job.attempt == event.attempt and job.status != "pending":
                placed[(event.job, event.attempt)] += 1  # a second placement of the same attempt
        if isinstance(event, ev.JobFinished):
            job = state.jobs.get(event.job)
            if job is not None and job.status in TERMINAL:
                if event.attempt == job.attempt:
                    problems.append(
                        f"seq {record.seq}: {event.job} finished twice ({job.status}, then {event.outcome})"
                    )
            elif job is not None and event.attempt == job.attempt:
                terminal[event.job] += 1
        apply(state, record.seq, event)
    active = {j.job for j in state.jobs.values() if j.status in ACTIVE}
    if set(state.active) != active:
        problems.append(
            f"the fold's active-job index drifted: {sorted(set(state.active) ^ active)[:5]} "
            "differ from the jobs placed or running"
        )
    for job_id in active:
        job = state.jobs[job_id]
        holds = sum(len(a.gpus) for a in (*job.allocations, *job.releasing))
        if job.held != holds:
            problems.append(f"job {job_id} counts {job.held} GPUs held but its allocations hold {holds}")
    pending = sorted((j for j in state.jobs.values() if j.status == "pending"), key=lambda j: j.order)
    if state.queue != [j.job for j in pending]:
        problems.append("the fold's queue drifted from the pending jobs")
    for (job, attempt), count in placed.items():
        if count > 1:
            problems.append(f"{job} attempt {attempt} placed {count} times")
    return problems


def unfinished(records: Iterable[Record]) -> list[str]:
    """Jobs of the history that have not reached a terminal state."""
    state = ClusterState()
    for record in records:
        apply(state, record.seq, record.event)
    return sorted(j.job for j in state.jobs.values() if j.status not in TERMINAL)
