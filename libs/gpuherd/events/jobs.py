"""Events of a job (subject ``herd.job.<id>``, ``.by.<node>`` when an agent writes it): its life cycle
from submission to its end, and profiles of its steps."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from gpuherd.events.base import Command, Decision, Event, command_upcaster, reported_by, upcaster
from gpuherd.events.values import Allocation, JobSpec, Locality, Outcome, PartOutcome, Rendezvous

# The rules intake judges by (``services/scheduler/intake.py``); each verdict records the ones it
# was judged by, so the audit re-judges it by the same. 2: a job larger than its VC's quota, in a
# VC that may not borrow, is refused (it could never start). 3: dependencies, arrays, workflows,
# time limits (a VC's default filled in, its maximum checked) and per-user limits. 4: an elastic
# job's ``max`` is at most ``MAX_ELASTIC_WORLD`` GPUs. 5: a gang needs as many nodes as it asks for
# that hold its share of GPUs (a mixed cluster may have fewer), and no integer of a spec lies beyond
# what a snapshot holds (64 bits). 6: an empty array is refused for what it is (`array.count` below
# 1, or no `array.values`), not as "too large" (the audit compares a rejection's reason). 7: a
# workflow with an out-of-range number (``1e999``) is refused for it, with its path, not as a job
# spec with an unknown field `workflow`. 8: a submission under an intake id that made jobs already is
# judged against them, before anything of the state: the same jobs with the same specs are a
# duplicate (answered with the recorded ids, whatever the VC's limits are now); another shape (an
# array's count, a workflow's steps) or spec is refused. Before, only the first job's intake id was
# looked up, and a duplicate was judged on its new payload. 9: a submission that is not UTF-8 is
# refused for that, with the bad byte's offset (before, a bad byte inside a string made the judging
# fail, and the live decider refused it as "failed to judge"). 10: a spec's ``scaling`` needs a
# positive, finite ``compute_per_sample_s`` and ``grad_bytes`` within 0..2**64-1, and a
# ``duration_s`` must be finite (before, a zero compute time was accepted and the elastic service
# divided by it at every tick); a NUL byte in ``command``, an ``env`` value, ``workdir`` or an
# array's ``values`` is refused (no process can be started with one, and such a job was
# requeued forever). 11: a submission refused for its source names that source in its reason (it is
# recorded as ``_invalid``: before, the reason alone did not say which subject was wrong).
INTAKE_RULES = 11


class JobSubmitted(Decision, kw_only=True, frozen=True):
    """A valid submission from intake; the job exists from here on. An array or a workflow is one
    submission of several jobs: intake writes one ``JobSubmitted`` per job, all in one atomic append
    (so all of them or none), each with the same ``intake_seq``.

    v3: the spec may carry dependencies, a time limit, and the array or workflow it belongs to."""

    VERSION: ClassVar[int] = 3
    v: int = 3
    job: str
    spec: JobSpec
    intake_source: str
    intake_seq: int = 0
    intake_rules: int = INTAKE_RULES

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobRejected(Decision, kw_only=True, frozen=True):
    """An invalid submission, kept with its reason so nothing is dropped silently."""

    VERSION: ClassVar[int] = 2
    v: int = 2
    intake_source: str
    intake_seq: int
    intake_id: str | None = None
    reason: str
    payload_excerpt: str = ""  # the first bytes of the submission, for the submitter to see
    payload_size: int = 0  # bytes of the whole submission (0: not recorded, before v2)
    intake_rules: int = INTAKE_RULES

    def subject(self) -> str:
        return f"herd.rejected.{self.intake_source}"


@upcaster("JobSubmitted", 1)
@upcaster("JobRejected", 1)
def _verdict_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    raw["intake_rules"] = 1
    raw["v"] = 2
    return raw


@upcaster("JobSubmitted", 2)
def _submitted_v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    raw["v"] = 3  # (the spec's new fields are absent from a v2 spec: their defaults say what it meant)
    return raw


class JobPlaced(Decision, kw_only=True, frozen=True):
    """The scheduler gave GPUs to a job attempt (all of its gang at once)."""

    job: str
    attempt: int
    allocations: tuple[Allocation, ...]  # the first allocation's node leads the gang (rank 0)
    reason: str = ""
    locality: Locality | None = None  # the tightest level the whole gang fits in
    rendezvous: Rendezvous | None = None
    borrowed: int = 0  # GPUs beyond its VC's quota when placed (what is reclaimable later: SchedulerState.borrowing)

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobStarted(Decision, kw_only=True, frozen=True):
    """An agent started its part of a job attempt."""

    job: str
    attempt: int
    node: str

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


class JobFinished(Decision, kw_only=True, frozen=True):
    """A job reached a terminal state. A finished job never runs again."""

    job: str
    attempt: int
    outcome: Outcome
    node: str = ""
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""  # the last lines of the deciding process's output
    metrics: dict[str, float] | None = None  # the last metrics rank 0 reported (loss, steps, ...)

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class TaskEnded(Event, kw_only=True, frozen=True):
    """One node's part (task) of a job attempt ended. The scheduler settles the attempt once
    every part has ended: completed, failed (retry or not), or requeued."""

    job: str
    attempt: int
    node: str
    outcome: PartOutcome
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""
    metrics: dict[str, float] | None = None

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


class JobTimeLimitReached(Decision, kw_only=True, frozen=True):
    """The scheduler's timer found a running attempt past its time limit (``limit_s`` of run time,
    from its start). Agents stop its parts as for a cancel (SIGTERM, then SIGKILL after their kill
    grace); once all have stopped the attempt ends as ``timeout`` (never retried)."""

    job: str
    attempt: int
    limit_s: float

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobCancelRequested(Command, kw_only=True, frozen=True):
    job: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.job.{self.job}"


command_upcaster("JobCancelRequested")


class JobDurationPredicted(Decision, kw_only=True, frozen=True):
    """A duration model's estimate of how long a job runs (QSSF, SJF and backfill use it).
    ``basis`` says what history it came from (e.g. ``vc+gpus: 40 jobs``). A job may be predicted
    again while it has not ended (when jobs submitted with it finish): the latest one counts.

    v2: ``seconds`` is the median of a log-normal whose log-spread is ``sigma`` (0: a point
    estimate), so a policy can rank by any quantile; ``user_history`` is how many of the user's
    finished jobs the model knew (0: none, the prediction rests on the cluster's history);
    ``version`` is the model's version (its refit count) and ``features`` a digest of the
    feature vector it was given, so an audit can re-derive it. v1 records read as point estimates
    of an unversioned model."""

    VERSION: ClassVar[int] = 2
    v: int = 2

    job: str
    seconds: float
    model: str = ""
    basis: str = ""
    sigma: float = 0.0
    user_history: int = 0
    version: int = 0
    features: str = ""

    def subject(self) -> str:
        return f"herd.job.{self.job}"


@upcaster("JobDurationPredicted", 1)
def _job_duration_predicted_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    raw.setdefault("sigma", 0.0)
    raw.setdefault("user_history", 0)
    raw.setdefault("version", 0)
    raw.setdefault("features", "")
    raw["v"] = 2
    return raw


class JobPreempted(Decision, kw_only=True, frozen=True):
    """The scheduler takes a running attempt's GPUs back. Agents send the checkpoint signal
    (SIGUSR1), wait ``grace_s``, then stop the task; the attempt is then requeued."""

    job: str
    attempt: int
    reason: str
    by: str = ""  # the job the GPUs go to, if one
    grace_s: float = 30.0

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class JobRequeued(Decision, kw_only=True, frozen=True):
    """A placed or running attempt ended without finishing the job; it waits again."""

    job: str
    attempt: int  # the attempt that ended; the next one is attempt + 1
    reason: str

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class ProfileRequested(Event, kw_only=True, frozen=True):
    """Someone asks a running job for a per-layer profile of ``steps`` of its own training steps
    (``gpuherd profile --job``). The agents running it pass the request to the job's leader rank."""

    job: str
    steps: int = 5

    def subject(self) -> str:
        return f"herd.job.{self.job}"


class ProfileReported(Event, kw_only=True, frozen=True):
    """A rank's per-layer profile of its own steps (``gpuherd.train.profile.StepProfile.to_dict()``:
    per layer forward/backward time, FLOPs, bytes, memory; the device's measured roofs)."""

    job: str
    attempt: int
    node: str
    rank: int
    request: str = ""  # the ProfileRequested id it answers
    profile: dict[str, Any] = msgspec.field(default_factory=dict)

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


# ---------------------------------------------------------------------------
# elastic jobs: grow and shrink while running
