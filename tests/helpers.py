"""Small builders for hand-made histories."""

from __future__ import annotations

import itertools

from gpuherd import events as ev
from gpuherd.log.base import Record

_ids = itertools.count(1)


def node(name: str, gpus: int = 8, *, island: int = 0, rack: str = "r1", at: float = 0.0) -> ev.NodeRegistered:
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
    return ev.NodeRegistered(id=f"reg-{name}-{next(_ids)}", at=at, source="test", node=name, gpus=infos, rack=rack)


def submit(
    job: str, gpus: int = 1, *, nodes: int | None = None, at: float = 0.0, duration: float = 10.0, vc: str = "default"
) -> ev.JobSubmitted:
    spec = ev.JobSpec(name=job, user="u", gpus=gpus, nodes=nodes, duration_s=duration, vc=vc, intake_id=job)
    return ev.JobSubmitted(
        id=f"scheduler:intake:test:{job}", at=at, source="scheduler", job=job, spec=spec, intake_source="test"
    )


def finish(job: str, attempt: int = 0, *, at: float = 0.0, outcome: str = "completed") -> ev.JobFinished:
    return ev.JobFinished(id=f"fin-{job}-{attempt}", at=at, source="test", job=job, attempt=attempt, outcome=outcome)  # type: ignore[arg-type]


def records(*events: ev.Event, start: int = 1) -> list[Record]:
    return [Record(start + i, e) for i, e in enumerate(events)]
