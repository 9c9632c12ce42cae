"""Intake: turn a raw submission into JobSubmitted, or JobRejected with a reason a person can act on.

``judge`` is pure: it reads the submission and the scheduler's state, nothing else. The scheduler
decides submissions in the log's order like any other input (``SchedulerDecider.take``), so a
verdict's ``based_on`` is exactly the state it was judged on, and the audit re-judges it there
(``recheck``) by the rules it was judged by (``intake_rules``; see ``events.INTAKE_RULES``).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgspec

from gpuherd import events as ev
from gpuherd import jobenv
from services.scheduler.placement import can_run
from services.scheduler.state import SchedulerState, intake_key

MAX_SUBMISSION_BYTES = 64 * 1024
_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:@/+=-]{1,128}$")
_SOURCE_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_spec_decoder = msgspec.json.Decoder(ev.JobSpec)
EXCERPT_BYTES = 256
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class Verdict(msgspec.Struct, frozen=True):
    event: ev.JobSubmitted | ev.JobRejected
    job_id: str | None = None
    duplicate: bool = False  # the same intake id was submitted before: same job, nothing new

    def events(self) -> list[ev.Event]:
        """What to append: nothing for a duplicate (the log holds its job already)."""
        return [] if self.duplicate else [self.event]

    def reply(self) -> bytes:
        if isinstance(self.event, ev.JobRejected):
            return msgspec.json.encode({"ok": False, "error": self.event.reason})
        return msgspec.json.encode({"ok": True, "job_id": self.job_id, "duplicate": self.duplicate})


def job_id_for(source: str, intake_id: str) -> str:
    return "j" + ev.stable_id(source, intake_id, length=11)


def _excerpt(data: bytes) -> str:
    return data[:EXCERPT_BYTES].decode("utf-8", errors="replace")


class Sizes(NamedTuple):
    """The registered nodes of one kind: how many, their GPUs in all, the largest node's GPUs."""

    nodes: int = 0
    gpus: int = 0
    largest: int = 0

    def plus(self, other: Sizes) -> Sizes:
        return Sizes(self.nodes + other.nodes, self.gpus + other.gpus, max(self.largest, other.largest))


NodeSizes = dict[bool, Sizes]  # runs processes? -> the registered nodes of that kind


def node_sizes(state: SchedulerState) -> NodeSizes:
    """What intake checks a spec against; compute it once for a batch of submissions."""
    sizes: NodeSizes = {False: Sizes(), True: Sizes()}
    for node in state.nodes.values():
        kind = node.runs_processes()
        sizes[kind] = sizes[kind].plus(Sizes(1, len(node.gpus), len(node.gpus)))
    return sizes


def _memory_problem(memory: ev.MemoryNeeds) -> str | None:
    if memory.extra_mb <= 0:
        return f"`memory.extra_mb` must be positive (MiB per worker beyond its GPU), got {memory.extra_mb}"
    if not 0 <= memory.min_mb <= memory.extra_mb:
        return f"`memory.min_mb` must lie within 0..extra_mb ({memory.extra_mb}), got {memory.min_mb}"
    if not memory.tiers or len(set(memory.tiers)) != len(memory.tiers):
        return f"`memory.tiers` must name each accepted tier once, of {', '.join(ev.MEMORY_TIERS)}"
    return None


def _spec_problem(
    spec: ev.JobSpec, state: SchedulerState, by_kind: NodeSizes | None = None, rules: int = ev.INTAKE_RULES
) -> str | None:
    if not spec.name.strip():
        return "`name` must not be empty"
    if len(spec.name) > 256 or len(spec.user) > 256:
        return "`name` and `user` are limited to 256 characters"
    if not spec.user.strip():
        return "`user` must not be empty"
    if spec.gpus <= 0:
        return f"`gpus` must be at least 1, got {spec.gpus}"
    if spec.command is None and spec.duration_s is None:
        return "give `command` (a list of strings to run) or `duration_s` (for sim jobs)"
    if spec.command is not None and (not spec.command or not all(spec.command)):
        return "`command` must be a non-empty list of non-empty strings"
    if spec.duration_s is not None and not spec.duration_s > 0:
        return f"`duration_s` must be positive, got {spec.duration_s}"
    if spec.intake_id is not None and not _ID_PATTERN.match(spec.intake_id):
        return "`intake_id` must be 1-128 characters of letters, digits and _.:@/+=-"
    if spec.elastic is not None:
        lo, hi = spec.elastic.min, spec.elastic.max
        if not 1 <= lo <= hi:
            return f"`elastic` needs 1 <= min <= max, got min={lo} max={hi}"
        if not lo <= spec.gpus <= hi:
            return f"`gpus` ({spec.gpus}) must lie within elastic min..max ({lo}..{hi})"
        if problem := _elastic_problem(spec, spec.elastic):
            return problem
    if spec.memory is not None and (problem := _memory_problem(spec.memory)):
        return problem
    if not 0 <= spec.max_retries <= 100:
        return f"`max_retries` must be between 0 and 100, got {spec.max_retries}"
    if spec.procs_per_node is not None:
        if spec.command is None:
            return "`procs_per_node` needs a `command` to run"
        if not 1 <= spec.procs_per_node <= 256:
            return f"`procs_per_node` must be between 1 and 256, got {spec.procs_per_node}"
    if spec.env is not None:
        bad = [k for k in spec.env if not _ENV_NAME.match(k) or k in jobenv.RESERVED]
        if bad:
            return f"`env` names must be identifiers and not set by gpuherd itself ({', '.join(sorted(bad))})"
    if spec.workdir is not None and not spec.workdir.strip():
        return "`workdir` must not be empty when given"
    if spec.vc not in state.vcs:
        known = ", ".join(sorted(state.vcs))
        return f"unknown virtual cluster {spec.vc!r}; known: {known}"
    vc = state.vcs[spec.vc]
    if rules >= 2 and vc.gpu_quota is not None and not vc.can_borrow and spec.gpus > vc.gpu_quota:
        return (
            f"asks for {spec.gpus} GPUs but VC {vc.vc} has a quota of {vc.gpu_quota} and may not borrow, "
            "so it could never start; ask for fewer GPUs or use another VC"
        )
    if not state.nodes:
        return "no GPU nodes have registered yet, so no job can be placed; submit again once agents are up"
    # Only nodes whose executor can run this job count: processes for a command, sim for a duration.
    by_kind = by_kind if by_kind is not None else node_sizes(state)
    sizes = Sizes()
    for runs_processes, group in by_kind.items():
        if can_run(spec, runs_processes):
            sizes = sizes.plus(group)
    if not sizes.nodes:
        need = "a `command` needs a cpu or nvml agent" if spec.command else "a sim job needs a sim agent"
        return f"no registered node can run this job ({need}); none has registered yet"
    every = sizes.nodes == len(state.nodes)
    if spec.gpus > sizes.gpus:
        where = "the whole cluster has" if every else "the nodes that can run it have"
        return f"asks for {spec.gpus} GPUs but {where} {sizes.gpus} ({sizes.nodes} nodes)"
    if spec.nodes is not None:
        if spec.nodes <= 0:
            return f"`nodes` must be at least 1, got {spec.nodes}"
        if spec.gpus % spec.nodes:
            return f"`gpus` ({spec.gpus}) must divide evenly over `nodes` ({spec.nodes})"
        if spec.nodes > sizes.nodes:
            return f"asks for {spec.nodes} nodes but the cluster has {sizes.nodes}" + (
                "" if every else " that can run it"
            )
        per_node = spec.gpus // spec.nodes
        if per_node > sizes.largest:
            largest = "the largest node" if every else "the largest node that can run it"
            return f"asks for {per_node} GPUs per node but {largest} has {sizes.largest}"
    return None


def _elastic_problem(spec: ev.JobSpec, elastic: ev.Elastic) -> str | None:
    """An elastic job runs one worker per GPU on as many nodes as it gets, and keeps its global
    batch at every size it may take (or says how the learning rate follows a changing batch)."""
    if spec.nodes is not None:
        return "an elastic job cannot fix `nodes`: its GPUs change while it runs"
    if spec.procs_per_node is not None:
        return "an elastic job runs one worker process per GPU; leave out `procs_per_node`"
    batch, micro = elastic.global_batch, elastic.micro_batch
    if (batch is None) != (micro is None):
        return "give both `elastic.global_batch` and `elastic.micro_batch`, or neither"
    if batch is None or micro is None:
        return None
    if batch < 1 or micro < 1:
        return f"`elastic.global_batch` and `elastic.micro_batch` must be positive, got {batch} and {micro}"
    if elastic.lr_scaling is not None:
        return None
    fits = elastic.sizes()
    bad = sorted({w for w in (elastic.min, spec.gpus, elastic.max) if w not in fits})
    if bad:
        works = ", ".join(map(str, fits)) or "none"
        return (
            f"a global batch of {batch} is not a whole number of micro-batches of {micro} on every worker "
            f"at {', '.join(map(str, bad))} GPUs (sizes within {elastic.min}..{elastic.max} that work: {works}); "
            "choose min, max and gpus among those, change the batch sizes, or declare `elastic.lr_scaling`"
        )
    return None


class Submission(msgspec.Struct, frozen=True, kw_only=True):
    """One raw message from herd.intake.<source>, as stored by the HERD_INTAKE stream."""

    source: str
    seq: int  # its HERD_INTAKE sequence
    data: bytes
    at: float  # when the stream stored it
    msg_id: str | None = None  # its Nats-Msg-Id header: the default intake id
    delivery: Any = None  # the shell's handle to acknowledge it and answer its sender (not judged)
    trace: str | None = None  # the submitter's W3C traceparent, if it sent one (not judged)

    @property
    def cause(self) -> str:
        return f"intake:{self.source}:{self.seq}"


class _IntakeId(msgspec.Struct):
    intake_id: str | None = None


_intake_id_decoder = msgspec.json.Decoder(_IntakeId)


def submission_key(sub: Submission) -> str | None:
    """The intake key a submission would take (decided together with others only if distinct);
    None when it cannot be read (it is decided alone)."""
    try:
        intake_id = _intake_id_decoder.decode(sub.data).intake_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return intake_key(sub.source, intake_id or sub.msg_id or f"seq-{sub.seq}")


def rejection(
    state: SchedulerState, sub: Submission, reason: str, *, intake_id: str | None = None, service: str = "scheduler"
) -> Verdict:
    """The verdict for a submission that cannot become a job; it keeps the start of the payload."""
    return Verdict(
        ev.JobRejected(
            id=f"{service}:rejected:{sub.source}:{sub.seq}",
            at=sub.at,
            source=service,
            based_on=state.seq,
            cause=sub.cause,
            intake_source=sub.source if _SOURCE_PATTERN.match(sub.source) else "_invalid",
            intake_seq=sub.seq,
            intake_id=intake_id,
            reason=reason,
            payload_excerpt=_excerpt(sub.data),
            payload_size=len(sub.data),
        )
    )


def judge(
    state: SchedulerState, sub: Submission, *, service: str = "scheduler", sizes: NodeSizes | None = None
) -> Verdict:
    """Decide on one submission: JobSubmitted, or JobRejected with a reason a person can act on."""
    return _judge(state, sub, service=service, sizes=sizes, rules=ev.INTAKE_RULES)


def _judge(state: SchedulerState, sub: Submission, *, service: str, sizes: NodeSizes | None, rules: int) -> Verdict:
    source, data = sub.source, sub.data

    def reject(reason: str, intake_id: str | None = None) -> Verdict:
        return rejection(state, sub, reason, intake_id=intake_id, service=service)

    if not _SOURCE_PATTERN.match(source):
        return reject("publish to herd.intake.<source> with a source of 1-64 letters, digits, '_' or '-'")
    if len(data) > MAX_SUBMISSION_BYTES:
        return reject(f"submission is {len(data)} bytes; the limit is {MAX_SUBMISSION_BYTES} bytes")
    try:
        spec = _spec_decoder.decode(data)
    except msgspec.ValidationError as exc:
        return reject(f"invalid job spec: {exc}")
    except msgspec.DecodeError as exc:
        return reject(f"submission is not valid JSON: {exc}")
    problem = _spec_problem(spec, state, sizes, rules)
    if problem is not None:
        return reject(problem, spec.intake_id)
    intake_id = spec.intake_id or sub.msg_id or f"seq-{sub.seq}"
    if spec.intake_id is None:
        spec = msgspec.structs.replace(spec, intake_id=intake_id)
    job_id = job_id_for(source, intake_id)
    existing = state.intake_index.get(intake_key(source, intake_id))
    submitted = ev.JobSubmitted(
        id=f"{service}:intake:{source}:{intake_id}",
        at=sub.at,
        source=service,
        based_on=state.seq,
        cause=sub.cause,
        job=job_id,
        spec=spec,
        intake_source=source,
        intake_seq=sub.seq,
        intake_rules=rules,
    )
    return Verdict(submitted, job_id=job_id, duplicate=existing is not None)


def recheck(
    state: SchedulerState, verdict: ev.JobSubmitted | ev.JobRejected, *, service: str = "scheduler"
) -> str | None:
    """Why a recorded verdict would not be given again on ``state`` (its ``based_on``), by the rules
    it was judged by; None if it would. An accepted spec must still be valid and new; a rejected
    submission whose whole payload the log kept must still be rejected, for the same reason."""
    if isinstance(verdict, ev.JobSubmitted):
        key = intake_key(verdict.intake_source, verdict.spec.intake_id or "")
        if verdict.spec.intake_id is not None and key in state.intake_index:
            return f"intake id {verdict.spec.intake_id!r} of {verdict.intake_source} was taken already (a duplicate)"
        problem = _spec_problem(verdict.spec, state, rules=verdict.intake_rules)
        return None if problem is None else f"would now be rejected: {problem}"
    payload = verdict.payload_excerpt.encode()
    complete = (
        len(payload) == verdict.payload_size
        if verdict.payload_size
        else len(payload) < EXCERPT_BYTES and "\ufffd" not in verdict.payload_excerpt
    )
    if not complete:
        return None  # the log kept only the start of it: nothing to judge again
    sub = Submission(source=verdict.intake_source, seq=verdict.intake_seq, data=payload, at=verdict.at)
    again = _judge(state, sub, service=service, sizes=None, rules=verdict.intake_rules)
    if isinstance(again.event, ev.JobSubmitted):
        return "would now be accepted"
    if again.event.reason != verdict.reason:
        return f"would now be rejected for another reason: {again.event.reason}"
    return None
