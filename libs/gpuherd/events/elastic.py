"""Events of elastic jobs that grow and shrink while they run."""

from __future__ import annotations

import msgspec

from gpuherd.events.base import Command, Decision, Event, command_upcaster, reported_by
from gpuherd.events.values import Allocation, Rendezvous, RescaleKind


class RescaleProposed(Decision, kw_only=True, frozen=True):
    """The elastic service would run an elastic job at ``gpus`` GPUs: grow into GPUs that would
    stay idle, or shrink so that waiting jobs start. The scheduler, sole owner of GPUs, commits it
    (``JobResized``) if it still holds when it decides; a stale proposal changes nothing."""

    job: str
    attempt: int
    generation: int  # the generation it was based on
    gpus: int
    reason: str = ""
    expected_samples_per_s: float | None = None  # the policy's prediction at the new size

    def subject(self) -> str:
        return f"herd.job.{self.job}"


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


class RescaleCompleted(Event, kw_only=True, frozen=True):
    """The job's new rank 0 finished its first step at the new size. ``times`` are wall-clock
    (event-time) stamps of each phase: decided, noticed, quiesced, reformed, restored, first_step."""

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
            "pause_s": ("quiesced", "first_step"),
            "total_s": ("decided", "first_step"),
        }
        return {name: t[b] - t[a] for name, (a, b) in pairs.items() if a in t and b in t}


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
    names not given keep their defaults). Recorded so that a replay audits with the parameters each
    decision was made with."""

    params: dict[str, float] = msgspec.field(default_factory=dict)

    def subject(self) -> str:
        return "herd.cluster.elastic"


command_upcaster("ElasticConfigured")
