"""Intake: turn a raw submission into JobSubmitted, or JobRejected with a reason a person can act on.

A submission is one job spec, an array (a spec with ``array``: one job per index or value), or a
workflow (``{"workflow": name, "steps": [spec, ...]}``: steps that depend on each other by name).
An array or a workflow is judged as a whole: every job of it is accepted (one ``JobSubmitted``
each, appended together) or none is, with one answer that lists the ids. Dependencies must name
jobs the scheduler knows (waiting, running, or ended within ``state.OUTCOMES_KEPT_S``) or steps
of the same workflow; a job may not depend on itself, and a workflow's steps may not form a cycle.
One intake id (of a source) is one submission: sent again with the same jobs and specs, it is a
duplicate, answered from the jobs it made; of another shape or spec, it is refused.

``judge`` is pure: it reads the submission and the scheduler's state, nothing else. The scheduler
decides submissions in the log's order like any other input (``SchedulerDecider.take``), so a
verdict's ``based_on`` is exactly the state it was judged on, and the audit re-judges it there
(``recheck``) by the rules it was judged by (``intake_rules``; see ``events.INTAKE_RULES``).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec

from gpuherd import events as ev
from gpuherd import jobenv
from gpuherd.errors import UNDECODABLE
from gpuherd.fold import VcState
from services.scheduler.placement import can_run
from services.scheduler.state import OUTCOMES_KEPT_S, SchedulerState, intake_key, rejection_of

MAX_SUBMISSION_BYTES = 64 * 1024
# The jobs one submission may make (an array's elements, a workflow's steps): one atomic append
# holds them all (JetStream's limit for an atomic batch), so they are accepted together or not at all.
MAX_JOBS_PER_SUBMISSION = 1000
MAX_DEPENDENCIES = 1000  # ids one job may depend on
_STEP_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Workflow-wide fields a step takes unless it sets its own; these are each step's alone.
_PER_STEP_ONLY = frozenset({"name", "intake_id", "depends_on", "array", "array_of", "workflow_of"})
_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:@/+=-]{1,128}$")
_SOURCE_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_spec_decoder = msgspec.json.Decoder(ev.JobSpec)
EXCERPT_BYTES = 256
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_GRAD_BYTES = 2**64 - 1  # what a snapshot's 64-bit integers hold


class Verdict(msgspec.Struct, frozen=True):
    event: ev.JobSubmitted | ev.JobRejected
    job_id: str | None = None  # the job's id; an array's or a workflow's id for those
    duplicate: bool = False  # the same intake id was submitted before: same job, nothing new
    more: tuple[ev.JobSubmitted, ...] = ()  # the other jobs of an array or a workflow
    array: str | None = None
    workflow: str | None = None
    steps: dict[str, list[str]] | None = None  # a workflow's step names -> their job ids

    def events(self) -> list[ev.Event]:
        """What to append: nothing for a duplicate (the log holds its job already)."""
        return [] if self.duplicate else [self.event, *self.more]

    def job_ids(self) -> list[str]:
        return [e.job for e in (self.event, *self.more) if isinstance(e, ev.JobSubmitted)]

    def reply(self) -> bytes:
        if isinstance(self.event, ev.JobRejected):
            return _rejection_reply(self.event.reason)
        answer: dict[str, object] = {"ok": True, "job_id": self.job_id, "duplicate": self.duplicate}
        if self.array is not None or self.workflow is not None:
            answer["job_ids"] = self.job_ids()
            if self.array is not None:
                answer["array"] = self.array
            if self.workflow is not None:
                answer |= {"workflow": self.workflow, "steps": self.steps}
        return msgspec.json.encode(answer)


def job_id_for(source: str, intake_id: str) -> str:
    return "j" + ev.stable_id(source, intake_id, length=11)


def _excerpt(data: bytes) -> str:
    return data[:EXCERPT_BYTES].decode("utf-8", errors="replace")


class Sizes(NamedTuple):
    """The registered nodes of one kind: how many, their GPUs in all, the largest node's GPUs, and
    each node's GPUs (sorted)."""

    nodes: int = 0
    gpus: int = 0
    largest: int = 0
    each: tuple[int, ...] = ()

    def plus(self, other: Sizes) -> Sizes:
        if not (self.nodes and other.nodes):  # (the common case, one kind of node: no merge per submission)
            return other if other.nodes else self
        each = tuple(sorted(self.each + other.each))
        return Sizes(self.nodes + other.nodes, self.gpus + other.gpus, max(self.largest, other.largest), each)

    def holding(self, gpus: int) -> int:
        """How many of the nodes have at least ``gpus`` GPUs."""
        return len(self.each) - bisect.bisect_left(self.each, gpus)


NodeSizes = dict[bool, Sizes]  # runs processes? -> the registered nodes of that kind


def node_sizes(state: SchedulerState) -> NodeSizes:
    """What intake checks a spec against; compute it once for a batch of submissions."""
    each: dict[bool, list[int]] = {False: [], True: []}
    for node in state.nodes.values():
        each[node.runs_processes()].append(len(node.gpus))
    return {kind: Sizes(len(gpus), sum(gpus), max(gpus, default=0), tuple(sorted(gpus))) for kind, gpus in each.items()}


def _memory_problem(memory: ev.MemoryNeeds) -> str | None:
    if memory.extra_mb <= 0:
        return f"`memory.extra_mb` must be positive (MiB per worker beyond its GPU), got {memory.extra_mb}"
    if not 0 <= memory.min_mb <= memory.extra_mb:
        return f"`memory.min_mb` must lie within 0..extra_mb ({memory.extra_mb}), got {memory.min_mb}"
    if not memory.tiers or len(set(memory.tiers)) != len(memory.tiers):
        return f"`memory.tiers` must name each accepted tier once, of {', '.join(ev.MEMORY_TIERS)}"
    return None


def _scaling_problem(scaling: ev.Scaling) -> str | None:
    """Intake rules 10: the elastic service and the simulator divide by a job's declared compute time
    per sample and add its gradient bytes, so both must be numbers they can use."""
    per_sample = scaling.compute_per_sample_s
    if not (per_sample > 0 and math.isfinite(per_sample)):
        return f"`scaling.compute_per_sample_s` must be a positive, finite number of seconds, got {per_sample}"
    if not 0 <= scaling.grad_bytes <= MAX_GRAD_BYTES:
        return f"`scaling.grad_bytes` must lie within 0..2**64-1, got {scaling.grad_bytes}"
    return None


def _field_with_nul(spec: ev.JobSpec) -> str | None:
    """Intake rules 10: the path of a string that reaches a process (its arguments, environment, working
    directory; an array's values become an environment variable) and holds a NUL byte, if any: the
    process cannot be started with it, and a job whose start fails that way was retried forever."""
    # (Looked through in place, the first found named: every submission is, and nearly none holds one.)
    for n, arg in enumerate(spec.command or ()):
        if "\0" in arg:
            return f"command[{n}]"
    for name, value in (spec.env or {}).items():
        if "\0" in value:
            return f"env.{name}"
    if "\0" in (spec.workdir or ""):
        return "workdir"
    if spec.array is not None:
        for n, value in enumerate(spec.array.values or ()):
            if isinstance(value, str) and "\0" in value:
                return f"array.values[{n}]"
    return None


def _spec_problem(
    spec: ev.JobSpec,
    state: SchedulerState,
    by_kind: NodeSizes | None = None,
    rules: int = ev.INTAKE_RULES,
    *,
    made: bool = False,
) -> str | None:
    """Why ``spec`` cannot be a job (None: it can); ``made``: a spec intake made (an element of an
    array, a step of a workflow), as the log holds it."""
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
    if rules >= 10 and spec.duration_s is not None and not math.isfinite(spec.duration_s):
        return f"`duration_s` must be a finite number of seconds, got {spec.duration_s}"
    if spec.intake_id is not None and not _ID_PATTERN.match(_base_intake_id(spec) if made else spec.intake_id):
        return "`intake_id` must be 1-128 characters of letters, digits and _.:@/+=-"
    if spec.elastic is not None:
        lo, hi = spec.elastic.min, spec.elastic.max
        if not 1 <= lo <= hi:
            return f"`elastic` needs 1 <= min <= max, got min={lo} max={hi}"
        if not lo <= spec.gpus <= hi:
            return f"`gpus` ({spec.gpus}) must lie within elastic min..max ({lo}..{hi})"
        if rules >= 4 and hi > ev.MAX_ELASTIC_WORLD:
            return (
                f"`elastic.max` ({hi}) is more GPUs than any job may take ({ev.MAX_ELASTIC_WORLD}); "
                "give the most GPUs the job can use"
            )
        if problem := _elastic_problem(spec, spec.elastic):
            return problem
    if spec.memory is not None and (problem := _memory_problem(spec.memory)):
        return problem
    if rules >= 10 and spec.scaling is not None and (problem := _scaling_problem(spec.scaling)):
        return problem
    if not 0 <= spec.max_retries <= 100:
        return f"`max_retries` must be between 0 and 100, got {spec.max_retries}"
    if spec.procs_per_node is not None:
        if spec.command is None:
            return "`procs_per_node` needs a `command` to run"
        if not 1 <= spec.procs_per_node <= 256:
            return f"`procs_per_node` must be between 1 and 256, got {spec.procs_per_node}"
    if spec.env is not None:
        ours = _array_env(spec.array_of) if made and spec.array_of is not None else {}
        bad = [k for k in spec.env if not _ENV_NAME.match(k) or (k in jobenv.RESERVED and ours.get(k) != spec.env[k])]
        if bad:
            return f"`env` names must be identifiers and not set by gpuherd itself ({', '.join(sorted(bad))})"
    if spec.workdir is not None and not spec.workdir.strip():
        return "`workdir` must not be empty when given"
    if rules >= 10 and (field := _field_with_nul(spec)) is not None:
        return f"`{field}` holds a NUL byte, which no process's arguments, environment or working directory can hold"
    if spec.vc not in state.vcs:
        known = ", ".join(sorted(state.vcs))
        return f"unknown virtual cluster {spec.vc!r}; known: {known}"
    vc = state.vcs[spec.vc]
    if rules >= 2 and vc.gpu_quota is not None and not vc.can_borrow and spec.gpus > vc.gpu_quota:
        return (
            f"asks for {spec.gpus} GPUs but VC {vc.vc} has a quota of {vc.gpu_quota} and may not borrow, "
            "so it could never start; ask for fewer GPUs or use another VC"
        )
    if rules >= 3 and (problem := _limits_problem(spec, vc, rules, made=made)):
        return problem
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
        # (A mixed cluster: the nodes large enough for a share may be fewer than the gang.)
        if rules >= 5 and (holding := sizes.holding(per_node)) < spec.nodes:
            which = "nodes" if every else "nodes that can run it"
            return f"asks for {spec.nodes} nodes of {per_node} GPUs but only {holding} {which} have that many"
    if rules >= 5 and (field := _out_of_range(spec)) is not None:
        return f"`{field}` is out of range: integers in a job spec lie within -2**63..2**64-1"
    return None


_SNAPSHOT_ENCODE = msgspec.msgpack.Encoder().encode


def _out_of_range(spec: ev.JobSpec) -> str | None:
    """The path of an integer of ``spec`` that a snapshot cannot hold, if any: snapshots are msgpack
    (64-bit integers), and one such number would stop every snapshot of the state."""
    try:
        _SNAPSHOT_ENCODE(spec)  # (the common case: one fast encode, no walk)
        return None
    except OverflowError:
        return _path_of_big_int(msgspec.to_builtins(spec)) or "spec"


def _path_of_big_int(value: Any, path: str = "") -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -(2**63) <= value < 2**64 else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := _path_of_big_int(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def _limits_problem(spec: ev.JobSpec, vc: VcState, rules: int, *, made: bool) -> str | None:
    """Intake rules 3: what only intake may set, time limits within the VC's maximum, per-user
    limits a job could ever fit, and the shape of an array."""
    if not made and (spec.array_of is not None or spec.workflow_of is not None):
        return "`array_of` and `workflow_of` are set by gpuherd; submit an `array`, or a workflow, instead"
    if made and spec.array is not None:
        return "a job made from an array or a workflow is not itself an array"
    limit = spec.time_limit_s
    if limit is not None:
        if not 0 < limit < math.inf:
            return f"`time_limit_s` must be a positive number of seconds, got {limit}"
        if vc.max_time_limit_s is not None and limit > vc.max_time_limit_s:
            return (
                f"`time_limit_s` ({limit:g}s) is above VC {vc.vc}'s maximum of {vc.max_time_limit_s:g}s; "
                "ask for at most that"
            )
    if vc.max_gpus_per_user is not None and spec.gpus > vc.max_gpus_per_user:
        return (
            f"asks for {spec.gpus} GPUs but VC {vc.vc} allows {vc.max_gpus_per_user} per user, "
            "so it could never start; ask for fewer GPUs or use another VC"
        )
    if spec.depends_on is not None and len(spec.depends_on.ids()) > MAX_DEPENDENCIES:
        return f"depends on {len(spec.depends_on.ids())} jobs; at most {MAX_DEPENDENCIES}"
    if spec.array is not None:
        return _array_problem(spec.array, rules)
    return None


def _array_problem(array: ev.ArraySpec, rules: int) -> str | None:
    if (array.count is None) == (array.values is None):
        return "an `array` gives either `count` (elements 0..count-1) or `values` (one element per value)"
    size = array.count if array.count is not None else len(array.values or ())
    if size < 1 and rules >= 6:
        if array.count is not None:
            return f"`array.count` must be at least 1, got {array.count}"
        return "`array.values` must hold at least one value"
    if not 1 <= size <= MAX_JOBS_PER_SUBMISSION:  # (rules 3 to 5 said "too large" of an empty array too)
        return f"an array has 1 to {MAX_JOBS_PER_SUBMISSION} elements; this one has {size} (too large)"
    if array.values is not None and any(len(str(v)) > 1024 for v in array.values):
        return "an array's `values` are limited to 1024 characters each"
    if array.max_running is not None and array.max_running < 1:
        return f"`array.max_running` must be at least 1, got {array.max_running}"
    return None


def _array_env(member: ev.ArrayMember) -> dict[str, str]:
    """What an array element finds in its environment: its index, its value, its array's id."""
    env = {jobenv.ARRAY_INDEX: str(member.index), jobenv.ARRAY_ID: member.array}
    if member.value is not None:
        env[jobenv.ARRAY_VALUE] = member.value
    return env


def _base_intake_id(spec: ev.JobSpec) -> str:
    """The intake id a made job's came from (``<id>#<step>[<index>]``: the submission's ``<id>``)."""
    intake_id = spec.intake_id or ""
    if spec.workflow_of is not None:
        intake_id = intake_id.rpartition("#")[0] or intake_id
    if spec.array_of is not None:
        intake_id = intake_id.rpartition("[")[0] or intake_id
    return intake_id


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
    workflow: Any = None
    steps: Any = None
    array: Any = None
    depends_on: Any = None


_intake_id_decoder = msgspec.json.Decoder(_IntakeId)


def submission_key(sub: Submission) -> str | None:
    """The intake key a submission would take (decided together with others only if distinct);
    None when it cannot be read, makes several jobs (it is decided alone: its jobs then fit one
    atomic append), or depends on other jobs (decided once every verdict sent before is folded: a
    client told its job was accepted may name it at once)."""
    try:
        head = _intake_id_decoder.decode(sub.data)
    except UNDECODABLE:
        return None
    if head.workflow is not None or head.steps is not None or head.array is not None or head.depends_on is not None:
        return None
    return intake_key(sub.source, _intake_id_or_default(sub, head.intake_id))


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
            intake_source=_recorded_source(sub.source),
            intake_seq=sub.seq,
            intake_id=intake_id,
            reason=reason,
            payload_excerpt=_excerpt(sub.data),
            payload_size=len(sub.data),
        )
    )


def recorded_rejection(state: SchedulerState, sub: Submission) -> bytes | None:
    """The answer to a submission whose rejection the log holds (it is delivered again: the leader
    that stored the rejection stopped before acknowledging it), or None. The log's page of that
    rejection may have held other verdicts, so appending it anew would store it twice."""
    recorded = state.recent_rejections.get(sub.seq)
    if recorded is None:
        return None
    if recorded != rejection_of(_recorded_source(sub.source), len(sub.data), _excerpt(sub.data), recorded.reason):
        return None  # another submission under the same sequence (the intake stream was made anew)
    return _rejection_reply(recorded.reason)


def _rejection_reply(reason: str) -> bytes:
    return msgspec.json.encode({"ok": False, "error": reason})


INVALID_SOURCE = "_invalid"  # what a rejection records for a source that breaks the pattern
_SOURCE_RULE = "publish to herd.intake.<source> with a source of 1-64 letters, digits, '_' or '-'"


def _recorded_source(source: str) -> str:
    return source if _SOURCE_PATTERN.match(source) else INVALID_SOURCE


def _bad_source_reason(source: str, rules: int) -> str:
    """Rules 11 name the source that was refused: it is recorded as ``_invalid``, so before them a
    submitter could not tell from the reason which of its subjects was wrong."""
    if rules < 11:
        return _SOURCE_RULE
    shown = source if len(source) <= 80 else source[:80] + "…"
    return f"the source {shown!r} (from the subject herd.intake.{shown}) is not one: {_SOURCE_RULE}"


def _refused_for_its_source(verdict: ev.JobRejected) -> bool:
    """Whether a recorded rejection refused its source (by any rules): the source itself is not
    recorded, and no state changes the verdict on it."""
    if verdict.intake_source != INVALID_SOURCE:
        return False
    if verdict.intake_rules < 11:
        return verdict.reason == _SOURCE_RULE
    return verdict.reason.startswith("the source ") and verdict.reason.endswith(f" is not one: {_SOURCE_RULE}")


def judge(
    state: SchedulerState, sub: Submission, *, service: str = "scheduler", sizes: NodeSizes | None = None
) -> Verdict:
    """Decide on one submission: JobSubmitted (one per job it makes), or JobRejected with a reason a
    person can act on."""
    return _judge(state, sub, service=service, sizes=sizes, rules=ev.INTAKE_RULES)


class _Job(NamedTuple):
    """A job a submission makes: its id and spec (dependencies not yet resolved), and the names and
    ids it answers to within the submission (a workflow step's name; an array's id)."""

    job: str
    spec: ev.JobSpec
    step: str | None = None  # its workflow step


class _Planned(NamedTuple):
    jobs: list[_Job]
    job_id: str  # what the answer calls the submission: the job, the array or the workflow
    array: str | None = None
    workflow: str | None = None
    steps: dict[str, list[str]] | None = None
    by_name: dict[str, str] | None = None  # a workflow's step names -> the id a dependency names


class _Shape(msgspec.Struct):
    workflow: Any = None
    steps: Any = None


_shape_decoder = msgspec.json.Decoder(_Shape)


def _judge(state: SchedulerState, sub: Submission, *, service: str, sizes: NodeSizes | None, rules: int) -> Verdict:
    source, data = sub.source, sub.data

    def reject(reason: str, intake_id: str | None = None) -> Verdict:
        return rejection(state, sub, reason, intake_id=intake_id, service=service)

    if not _SOURCE_PATTERN.match(source):
        return reject(_bad_source_reason(source, rules))
    if len(data) > MAX_SUBMISSION_BYTES:
        return reject(f"submission is {len(data)} bytes; the limit is {MAX_SUBMISSION_BYTES} bytes")
    if rules >= 9 and (problem := _utf8_problem(data)) is not None:
        return reject(problem)
    workflow = False
    if rules >= 3:
        try:
            shape = _shape_decoder.decode(data)
            workflow = shape.workflow is not None or shape.steps is not None
        except msgspec.ValidationError as exc:
            # (Rules 3 to 6 let the spec's decoder judge a workflow whose `workflow` or `steps` held
            # an out-of-range number: it said "unknown field `workflow`".)
            if rules >= 7 and (problem := _workflow_number_problem(data, exc)) is not None:
                return reject(*problem)
        except msgspec.DecodeError:
            pass  # (the spec's own decoder says what is wrong with it)
    if workflow:
        intake_id = _intake_id_of(data)
        raw = _workflow_payload(sub, rules)
        if isinstance(raw, str):
            return reject(raw, intake_id)
        # Rules 8: a used intake id is judged against the jobs it made, before anything of today's
        # state (a VC's limits, the nodes) is; rules 3 to 7 judged the payload anew.
        if rules >= 8 and _any_taken(state, source, _workflow_keys(sub, raw)):
            again = _plan_workflow(state, sub, raw, sizes, rules, checked=False)
            used = _intake_id_or_default(sub, raw.get("intake_id"))
            return _resubmitted(state, sub, again, used, service=service, rules=rules)
        planned = _plan_workflow(state, sub, raw, sizes, rules)
    else:
        try:
            spec = _spec_decoder.decode(data)
        except msgspec.ValidationError as exc:
            return reject(f"invalid job spec: {exc}")
        except msgspec.DecodeError as exc:
            return reject(f"submission is not valid JSON: {exc}")
        if rules >= 8 and _any_taken(state, source, keys := _job_keys(sub, spec)):
            again = _plan_job(state, sub, spec, rules, checked=False)
            return _resubmitted(state, sub, again, keys[0], service=service, rules=rules)
        problem = _spec_problem(spec, state, sizes, rules)
        if problem is not None:
            return reject(problem, spec.intake_id)
        intake_id = spec.intake_id
        planned = _plan_job(state, sub, spec, rules)
    if isinstance(planned, str):
        return reject(planned, intake_id)
    jobs = planned.jobs
    if rules >= 3:
        problem = _resolve_all(state, planned)
        if isinstance(problem, str):
            return reject(problem, intake_id)
        jobs = problem
    # (Rules 8 looked up every intake id above; the rules before only the first job's.)
    first = jobs[0].spec
    existing = None if rules >= 8 else state.intake_index.get(intake_key(source, first.intake_id or ""))
    return _verdict(state, sub, planned, jobs, service=service, rules=rules, duplicate=existing is not None)


def _verdict(
    state: SchedulerState,
    sub: Submission,
    planned: _Planned,
    jobs: list[_Job],
    *,
    service: str,
    rules: int,
    duplicate: bool,
) -> Verdict:
    events = [
        ev.JobSubmitted(
            id=f"{service}:intake:{sub.source}:{job.spec.intake_id}",
            at=sub.at,
            source=service,
            based_on=state.seq,
            cause=sub.cause,
            job=job.job,
            spec=job.spec,
            intake_source=sub.source,
            intake_seq=sub.seq,
            intake_rules=rules,
        )
        for job in jobs
    ]
    return Verdict(
        events[0],
        job_id=planned.job_id,
        duplicate=duplicate,
        more=tuple(events[1:]),
        array=planned.array,
        workflow=planned.workflow,
        steps=planned.steps,
    )


# -- a used intake id (rules 8) ------------------------------------------------------------------------


def _intake_id_or_default(sub: Submission, given: Any) -> Any:
    """A submission's intake id: the one it gives, else its message id, else its sequence (what a
    retry of it keeps)."""
    return given or sub.msg_id or f"seq-{sub.seq}"


def _job_keys(sub: Submission, spec: ev.JobSpec) -> tuple[str, str]:
    """The intake ids that tell whether a job's or an array's intake id was used: its own (a single
    job's) and its first element's (an array's; a user's id never holds ``[``)."""
    intake_id = _intake_id_or_default(sub, spec.intake_id)
    return intake_id, f"{intake_id}[0]"


def _workflow_keys(sub: Submission, raw: dict[str, Any]) -> list[str]:
    """The same for each step of a workflow (``<id>#<step>``); none where the workflow is malformed
    (planning it says why)."""
    intake_id = _intake_id_or_default(sub, raw.get("intake_id"))
    steps = raw.get("steps")
    if not isinstance(intake_id, str) or not isinstance(steps, list) or len(steps) > MAX_JOBS_PER_SUBMISSION:
        return []
    keys = []
    for step in steps:
        name = step.get("name") if isinstance(step, dict) else None
        if isinstance(name, str):
            keys += [f"{intake_id}#{name}", f"{intake_id}#{name}[0]"]
    return keys


def _any_taken(state: SchedulerState, source: str, intake_ids: Iterable[str]) -> bool:
    index = state.intake_index
    return any(intake_key(source, intake_id) in index for intake_id in intake_ids)


def _resubmitted(
    state: SchedulerState, sub: Submission, planned: _Planned | str, used_id: str, *, service: str, rules: int
) -> Verdict:
    """A submission under an intake id that made jobs already. Exactly those jobs, each with the spec
    it was accepted with: a duplicate, answered from the recorded jobs (nothing is judged again, so a
    retry after a VC's limits changed is still the job it was). Anything else is refused: taking it
    for a duplicate would drop what changed unseen, and accepting the new jobs would make a second
    submission under one id (the fold ignores a job id it holds already). The rejection records the
    id it was judged under, given or not (a message id), for the audit to judge it under the same."""

    def reject(reason: str) -> Verdict:
        return rejection(state, sub, reason, intake_id=used_id, service=service)

    if isinstance(planned, str):
        return reject(planned)  # (malformed whatever the state: it is not the submission that was accepted)
    jobs = _named_dependencies(planned)
    index = state.intake_index
    taken = [index.get(intake_key(sub.source, job.spec.intake_id or "")) for job in jobs]
    others = _other_earlier_jobs(state, sub.source, planned)
    if None in taken or others:
        earlier = [job_id for job_id in taken if job_id is not None] + others
        return reject(
            f"intake id {used_id!r} was used by an earlier submission of another shape "
            f"(jobs {_listing(earlier)}); use a new intake id"
        )
    recorded_jobs = []
    for job in jobs:
        recorded = state.jobs.get(job.job)
        if recorded is None:  # ended and forgotten but for its id: nothing left to compare
            recorded_jobs.append(job)
            continue
        if fields := _differing_fields(job.spec, recorded.spec):
            where = f"step {job.step}: " if job.step is not None else ""
            named = ", ".join(f"`{field}`" for field in fields)
            return reject(
                f"intake id {used_id!r} was used by an earlier submission with another spec ({where}{named} "
                f"{'differs' if len(fields) == 1 else 'differ'} from job {job.job}); use a new intake id"
            )
        recorded_jobs.append(job._replace(spec=recorded.spec))
    return _verdict(state, sub, planned, recorded_jobs, service=service, rules=rules, duplicate=True)


def _other_earlier_jobs(state: SchedulerState, source: str, planned: _Planned) -> list[str]:
    """Jobs the earlier submission made that this one would not: an array's elements beyond this
    one's, a single job where this one is an array (or the reverse), a workflow's other steps."""
    index = state.intake_index
    probes = []
    for job in planned.jobs:
        member, intake_id = job.spec.array_of, job.spec.intake_id or ""
        if member is None:
            probes.append(f"{intake_id}[0]")
        elif member.index == 0:
            base = intake_id.rpartition("[")[0]
            probes += [base, f"{base}[{member.size}]"]
    found = [job_id for probe in probes if (job_id := index.get(intake_key(source, probe))) is not None]
    if planned.workflow is not None:
        # (No index holds a workflow's steps: look among the jobs known, only for a used intake id.)
        prefix, ours = f"{planned.workflow}-", {job.job for job in planned.jobs} | set((planned.by_name or {}).values())
        found += [job_id for job_id in state.jobs if job_id.startswith(prefix) and job_id not in ours]
        found += [job_id for job_id in state.outcomes if job_id.startswith(prefix) and job_id not in ours]
    return list(dict.fromkeys(found))


def _listing(job_ids: list[str], most: int = 10) -> str:
    job_ids = list(dict.fromkeys(job_ids))
    shown = ", ".join(job_ids[:most])
    return shown if len(job_ids) <= most else f"{shown} and {len(job_ids) - most} more"


_ARRAY_ENV = frozenset({jobenv.ARRAY_INDEX, jobenv.ARRAY_ID, jobenv.ARRAY_VALUE})
_FIELD_NAMES = {"array_of": "array", "workflow_of": "workflow"}  # what the submitter gave for them


def _differing_fields(asked: ev.JobSpec, recorded: ev.JobSpec) -> list[str]:
    """The fields a resubmitted job asks for otherwise than the recorded one. A time limit it leaves
    out is its VC's default, whatever that is now; an element's own environment follows its array."""
    if asked.time_limit_s is None:
        asked = msgspec.structs.replace(asked, time_limit_s=recorded.time_limit_s)
    if asked == recorded:
        return []
    fields = []
    for name in asked.__struct_fields__:
        mine, theirs = getattr(asked, name), getattr(recorded, name)
        if mine == theirs or (name == "env" and _user_env(mine) == _user_env(theirs)):
            continue
        fields.append(_FIELD_NAMES.get(name, name))
    return fields


def _user_env(env: dict[str, str] | None) -> dict[str, str]:
    return {name: value for name, value in (env or {}).items() if name not in _ARRAY_ENV}


def _named_dependencies(planned: _Planned) -> list[_Job]:
    """The jobs with their dependencies named by job id, as ``_resolve_all`` names them, unchecked."""
    by_name = planned.by_name or {}
    out = []
    for job in planned.jobs:
        deps = job.spec.depends_on
        if deps is not None:
            named = {
                kind: tuple(dict.fromkeys(by_name.get(name, name) for name in names)) for kind, names in deps.kinds()
            }
            job = job._replace(spec=msgspec.structs.replace(job.spec, depends_on=ev.Dependencies(**named)))
        out.append(job)
    return out


def _utf8_problem(data: bytes) -> str | None:
    """Intake rules 9: why ``data`` is not UTF-8, or None. (msgspec raises ``UnicodeDecodeError``, no
    ``msgspec.DecodeError``, for a bad byte inside a string, and only once it reaches it.)"""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"submission is not valid JSON: not UTF-8 at byte {exc.start} ({exc.reason}); send JSON encoded as UTF-8"
    return None


class _OutOfRange:
    """Where a workflow held a number no float can (``1e999``): what msgspec refuses untyped."""


_OUT_OF_RANGE = _OutOfRange()


def _float_or_out_of_range(text: str) -> float | _OutOfRange:
    value = float(text)
    return value if math.isfinite(value) else _OUT_OF_RANGE


_marking_decoder = msgspec.json.Decoder(float_hook=_float_or_out_of_range)


def _workflow_number_problem(data: bytes, error: msgspec.ValidationError) -> tuple[str, str | None] | None:
    """Intake rules 7: why a workflow whose number msgspec refused is invalid, with the number's path
    (``$.steps[0].duration_s``; msgspec's untyped decoder says only ``$.steps[0][...]``), and its
    intake id; None if ``data`` is no workflow (a job spec's decoder then says what is wrong)."""
    try:
        raw = _marking_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, dict) or ("workflow" not in raw and "steps" not in raw):
        return None
    message, _, _ = str(error).partition(" - at ")
    path = _path_of_out_of_range(raw, "$")
    intake_id = raw.get("intake_id")
    reason = f"invalid workflow: {message} - at `{path}`" if path else f"invalid workflow: {error}"
    return reason, intake_id if isinstance(intake_id, str) else None


def _path_of_out_of_range(value: Any, path: str) -> str | None:
    """The JSON path of the first out-of-range number in ``value``, in the order the payload gave them."""
    if value is _OUT_OF_RANGE:
        return path
    items = (
        ((f"{path}.{key}", item) for key, item in value.items())
        if isinstance(value, dict)
        else ((f"{path}[{index}]", item) for index, item in enumerate(value))
        if isinstance(value, list)
        else ()
    )
    for where, item in items:
        if (found := _path_of_out_of_range(item, where)) is not None:
            return found
    return None


def _intake_id_of(data: bytes) -> str | None:
    try:
        intake_id = _intake_id_decoder.decode(data).intake_id
    except UNDECODABLE:
        return None
    return intake_id if isinstance(intake_id, str) else None


def _plan_job(
    state: SchedulerState, sub: Submission, spec: ev.JobSpec, rules: int, *, checked: bool = True
) -> _Planned | str:
    """One job, or an array of them; ``checked`` False: a spec not judged (the jobs as asked for, to
    compare with those a used intake id made)."""
    intake_id = _intake_id_or_default(sub, spec.intake_id)
    job_id = job_id_for(sub.source, intake_id)
    spec = msgspec.structs.replace(spec, intake_id=intake_id)
    if rules >= 3 and checked:
        spec = _with_default_limit(state, spec)
    if spec.array is None:
        return _Planned([_Job(job_id, spec)], job_id)
    if not checked and (problem := _array_problem(spec.array, rules)) is not None:
        return problem  # (never make the elements of an array intake refuses)
    jobs = _elements(job_id, spec, intake_id)
    return _Planned(jobs, job_id, array=job_id)


def _with_default_limit(state: SchedulerState, spec: ev.JobSpec) -> ev.JobSpec:
    """A job without a time limit gets its VC's default (so the log says what it runs under)."""
    vc = state.vcs.get(spec.vc)
    if spec.time_limit_s is None and vc is not None and vc.default_time_limit_s is not None:
        return msgspec.structs.replace(spec, time_limit_s=vc.default_time_limit_s)
    return spec


def _elements(array_id: str, spec: ev.JobSpec, intake_id: str) -> list[_Job]:
    """The jobs of an array: ``<array>_<i>``, named ``<name>[i]``, each with its index (and value)."""
    array = spec.array
    assert array is not None
    values: list[str | None] = (
        [str(v) for v in array.values] if array.values is not None else [None] * (array.count or 0)
    )
    out = []
    for index, value in enumerate(values):
        member = ev.ArrayMember(
            array=array_id, index=index, size=len(values), value=value, max_running=array.max_running
        )
        element = msgspec.structs.replace(
            spec,
            name=f"{spec.name}[{index}]",
            intake_id=f"{intake_id}[{index}]",
            array=None,
            array_of=member,
            env={**(spec.env or {}), **_array_env(member)},
        )
        out.append(_Job(f"{array_id}_{index}", element))
    return out


def workflow_id_for(source: str, intake_id: str) -> str:
    return "w" + ev.stable_id(source, intake_id, length=11)


def _workflow_payload(sub: Submission, rules: int) -> dict[str, Any] | str:
    """A workflow's payload decoded, or why it cannot be."""
    try:
        raw = msgspec.json.decode(sub.data)
    except msgspec.ValidationError as exc:
        if rules >= 7 and (problem := _workflow_number_problem(sub.data, exc)) is not None:
            return problem[0]
        return f"submission is not valid JSON: {exc}"  # (rules 3 to 6: a number out of range, without its path)
    except msgspec.DecodeError as exc:
        return f"submission is not valid JSON: {exc}"
    if not isinstance(raw, dict):
        return 'a workflow is a mapping: {"workflow": name, "steps": [job spec, ...]}'
    return raw


def _plan_workflow(
    state: SchedulerState,
    sub: Submission,
    raw: dict[str, Any],
    sizes: NodeSizes | None,
    rules: int,
    *,
    checked: bool = True,
) -> _Planned | str:
    """A workflow's steps, each a job (or an array), checked one by one: the first problem refuses all
    (``checked`` False: the steps' specs not judged, as in ``_plan_job``)."""
    name, steps, intake_id = raw.get("workflow"), raw.get("steps"), raw.get("intake_id")
    if not isinstance(name, str) or not name.strip() or len(name) > 256:
        return "a workflow needs `workflow`: its name (1-256 characters)"
    if not isinstance(steps, list) or not steps:
        return "a workflow needs `steps`: a non-empty list of job specs, each with its step `name`"
    if len(steps) > MAX_JOBS_PER_SUBMISSION:
        return f"a workflow has at most {MAX_JOBS_PER_SUBMISSION} steps; this one has {len(steps)}"
    if intake_id is not None and (not isinstance(intake_id, str) or not _ID_PATTERN.match(intake_id)):
        return "`intake_id` must be 1-128 characters of letters, digits and _.:@/+=-"
    shared = {k: v for k, v in raw.items() if k not in ("workflow", "steps", "intake_id")}
    if per_step := sorted(_PER_STEP_ONLY & shared.keys()):
        return f"`{per_step[0]}` is given per step, not for the whole workflow"
    intake_id = _intake_id_or_default(sub, intake_id)
    workflow = workflow_id_for(sub.source, intake_id)
    jobs: list[_Job] = []
    ids: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for n, step in enumerate(steps):
        if not isinstance(step, dict):
            return f"step {n + 1} is not a job spec (a mapping)"
        step_name = step.get("name")
        if not isinstance(step_name, str) or not _STEP_PATTERN.match(step_name):
            return f"step {n + 1}: a step's `name` is 1-64 letters, digits, '_' or '-' (it names the step)"
        if step_name in by_name:
            return f"two steps are named {step_name!r}; each step's name is its own"
        if "intake_id" in step:
            return f"step {step_name}: a step has no `intake_id` of its own (the workflow's names it)"
        try:
            spec = msgspec.convert({**shared, **step}, ev.JobSpec)
        except msgspec.ValidationError as exc:
            return f"step {step_name}: invalid job spec: {exc}"
        problem: str | None = None
        if checked:
            problem = _spec_problem(spec, state, sizes, rules)
        elif spec.array is not None:
            problem = _array_problem(spec.array, rules)  # (never make the elements of an array intake refuses)
        if problem is not None:
            return f"step {step_name}: {problem}"
        step_id = f"{workflow}-{step_name}"
        member = ev.WorkflowMember(workflow=workflow, name=name, step=step_name)
        spec = msgspec.structs.replace(spec, intake_id=f"{intake_id}#{step_name}", workflow_of=member)
        if checked:
            spec = _with_default_limit(state, spec)
        made = (
            [_Job(step_id, spec, step_name)]
            if spec.array is None
            else [j._replace(step=step_name) for j in _elements(step_id, spec, spec.intake_id or "")]
        )
        if len(jobs) + len(made) > MAX_JOBS_PER_SUBMISSION:
            return f"a workflow makes at most {MAX_JOBS_PER_SUBMISSION} jobs (arrays count each element)"
        jobs += made
        ids[step_name] = [j.job for j in made]
        by_name[step_name] = step_id
    return _Planned(jobs, workflow, workflow=workflow, steps=ids, by_name=by_name)


def _resolve_all(state: SchedulerState, planned: _Planned) -> list[_Job] | str:
    """Every job's dependencies as ids the scheduler knows (a workflow's step names resolved), or
    why they cannot be: an unknown id, a job depending on itself, a cycle of steps."""
    for job in planned.jobs:
        if job.spec.depends_on is not None:
            break
    else:
        return list(planned.jobs)  # (most submissions: nothing to resolve, no step to order)
    by_name = planned.by_name or {}
    made = {job.job for job in planned.jobs}
    step_of = {job.job: job.step for job in planned.jobs if job.step is not None}
    step_of |= {step_id: name for name, step_id in by_name.items()}  # (an array step's id is its array's)
    out = []
    edges: dict[str, set[str]] = {}
    for job in planned.jobs:
        deps = job.spec.depends_on
        if deps is None:
            out.append(job)
            continue
        own = {job.job, *(a.array for a in (job.spec.array_of,) if a is not None)}
        resolved: dict[str, tuple[str, ...]] = {}
        for kind, names in deps.kinds():
            ids = []
            for name in names:
                dep = by_name.get(name, name)
                if dep in own:
                    where = f"step {job.step}" if job.step else "a job"
                    return f"{where} cannot depend on itself ({kind}:{name})"
                if dep not in made and dep not in by_name.values() and not _known(state, dep):
                    return (
                        f"depends ({kind}) on {name!r}, which is no job, array or workflow step the scheduler "
                        f"knows (an id from `gpuherd jobs`, a step of the same workflow, or a job that ended "
                        f"within the last {OUTCOMES_KEPT_S / 86400:.0f} days)"
                    )
                if dep in step_of and job.step is not None:
                    edges.setdefault(job.step, set()).add(step_of[dep])
                ids.append(dep)
            resolved[kind] = tuple(dict.fromkeys(ids))
        spec = msgspec.structs.replace(job.spec, depends_on=ev.Dependencies(**resolved))
        out.append(job._replace(spec=spec))
    cycle = _cycle(edges)
    if cycle:
        return f"the steps' dependencies form a cycle ({' -> '.join(cycle)}), so none of them could ever start"
    return out


def _known(state: SchedulerState, job_or_array: str) -> bool:
    return job_or_array in state.jobs or job_or_array in state.arrays or job_or_array in state.outcomes


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """A cycle in the steps' dependency graph (step -> the steps it depends on), as a path; [] if none."""
    done: set[str] = set()
    for start in sorted(edges):
        if start in done:
            continue
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, Iterable[str]]] = [(start, iter(sorted(edges.get(start, ()))))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)  # type: ignore[call-overload]
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(edges.get(child, ())))))
                path.append(child)
                on_path.add(child)
    return []


def recheck(
    state: SchedulerState, verdict: ev.JobSubmitted | ev.JobRejected, *, service: str = "scheduler"
) -> str | None:
    """Why a recorded verdict would not be given again on ``state`` (its ``based_on``), by the rules
    it was judged by; None if it would. An accepted spec must still be valid and new; a rejected
    submission whose whole payload the log kept must still be rejected, for the same reason. (A job
    of an array or a workflow is rechecked on its own: its dependencies on the jobs accepted with
    it are taken as they are; a cycle among them is checked when the workflow is judged.)"""
    if isinstance(verdict, ev.JobSubmitted):
        key = intake_key(verdict.intake_source, verdict.spec.intake_id or "")
        if verdict.spec.intake_id is not None and key in state.intake_index:
            return f"intake id {verdict.spec.intake_id!r} of {verdict.intake_source} was taken already (a duplicate)"
        problem = _spec_problem(verdict.spec, state, rules=verdict.intake_rules, made=True)
        if problem is None and verdict.intake_rules >= 3:
            problem = _made_problem(state, verdict)
        return None if problem is None else f"would now be rejected: {problem}"
    payload = verdict.payload_excerpt.encode()
    # (U+FFFD in the excerpt: bytes that were not UTF-8 were replaced, so these are not the bytes
    # that were judged, even where the sizes agree.)
    complete = "\ufffd" not in verdict.payload_excerpt and (
        len(payload) == verdict.payload_size if verdict.payload_size else len(payload) < EXCERPT_BYTES
    )
    if not complete:
        return None  # the log kept only the start of it, or not its bytes: nothing to judge again
    if _refused_for_its_source(verdict):
        # (Judged again under the recorded ``_invalid``, a valid source, it would have been accepted:
        # the audit reported every such rejection as one it would not give again.)
        return None
    # (A rejection records the intake id it was judged under; one not in the payload was its message id.)
    sub = Submission(
        source=verdict.intake_source, seq=verdict.intake_seq, data=payload, at=verdict.at, msg_id=verdict.intake_id
    )
    again = _judge(state, sub, service=service, sizes=None, rules=verdict.intake_rules)
    if isinstance(again.event, ev.JobSubmitted):
        return "would now be accepted"
    if again.event.reason != verdict.reason:
        return f"would now be rejected for another reason: {again.event.reason}"
    return None


def _made_problem(state: SchedulerState, verdict: ev.JobSubmitted) -> str | None:
    """Intake rules 3, on an accepted job as the log holds it: its id, its time limit and its dependencies."""
    spec = verdict.spec
    member, step = spec.array_of, spec.workflow_of
    if member is not None and verdict.job != f"{member.array}_{member.index}":
        return f"element {member.index} of array {member.array} would be {member.array}_{member.index}"
    vc = state.vcs.get(spec.vc)
    if spec.time_limit_s is None and vc is not None and vc.default_time_limit_s is not None:
        return f"it would get VC {vc.vc}'s default time limit ({vc.default_time_limit_s:g}s)"
    if spec.depends_on is None:
        return None
    for kind, ids in spec.depends_on.kinds():
        for dep in ids:
            if dep == verdict.job or (member is not None and dep == member.array):
                return f"a job cannot depend on itself ({kind}:{dep})"
            sibling = step is not None and dep.startswith(f"{step.workflow}-")
            if not sibling and not _known(state, dep):
                return f"depends ({kind}) on {dep!r}, which the scheduler does not know"
    return None
