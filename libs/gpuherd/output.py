"""A job's output: each node it ran on keeps its ranks' logs and answers ``herd.ctl.<node>.logs``.
``gpuherd logs`` and the dashboard's job page ask the same way."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from gpuherd.errors import LogUnavailable
from gpuherd.log.interfaces import Requests


async def fetch_output(
    requests: Requests, job: str, placements: Iterable[tuple[int, Iterable[str]]], *, max_bytes: int = 65536
) -> list[dict[str, Any]]:
    """For each (attempt, nodes) the job was placed on: every node's answer, with ``node`` and
    ``attempt`` added; an agent that cannot be reached answers ``ok: False`` with why."""
    answers = []
    for attempt, nodes in placements:
        for node in nodes:
            request = {"job": job, "attempt": attempt, "max_bytes": max_bytes}
            try:
                raw = await requests.request(f"{node}.logs", msgspec.json.encode(request), timeout=5)
                answer = msgspec.json.decode(raw)
            except LogUnavailable as exc:
                answer = {"ok": False, "error": f"{exc}; its files are under the agent's data folder"}
            answers.append({"node": node, "attempt": attempt, **answer})
    return answers
