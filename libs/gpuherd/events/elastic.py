"""Events of elastic jobs that grow and shrink while they run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from gpuherd.events.base import Command, Decision, Event, command_upcaster, reported_by, upcaster
from gpuherd.events.values import Allocation, Rendezvous, RescaleKind

# The rules of the elastic service's policy (``services/elastic/policy.py``). The service records the
# ones it decides by in ``ElasticConfigured`` and each proposal carries them, so every proposal is
# re-derived by the rules it was made by. 2: shrink for every waiting job that shrinks let start
# (at once, whatever the minimum interval), lend only GPUs no waiting job can use, one allowed size
# at a time to the job whose throughput gains most per GPU, and only where the gain over the
# minimum interval outweighs the rescale's pause. 3: a job that is stopping (cancelled, preempted,
# past its time limit) is neither grown nor shrunk. 4: a waiting job the scheduler holds back
# whatever GPUs are free (a dependency not met yet, its array's max_running reached) is not shrunk
# for, and no idle GPU is kept for it. 5: the same for a waiting job its VC's per-user limits hold
# back (max_running_per_user, max_gpus_per_user), unless shrinking its user's own elastic jobs in the
# VC lifts the hold (only those shrink for it); no job is grown past its user's GPU limit.
ELASTIC_RULES = 5


class RescaleProposed(Decision, kw_only=True, frozen=True):
    """The elastic service would run an elastic job at ``gpus`` GPUs: grow into GPUs that would
    stay idle, or shrink so that waiting jobs start. The scheduler, sole owner of GPUs, commits it
    (``JobResized``) if it still holds when it decides; a stale proposal changes nothing.

    v2: ``rules``, the version of the policy's rules it was decided by (v1: the first rules)."""

    VERSION: ClassVar[int] = 2
    v: int = 2
    rules: int = ELASTIC_RULES
    job: str
    attempt: int
    generation: int  # the generation it was based on
    gpus: int
    reason: str = ""
    expected_samples_per_s: float | None = None  # the policy's prediction at the new size

    def subject(self) -> str:
        return f"herd.job.{self.job}"


@upcaster("RescaleProposed", 1)
def _proposal_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "rules": 1, "v": 2}


class JobResized(Decision, kw_only=True, frozen=True):
    """A new generation of a running elastic job. Its workers, in rank order, are the GPUs of
    ``allocations`` (a worker is ``<node>/<gpu>``); they meet at ``rendezvous`` (a new store for
    every generation) and take the state of ``state_from``, the oldest surviving worker. ``joiners``
    are started now; GPUs in ``releasing`` stay the job's until the rescale ends (their workers
    take part in the switch, then leave)."""

    job: str
    attempt: int
    generation: int
    allocations: tuple[Allocation, ...]
    rendezvous: Rendezvous | None = None
    state_from: str = ""
    joiners: tuple[str, ...] = ()
    releasing: tuple[Allocation, ...] = ()
    kind: RescaleKind = "grow"
    reason: str = ""
    borrowed: int = 0  # GPUs beyond the VC's quota after the resize

    def subject(self) -> str:
        return f"herd.job.{self.job}"


RESCALE_PHASES = ("decided", "noticed", "quiesced", "reformed", "restored", "first_step")
"""The stamps of a rescale, in order: the scheduler committed it; the new rank 0 saw the plan;
training stopped at the old size (state committed in memory); the new group is up; the source's
state is in place on every rank; the first step at the new size is done."""


def complete_phase_times(times: Mapping[str, float | None], *, fallback: float = 0.0) -> dict[str, float]:
    """A stamp for every phase of ``RESCALE_PHASES``. A phase the record lacks took no time of its
    own: it gets the stamp of the next phase that has one (of the last known one at the end;
    ``fallback`` when none is known). Records of version 1 lacked some: a simulated switch had only
    ``decided`` and ``first_step`` (it is instantaneous: everything happens at its first step), and a
    job grown before its first generation had formed had no ``quiesced``."""
    known = {name: float(stamp) for name in RESCALE_PHASES if (stamp := times.get(name))}
    out: dict[str, float] = {}
    later: float | None = None
    for name in reversed(RESCALE_PHASES):
        later = known.get(name, later)
        if later is not None:
            out[name] = later
    last = next((known[name] for name in reversed(RESCALE_PHASES) if name in known), fallback)
    return {name: out.get(name, last) for name in RESCALE_PHASES}


class RescaleCompleted(Event, kw_only=True, frozen=True):
    """The job's new rank 0 finished its first step at the new size. ``times`` holds the wall-clock
    (event-time) stamp of every phase of ``RESCALE_PHASES`` (decided, noticed, quiesced, reformed,
    restored, first_step), so the pause and the total of every rescale can be told.

    v2: every phase is there (v1 records lacked some; the upcaster completes them as
    ``complete_phase_times`` says)."""

    VERSION: ClassVar[int] = 2
    v: int = 2

    job: str
    attempt: int
    generation: int
    node: str
    world: int
    world_before: int
    times: dict[str, float] = msgspec.field(default_factory=dict)
    samples_per_s_before: float | None = None  # measured throughput at the old size

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)

    def durations(self) -> dict[str, float]:
        t = self.times
        pairs = {
            "notice_s": ("decided", "noticed"),
            "wait_s": ("noticed", "quiesced"),
            "reform_s": ("quiesced", "reformed"),
            "restore_s": ("reformed", "restored"),
            "first_step_s": ("restored", "first_step"),
            "pause_s": ("quiesced", "first_step"),  # training stood still at either size
            "total_s": ("decided", "first_step"),
        }
        return {name: t[b] - t[a] for name, (a, b) in pairs.items() if a in t and b in t}


@upcaster("RescaleCompleted", 1)
def _rescale_completed_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    times = raw.get("times") if isinstance(raw.get("times"), dict) else {}
    raw["times"] = complete_phase_times(times, fallback=float(raw.get("at") or 0.0))
    raw["v"] = 2
    return raw


class RescaleFailed(Event, kw_only=True, frozen=True):
    """A switch to ``generation`` failed on a worker (it rolled back to the state committed at the
    old size). The scheduler commits a rollback generation of the workers that still hold state."""

    job: str
    attempt: int
    generation: int
    node: str
    reason: str
    step: int = 0  # the step the job rolled back to

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


class WorkerLost(Event, kw_only=True, frozen=True):
    """A worker of a running elastic job died outside a planned rescale. The job shrinks to the
    survivors while they are at least its minimum."""

    job: str
    attempt: int
    node: str
    gpu: int
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""

    def subject(self) -> str:
        return reported_by(f"herd.job.{self.job}", self.node)


# ---------------------------------------------------------------------------
# memory leases: spare memory of neighbor GPUs and pinned host memory (services/memory)


class ElasticConfigured(Command, kw_only=True, frozen=True):
    """The elastic service's parameters from now on (``services/elastic/policy.py:ElasticParams``;
    names not given keep their defaults) and the rules of its policy (``ELASTIC_RULES``; a service of
    newer rules records its own when it starts on a log of older ones). Recorded so that a replay
    audits with the parameters and rules each decision was made with.

    v3: ``rules`` (v2 and older were decided by the first rules)."""

    VERSION: ClassVar[int] = 3
    v: int = 3
    params: dict[str, float] = msgspec.field(default_factory=dict)
    rules: int = ELASTIC_RULES

    def subject(self) -> str:
        return "herd.cluster.elastic"


command_upcaster("ElasticConfigured")


@upcaster("ElasticConfigured", 2)
def _elastic_configured_v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "rules": 1, "v": 3}
