"""Small builders for hand-made histories, and a scheduler run on a log for the tests of its shell."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from gpuherd import events as ev
from gpuherd.log import EventLog, Record

_ids = itertools.count(1)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (polling every 10 ms) until ``predicate()`` holds; fail the test after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def node(
    name: str,
    gpus: int = 8,
    *,
    island: int = 0,
    rack: str = "r1",
    at: float = 0.0,
    executor: str = "sim",
    ports: tuple[int, int] | None = None,
) -> ev.NodeRegistered:
    size = island or gpus
    infos = tuple(
        ev.GpuInfo(
            index=i,
            uuid=f"{name}-{i}",
            model="SIM",
            memory_mb=81920,
            nvlink_peers=tuple(j for j in range((i // size) * size, (i // size + 1) * size) if j != i and j < gpus),
        )
        for i in range(gpus)
    )
    return ev.NodeRegistered(
        id=f"reg-{name}-{next(_ids)}",
        at=at,
        source="test",
        node=name,
        gpus=infos,
        rack=rack,
        executor=executor,
        address=f"{name}.local" if ports else "",
        port_range=ports,
    )


def submit(
    job: str,
    gpus: int = 1,
    *,
    nodes: int | None = None,
    at: float = 0.0,
    duration: float | None = 10.0,
    vc: str = "default",
    command: tuple[str, ...] | None = None,
    max_retries: int = 0,
) -> ev.JobSubmitted:
    spec = ev.JobSpec(
        name=job,
        user="u",
        gpus=gpus,
        nodes=nodes,
        duration_s=duration,
        vc=vc,
        intake_id=job,
        command=command,
        max_retries=max_retries,
    )
    return ev.JobSubmitted(id=f"test:intake:{job}", at=at, source="test", job=job, spec=spec, intake_source="test")


def placed(
    job: str, *allocs: tuple[str, tuple[int, ...]], attempt: int = 0, at: float = 1.0, reason: str = ""
) -> ev.JobPlaced:
    return ev.JobPlaced(
        id=f"p-{job}-{attempt}",
        at=at,
        source="scheduler",
        job=job,
        attempt=attempt,
        allocations=tuple(ev.Allocation(n, g) for n, g in allocs),
        reason=reason,
    )


def finish(job: str, attempt: int = 0, *, at: float = 0.0, outcome: str = "completed") -> ev.JobFinished:
    return ev.JobFinished(id=f"fin-{job}-{attempt}", at=at, source="test", job=job, attempt=attempt, outcome=outcome)  # type: ignore[arg-type]


def ended(
    job: str,
    node_name: str,
    attempt: int = 0,
    *,
    outcome: str = "completed",
    exit_code: int | None = 0,
    at: float = 0.0,
) -> ev.TaskEnded:
    return ev.TaskEnded(
        id=f"ended-{job}-{node_name}-{attempt}",
        at=at,
        source=f"agent.{node_name}",
        job=job,
        attempt=attempt,
        node=node_name,
        outcome=outcome,  # type: ignore[arg-type]
        exit_code=exit_code,
        reason="" if outcome == "completed" else f"local rank 0 exited with code {exit_code}",
        output_tail="Traceback: boom" if outcome == "failed" else "",
    )


def tick(at: float, lost_after: float = 10.0, **last_heard: float) -> ev.ClockTicked:
    return ev.ClockTicked(
        id=f"scheduler:tick:{next(_ids)}", at=at, source="scheduler", last_heard=last_heard, lost_after_s=lost_after
    )


def records(*events: ev.Event, start: int = 1) -> list[Record]:
    return [Record(start + i, e) for i, e in enumerate(events)]


@contextlib.asynccontextmanager
async def running_scheduler(
    log: EventLog, instance: str = "test", *, stop_within_s: float = 10.0, **setup: Any
) -> AsyncIterator[Any]:
    """The scheduler's runner with its intake (``service.setup(runner, **setup)``) on ``log``, running
    until the block ends. (Imported here: the builders above are used where no service is.)"""
    from gpuherd.runtime.runner import DeciderRunner
    from services.scheduler import service
    from services.scheduler.decide import SchedulerDecider

    runner = DeciderRunner(log, SchedulerDecider(), instance=instance)
    service.setup(runner, **setup)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield runner
    finally:
        stop.set()
        await asyncio.wait_for(task, stop_within_s)
