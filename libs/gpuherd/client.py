"""Python client for other systems: submit jobs as events and get a clear verdict back.

A submission is published to ``herd.intake.<source>`` (stored by the
HERD_INTAKE stream, so it survives a scheduler restart) with a reply inbox
in a header; the scheduler answers with ``{"ok": true, "job_id": ...}`` or
``{"ok": false, "error": ...}``. Every submission carries an ``intake_id``
(one is generated if the spec has none), so retrying after a timeout never
creates a second job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from gpuherd import events as ev
from gpuherd.errors import SubmissionError
from gpuherd.log.base import INTAKE_PREFIX, REPLY_HEADER
from gpuherd.obs import current_traceparent, tracer


class Verdict(msgspec.Struct, frozen=True):
    ok: bool
    job_id: str | None = None
    duplicate: bool = False
    error: str | None = None


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a job spec from JSON or YAML."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else msgspec.json.decode(text)
    except (yaml.YAMLError, msgspec.DecodeError) as exc:
        kind = "YAML" if str(path).endswith((".yaml", ".yml")) else "JSON"
        raise SubmissionError(f"{path}: not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise SubmissionError(f"{path}: a job spec is a mapping of fields, got {type(data).__name__}")
    return data


class Client:
    """Talks to a running gpuherd over NATS."""

    def __init__(self, nc: Any, source: str = "cli") -> None:
        self.nc = nc
        self.source = source

    @classmethod
    async def connect(cls, url: str, *, source: str = "cli", persistent: bool = False) -> Client:
        """``persistent``: keep reconnecting through NATS outages (long-lived submitters)."""
        from gpuherd.log.jetstream import connect

        options = {} if persistent else {"max_reconnect_attempts": 3}
        try:
            nc = await connect(url, name=f"client-{source}", **options)
        except Exception as exc:
            raise SubmissionError(f"cannot reach NATS at {url}: {exc!r}") from None
        return cls(nc, source)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()

    async def submit(self, spec: Mapping[str, Any], *, timeout: float = 30.0, attempt_timeout: float = 3.0) -> str:
        """Submit one job; returns its job id or raises SubmissionError with the scheduler's reason."""
        spec = dict(spec)
        spec.setdefault("intake_id", uuid.uuid4().hex)
        verdict = await self.submit_raw(msgspec.json.encode(spec), timeout=timeout, attempt_timeout=attempt_timeout)
        if not verdict.ok:
            raise SubmissionError(verdict.error or "rejected without a reason")
        assert verdict.job_id is not None
        return verdict.job_id

    async def submit_raw(self, data: bytes, *, timeout: float = 30.0, attempt_timeout: float = 3.0) -> Verdict:
        """Publish raw bytes as a submission and wait for the verdict (retrying the same bytes)."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=1)
        deadline = time.monotonic() + timeout
        try:
            with tracer().start_as_current_span("client.submit", attributes={"source": self.source}):
                headers = {REPLY_HEADER: inbox}
                trace = current_traceparent()
                if trace:
                    headers["traceparent"] = trace
                while True:
                    await self.nc.publish(f"{INTAKE_PREFIX}.{self.source}", data, headers=headers)
                    await self.nc.flush()
                    try:
                        msg = await sub.next_msg(timeout=min(attempt_timeout, max(0.1, deadline - time.monotonic())))
                        return msgspec.json.decode(msg.data, type=Verdict)
                    except asyncio.TimeoutError:  # noqa: UP041 - nats-py raises its own subclass
                        if time.monotonic() >= deadline:
                            raise SubmissionError(
                                f"no verdict within {timeout:.0f}s: is the scheduler running? The submission is "
                                "stored and will be judged when it runs; resubmitting the same intake_id is safe"
                            ) from None
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def cancel(self, job_id: str, reason: str = "") -> None:
        """Ask for a job to be cancelled (recorded as JobCancelRequested)."""
        from gpuherd.log.jetstream import JetStreamLog

        log_ = JetStreamLog(self.nc)
        await log_.ensure_streams()
        if await log_.subject_last_seq(f"herd.job.{job_id}") == 0:
            raise SubmissionError(f"no job {job_id!r}: see `gpuherd jobs` for the ids")
        event = ev.JobCancelRequested(
            id=f"cancel:{job_id}:{uuid.uuid4().hex[:8]}", at=time.time(), source=self.source, job=job_id, reason=reason
        )
        await log_.append([event])
