"""Python client for other systems: submit jobs as events and get a clear verdict back.

A submission is published to ``herd.intake.<source>`` (stored by the
HERD_INTAKE stream, so it survives a scheduler restart) with a reply inbox
in a header; the scheduler answers with ``{"ok": true, "job_id": ...}`` or
``{"ok": false, "error": ...}``. Every submission carries an ``intake_id``
(one is generated if the spec has none), so retrying after a timeout never
creates a second job.

The intake stream does not acknowledge what it stores (``no_ack``: a plain NATS request must get
the scheduler's verdict as its reply, not the stream's receipt), so only a verdict proves a
submission was stored. Without one the client says so, and never claims the submission is stored.

Submissions started together (in one turn of the event loop) are published as one JetStream atomic
batch: one disk sync for all of them, each still its own message with its own verdict
(``INTAKE_BATCH_MAX``; ``docs/intake.md`` says how any client may do the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import yaml

from gpuherd import events as ev
from gpuherd.errors import UNDECODABLE, LogUnavailable, SubmissionError
from gpuherd.fold import fold, vc_problem
from gpuherd.log import HERD_INTAKE, INTAKE_PREFIX, REPLY_HEADER
from gpuherd.obs import call_span, get_logger
from gpuherd.security import check_token

log = get_logger("gpuherd.client")

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Unanswered this long, a submission that names its intake id is stored again under a new message
# id: a verdict whose reply was lost (a NATS server failing over between the scheduler and the
# client) is never sent twice, and every retry of the first message id is dropped as a copy. The
# scheduler answers the new copy as a duplicate, with the same job id. Far above a busy
# scheduler's verdict time, so the copies do not add to its load.
RESEND_AFTER_S = 10.0
# The status a NATS server answers a publish's reply subject with when nothing takes its subject.
_NO_RESPONDERS = "503"
# First copies of submissions started in one turn of the event loop are stored as one atomic batch
# of at most this many (the server takes up to 1,000): one disk sync for all of them, where each
# alone costs one. Retries go alone: the stream refuses a whole batch that repeats a stored message id.
INTAKE_BATCH_MAX = 256
BATCH_PAUSE_S = 60.0  # no batches for this long after one went unanswered (see ``_batch_not_answered``)


class _Outgoing(NamedTuple):
    subject: str
    data: bytes
    inbox: str
    headers: dict[str, str]
    published: asyncio.Future[bool]  # done once published: whether in a batch


class _IntakeIdOnly(msgspec.Struct):
    intake_id: str | None = None


_intake_id_of = msgspec.json.Decoder(_IntakeIdOnly)


def _names_its_intake_id(data: bytes) -> bool:
    try:
        return bool(_intake_id_of.decode(data).intake_id)
    except UNDECODABLE:
        return False


class Verdict(msgspec.Struct, frozen=True):
    """The scheduler's answer to a submission. For an array or a workflow, ``job_id`` is the array's
    or the workflow's id and ``job_ids`` lists every job it made (``steps``: by step name)."""

    ok: bool
    job_id: str | None = None
    duplicate: bool = False
    error: str | None = None
    job_ids: list[str] | None = None
    array: str | None = None
    workflow: str | None = None
    steps: dict[str, list[str]] | None = None


_VERDICT = msgspec.json.Decoder(Verdict)


# An operator's reason is recorded in the log, read by every reader and shown on every page: a few
# lines, not a document (one near NATS's max_payload would fail the append after the checks passed).
MAX_REASON_CHARS = 2048


def _checked_reason(reason: str) -> str:
    if len(reason) > MAX_REASON_CHARS:
        raise SubmissionError(
            f"a reason is at most {MAX_REASON_CHARS} characters (it goes in the log); got {len(reason)}"
        )
    return reason


def _checked_job_id(job_id: str) -> str:
    """A job id goes into a subject (``herd.job.<id>``): a '*' or '>' there is a wildcard that
    matches every job's subject, and a '.' names another subject."""
    try:
        return check_token("job", job_id)
    except ValueError as exc:
        raise SubmissionError(f"{exc} (a job's id, as `gpuherd jobs` lists it)") from None


def _undrain_problem(node: str, records: list[Any]) -> str | None:
    """Why undraining ``node`` would change nothing (None: it would). An undrain lets a drained node
    take work again and puts its unhealthy GPUs back in service; of a node with neither, "undrained"
    was said and a NodeUndrained recorded for nothing."""
    state = fold((r.seq, r.event) for r in records)
    found = state.nodes.get(node)
    if found is None or found.status == "drained" or any(not g.healthy for g in found.gpus):
        return None
    return (
        f"node {node} is not drained (it is {found.status}) and its GPUs are all in service: nothing to undrain"
        " (see `gpuherd nodes`)"
    )


def load_data_file(path: str | Path) -> Any:
    """Read JSON, or YAML when the name ends in .yaml/.yml."""
    try:
        raw = Path(path).read_bytes()
    except IsADirectoryError:
        raise SubmissionError(f"{path}: is a folder, not a file: give the path of a JSON or YAML file") from None
    except FileNotFoundError:
        where = "" if Path(path).is_absolute() else f" (looked in {Path.cwd()})"
        raise SubmissionError(f"{path}: no such file{where}: check the path") from None
    except OSError as exc:
        raise SubmissionError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
        return yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else msgspec.json.decode(text)
    except (yaml.YAMLError, *UNDECODABLE) as exc:
        kind = "YAML" if str(path).endswith((".yaml", ".yml")) else "JSON"
        raise SubmissionError(f"{path}: not valid {kind}: {exc}") from None


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a job spec from JSON or YAML."""
    data = load_data_file(path)
    if not isinstance(data, dict):
        raise SubmissionError(f"{path}: a job spec is a mapping of fields, got {type(data).__name__}")
    _check_finite(data, where=f"{path}: ")
    return data


def _non_finite_field(value: Any, path: str = "") -> tuple[str, float] | None:
    """The path (``steps[0].time_limit_s``) and value of the first number in ``value`` that is not
    finite, if any."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, Mapping):
        items: Any = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for where, item in items:
        if (found := _non_finite_field(item, where)) is not None:
            return found
    return None


def _check_finite(spec: Mapping[str, Any], *, where: str = "") -> None:
    """JSON has no inf or NaN: msgspec writes them as ``null``, which intake reads as a field left out
    (a YAML ``time_limit_s: .inf`` got the VC's default limit), so refuse them here, by name."""
    found = _non_finite_field(spec)
    if found is not None:
        field, number = found
        raise SubmissionError(
            f"{where}`{field}` is {number}: a submission's numbers must be finite (JSON cannot carry {number})"
        )


class Client:
    """Talks to a running gpuherd over NATS."""

    def __init__(self, nc: Any, source: str = "cli") -> None:
        self.nc = nc
        self.source = source
        # One subscription answers every submission (a wildcard inbox, futures by subject),
        # rather than a subscribe/unsubscribe pair per submission.
        self._reply_prefix = nc.new_inbox()
        self._replies: dict[str, asyncio.Future[Verdict]] = {}
        # Per waiting inbox: how many of its publishes the server said nothing took (none stored them).
        self._unrouted: dict[str, int] = {}
        # Per waiting inbox: what else answered there, that was no verdict (JetStream refusing a
        # copy while its stream has no leader, say): said when no verdict comes.
        self._not_verdicts: dict[str, str] = {}
        self._reply_sub: Any = None
        # Subscribing may wait (a connection whose write buffer is full): submissions started
        # meanwhile must wait for that one subscription, not make another (every reply handled twice).
        self._subscribing = asyncio.Lock()
        # First copies of submissions are published together, as one atomic batch, where several
        # start in one turn of the event loop (``INTAKE_BATCH_MAX``); paused after one went unanswered.
        # False: each alone (a caller's choice, e.g. a NATS server older than atomic batches).
        self.batching = True
        self._alone_until = 0.0  # (monotonic) each submission alone until then
        self._outbox: list[_Outgoing] = []  # first copies waiting for this turn's batch
        self._flushing: set[asyncio.Task[None]] = set()

    async def _reply_inbox(self) -> tuple[str, asyncio.Future[Verdict]]:
        if self._reply_sub is None:
            async with self._subscribing:
                if self._reply_sub is None:
                    self._reply_sub = await self.nc.subscribe(f"{self._reply_prefix}.*", cb=self._on_reply)
        inbox = f"{self._reply_prefix}.{uuid.uuid4().hex}"
        self._replies[inbox] = asyncio.get_running_loop().create_future()
        return inbox, self._replies[inbox]

    async def _on_reply(self, msg: Any) -> None:
        waiting = self._replies.get(msg.subject)
        if waiting is None or waiting.done():
            return
        if (msg.headers or {}).get("Status") == _NO_RESPONDERS:
            # The server's answer to a publish of the submission (its reply subject is this inbox):
            # nothing took the subject, so no stream stored that copy and no scheduler saw it.
            self._unrouted[msg.subject] = self._unrouted.get(msg.subject, 0) + 1
            return
        try:
            waiting.set_result(_VERDICT.decode(msg.data))
        except UNDECODABLE:
            # Not the scheduler's: JetStream may answer a publish there too (an error while the
            # stream elects a leader, an acknowledgement). The attempts go on; the verdict is awaited.
            self._not_verdicts[msg.subject] = msg.data[:300].decode(errors="replace")

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

    async def submit(
        self,
        spec: Mapping[str, Any],
        *,
        timeout: float = 30.0,
        attempt_timeout: float = 3.0,
        resend_after_s: float = RESEND_AFTER_S,
    ) -> str:
        """Submit one job (or an array, or a workflow); returns its id (the array's, the workflow's)
        or raises SubmissionError with the scheduler's reason."""
        verdict = await self.submit_verdict(
            spec, timeout=timeout, attempt_timeout=attempt_timeout, resend_after_s=resend_after_s
        )
        assert verdict.job_id is not None
        return verdict.job_id

    async def submit_verdict(
        self,
        spec: Mapping[str, Any],
        *,
        timeout: float = 30.0,
        attempt_timeout: float = 3.0,
        resend_after_s: float = RESEND_AFTER_S,
    ) -> Verdict:
        """Submit a job spec, an array or a workflow (``{"workflow": name, "steps": [...]}``); the
        accepted verdict (with every job's id), or SubmissionError with the scheduler's reason."""
        _check_finite(spec)
        spec = dict(spec)
        spec.setdefault("intake_id", uuid.uuid4().hex)
        verdict = await self.submit_raw(
            msgspec.json.encode(spec), timeout=timeout, attempt_timeout=attempt_timeout, resend_after_s=resend_after_s
        )
        if not verdict.ok:
            raise SubmissionError(verdict.error or "rejected without a reason")
        return verdict

    async def submit_raw(
        self,
        data: bytes,
        *,
        timeout: float = 30.0,
        attempt_timeout: float = 3.0,
        resend_after_s: float = RESEND_AFTER_S,
    ) -> Verdict:
        """Publish raw bytes as a submission and wait for the verdict (retrying the same bytes).

        The attempts carry one message id: the intake stream keeps the first and drops the
        retries (a busy scheduler is not handed the same submission again and again), and a spec
        without an ``intake_id`` gets that id, so a retry never makes a second job. A spec that
        names its ``intake_id`` gets a new message id every ``resend_after_s`` without a verdict
        (``RESEND_AFTER_S``): its reply may have been lost, and only a new copy brings another.

        Without a verdict by ``timeout``: SubmissionError("not stored: ...") when the server said of
        every attempt that nothing took it (each attempt's reply subject is the verdict's inbox, where
        the server says so at once; the stream, which does not acknowledge, never answers there), else
        SubmissionError("no verdict ...") saying storage is not confirmed. Attempts go on to the end:
        a client started with gpuherd may publish before the scheduler has created the stream."""
        inbox, reply = await self._reply_inbox()
        deadline = time.monotonic() + timeout
        may_resend = _names_its_intake_id(data)
        stamped = time.monotonic()
        published = 0
        in_batch = False
        subject = f"{INTAKE_PREFIX}.{self.source}"
        try:
            with call_span("client.submit", source=self.source) as trace:
                headers = {REPLY_HEADER: inbox, "Nats-Msg-Id": uuid.uuid4().hex}
                if trace:
                    headers["traceparent"] = trace
                while True:
                    if may_resend and time.monotonic() - stamped >= resend_after_s:
                        headers["Nats-Msg-Id"], stamped = uuid.uuid4().hex, time.monotonic()
                    if published:
                        await self.nc.publish(subject, data, reply=inbox, headers=headers)
                    else:
                        in_batch = await self._publish_first(subject, data, inbox, dict(headers))
                    published += 1
                    try:
                        wait = min(attempt_timeout, max(0.1, deadline - time.monotonic()))
                        return await asyncio.wait_for(asyncio.shield(reply), wait)
                    except TimeoutError:
                        if in_batch and published == 1:
                            self._batch_not_answered()
                        if time.monotonic() >= deadline:
                            raise SubmissionError(self._no_verdict(timeout, published, inbox)) from None
        finally:
            self._replies.pop(inbox, None)
            self._unrouted.pop(inbox, None)
            self._not_verdicts.pop(inbox, None)

    async def _publish_first(self, subject: str, data: bytes, inbox: str, headers: dict[str, str]) -> bool:
        """Publish a submission's first copy with the others started in this turn of the event loop:
        alone, or with them as one atomic batch (``INTAKE_BATCH_MAX`` at most). True if it went in a
        batch. (A stream that refuses the batch says nothing, as it says nothing of what it stores:
        each of them is then stored by its retry, which goes alone.)"""
        if not self.batching or time.monotonic() < self._alone_until:
            await self.nc.publish(subject, data, reply=inbox, headers=headers)
            return False
        loop = asyncio.get_running_loop()
        outgoing = _Outgoing(subject, data, inbox, headers, loop.create_future())
        self._outbox.append(outgoing)
        if len(self._outbox) == 1:
            loop.call_soon(self._start_flush)
        return await outgoing.published

    def _start_flush(self) -> None:
        task = asyncio.ensure_future(self._flush_outbox())
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _flush_outbox(self) -> None:
        outbox, self._outbox = self._outbox, []
        for start in range(0, len(outbox), INTAKE_BATCH_MAX):
            batch = outbox[start : start + INTAKE_BATCH_MAX]
            batched = len(batch) > 1
            if batched:
                batch_id = uuid.uuid4().hex
                for n, out in enumerate(batch, start=1):
                    out.headers["Nats-Batch-Id"] = batch_id
                    out.headers["Nats-Batch-Sequence"] = str(n)
                batch[-1].headers["Nats-Batch-Commit"] = "1"
            try:
                for out in batch:
                    await self.nc.publish(out.subject, out.data, reply=out.inbox, headers=out.headers)
            except Exception as exc:  # (the connection closed: each submitter hears it, as from its own publish)
                for out in batch:
                    if not out.published.done():
                        out.published.set_exception(exc)
                continue
            for out in batch:
                if not out.published.done():
                    out.published.set_result(batched)

    def _batch_not_answered(self) -> None:
        """A submission sent in a batch got no verdict in time: the stream may not take batches (an
        intake stream set up before them, not updated yet), which it refuses without a word, or the
        scheduler is slow or away. This client sends each submission alone for ``BATCH_PAUSE_S``
        (what it did before batches), then tries batches again."""
        now = time.monotonic()
        if now >= self._alone_until:
            log.warning(
                "a submission sent in an atomic batch got no verdict in time; sending each alone for a while "
                "(the intake stream may lack allow_atomic: the scheduler or `gpuherd log init` sets it)",
                source=self.source,
                pause_s=BATCH_PAUSE_S,
            )
        self._alone_until = now + BATCH_PAUSE_S

    def _no_verdict(self, timeout: float, published: int, inbox: str) -> str:
        if self._unrouted.get(inbox, 0) >= published:
            return (
                f"not stored: nothing took any of the {published} publishes of this submission to "
                f"{INTAKE_PREFIX}.{self.source} within {timeout:.0f}s: the intake stream {HERD_INTAKE} does not "
                "exist (is gpuherd set up? the scheduler creates it, or `gpuherd log init`) or this NATS server "
                "cannot reach the servers that hold it"
            )
        answered = self._not_verdicts.get(inbox)
        also = f" (the last answer that was no verdict: {answered})" if answered else ""
        return (
            f"no verdict within {timeout:.0f}s{also}: is the scheduler running? Storage is not confirmed "
            f"({HERD_INTAKE} does not acknowledge; only a verdict proves it was stored, and a stored submission "
            "is judged once the scheduler runs): resubmitting the same intake_id is safe, it makes one job at most"
        )

    async def _log(self) -> Any:
        """The log on this client's connection, with the deployment's settings: under
        ``GPUHERD_STREAMS=require`` (a user without the right to manage streams) it only checks that
        the streams exist, and says at once what is missing."""
        from gpuherd.log import settings_from_env
        from gpuherd.log.jetstream import JetStreamLog

        log_ = JetStreamLog(self.nc, settings_from_env())
        if log_.settings.streams == "require":
            await log_.require_streams(timeout=0.0)
        else:
            await log_.ensure_streams()
        return log_

    async def cancel(self, job_id: str, reason: str = "") -> None:
        """Ask for a job to be cancelled (recorded as JobCancelRequested)."""
        _checked_job_id(job_id)
        _checked_reason(reason)
        log_ = await self._log()
        if not await self._job_known(log_, job_id):
            raise SubmissionError(f"no job {job_id!r}: see `gpuherd jobs` for the ids")
        await log_.append([ev.JobCancelRequested(**self._stamp("cancel"), job=job_id, reason=reason)])

    async def job_status(self, job_id: str, *, timeout: float = 2.0) -> dict[str, Any]:
        """The job as the leading scheduler knows it (``herd.ctl.scheduler.job``): ``status``
        (``pending``, ``placed``, ``running``, then its outcome), ``attempt``, ``nodes``, ``reason``
        and its times; ``known`` false when the scheduler does not know it (not submitted, or ended
        and forgotten). Raises LogUnavailable when no scheduler answers within ``timeout``."""
        from gpuherd.log.jetstream import JetStreamLog

        _checked_job_id(job_id)
        # A plain request, no stream needed: a submitter (``submit-<source>``) may ask it, not read the log.
        log_ = JetStreamLog(self.nc)
        try:
            answer = msgspec.json.decode(await log_.request("scheduler.job", job_id.encode(), timeout=timeout))
        except msgspec.DecodeError as exc:
            raise LogUnavailable(f"the scheduler's answer about {job_id} was not JSON ({exc})") from None
        if not isinstance(answer, dict):
            raise LogUnavailable(f"the scheduler's answer about {job_id} was not an object: {answer!r}")
        return answer

    async def job_exists(self, job_id: str) -> bool:
        """Whether the log holds a job of this id (an array's or a workflow's id is no job)."""
        try:
            check_token("job", job_id)
        except ValueError:
            return False  # no job's id (and as a subject, a wildcard would match every job's)
        return await self._job_known(await self._log(), job_id)

    @staticmethod
    async def _job_known(log_: Any, job_id: str) -> bool:
        """A job's events may be stored in a page on another job's subject (``gpuherd.log.pages``),
        which the server's subject index does not see: ask the leading scheduler, which knows every
        job it has not forgotten yet, before reading the log for it."""
        subject = f"herd.job.{job_id}"
        if await log_.subject_last_seq(subject) > 0:
            return True
        with contextlib.suppress(LogUnavailable, msgspec.DecodeError):
            answer = msgspec.json.decode(await log_.request("scheduler.job", job_id.encode(), timeout=2.0))
            if isinstance(answer, dict) and answer.get("known"):
                return True
        return bool(await log_.subject_seen(subject))

    async def cancel_jobs(self, job_ids: list[str], reason: str = "") -> None:
        """Ask for several jobs to be cancelled at once (an array's, a workflow's unfinished jobs):
        one JobCancelRequested each, appended together (all of them or none)."""
        for job in job_ids:
            _checked_job_id(job)
        _checked_reason(reason)
        log_ = await self._log()
        events = [ev.JobCancelRequested(**self._stamp("cancel"), job=job, reason=reason) for job in job_ids]
        for start in range(0, len(events), log_.max_batch):
            await log_.append(events[start : start + log_.max_batch])

    async def request_profile(self, job_id: str, steps: int = 5) -> str:
        """Ask a running job to profile ``steps`` of its training steps; the request's event id
        (its ``ProfileReported`` names it)."""
        if steps < 1:
            raise SubmissionError(f"a profile needs at least one step, got {steps}")
        _checked_job_id(job_id)
        log_ = await self._log()
        if not await self._job_known(log_, job_id):
            raise SubmissionError(f"no job {job_id!r}: see `gpuherd jobs` for the ids")
        request = ev.ProfileRequested(**self._stamp("profile"), job=job_id, steps=steps)
        await log_.append([request])
        return request.id

    async def configure_vc(
        self,
        vc: str,
        *,
        gpu_quota: int | None,
        can_borrow: bool = True,
        weight: float = 1.0,
        default_time_limit_s: float | None = None,
        max_time_limit_s: float | None = None,
        max_gpus_per_user: int | None = None,
        max_running_per_user: int | None = None,
    ) -> None:
        """Create or change a virtual cluster (recorded as VcConfigured: the whole configuration from
        now on). The scheduler checks it as it applies it; checking here first answers at once."""
        if not _TOKEN.match(vc):
            raise SubmissionError(f"VC names are 1-64 letters, digits, '_' or '-'; got {vc!r}")
        if gpu_quota is not None and gpu_quota < 0:
            raise SubmissionError(f"a GPU quota cannot be negative, got {gpu_quota}")
        event = ev.VcConfigured(
            **self._stamp("vc"),
            vc=vc,
            gpu_quota=gpu_quota,
            can_borrow=can_borrow,
            weight=weight,
            default_time_limit_s=default_time_limit_s,
            max_time_limit_s=max_time_limit_s,
            max_gpus_per_user=max_gpus_per_user,
            max_running_per_user=max_running_per_user,
        )
        problem = vc_problem(event)
        if problem is not None:
            raise SubmissionError(problem)
        await (await self._log()).append([event])

    async def configure_policy(
        self, policy: str, *, backfill: bool = True, params: Mapping[str, float] | None = None
    ) -> None:
        """Switch the cluster's scheduling policy (recorded as PolicyConfigured); the scheduler checks
        names and parameters when it applies it, and records a refusal (``CommandRefused``) for one it
        cannot apply; the CLI checks first to answer at once."""
        event = ev.PolicyConfigured(
            **self._stamp("policy"), policy=policy, backfill=backfill, params=dict(params or {})
        )
        await (await self._log()).append([event])

    async def configure_elastic(self, params: Mapping[str, float]) -> None:
        """The elastic service's parameters from now on (recorded as ElasticConfigured); the service
        checks them as it applies them and refuses (``CommandRefused``) what it cannot apply."""
        event = ev.ElasticConfigured(**self._stamp("elastic"), params=dict(params))
        await (await self._log()).append([event])

    async def drain(self, node: str, reason: str = "", *, undrain: bool = False) -> None:
        """Stop (or resume) placing new work on a node; running jobs stay."""
        try:
            check_token("node", node)  # (a wildcard such as '*' would match every node's subject)
        except ValueError as exc:
            raise SubmissionError(str(exc)) from None
        _checked_reason(reason)
        log_ = await self._log()
        if not await log_.subject_seen(f"herd.node.{node}"):
            raise SubmissionError(f"no node {node!r}: see `gpuherd nodes` for the names")
        if undrain:
            problem = _undrain_problem(node, await log_.read_all())
            if problem is not None:
                raise SubmissionError(problem)
            await log_.append([ev.NodeUndrained(**self._stamp("undrain"), node=node)])
        else:
            await log_.append([ev.NodeDrained(**self._stamp("drain"), node=node, reason=reason)])

    def _stamp(self, kind: str) -> dict[str, Any]:
        return {"id": f"{kind}:{self.source}:{uuid.uuid4().hex}", "at": time.time(), "source": self.source}
