"""Events of the cluster as a whole: virtual clusters, the scheduling policy, refused operator
commands, and the services' timers."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from gpuherd.events.base import Command, Decision, Event, command_upcaster, upcaster


class VcConfigured(Command, kw_only=True, frozen=True):
    """A virtual cluster: a team's share of the cluster.

    ``gpu_quota`` GPUs are its own (None: no quota, it may use any free GPU).
    With ``can_borrow`` its jobs may also run on idle GPUs beyond its quota;
    those borrowed GPUs are given back (by preemption) when a VC whose quota
    they fall under has jobs waiting. ``weight`` is its share under fair share.
    The scheduler refuses (``CommandRefused``) a negative quota or a weight that is not positive.

    Limits (None: none): a job's time limit when it gives none (``default_time_limit_s``) and the
    most it may ask for (``max_time_limit_s``); the GPUs one user's jobs may hold at once
    (``max_gpus_per_user``) and how many of one user's jobs may be placed or run at once
    (``max_running_per_user``). v3 added them.
    """

    VERSION: ClassVar[int] = 3
    v: int = 3
    vc: str
    gpu_quota: int | None = None
    can_borrow: bool = True
    weight: float = 1.0
    default_time_limit_s: float | None = None
    max_time_limit_s: float | None = None
    max_gpus_per_user: int | None = None
    max_running_per_user: int | None = None

    def subject(self) -> str:
        return f"herd.vc.{self.vc}"


# The rules of the scheduling pass (``services/scheduler/schedule.py``). A scheduler records the
# ones it decides by in ``PolicyConfigured``, so every pass is re-derived by the rules it was made
# by. 2: a VC's first job its quota stops is protected by a reservation, as the gang head is.
# 3: a duration prediction makes a pass only where it is used (a job of unknown duration, or a
# policy that ranks by predictions). 4: a job waits for its dependencies, its array's
# ``max_running`` and its VC's per-user limits; a time limit bounds a job's expected duration
# (backfill, reservations, forecasts). (No log of older rules holds a job with any of these.)
# 5: an elastic job's expected end runs its remaining work at its current size. 6: an elastic job
# that does not fit at the GPUs it asked for starts at the largest of its sizes that fits now.
# 7: a preemption stops only the victims whose GPUs the placement takes (and those the quota needs).
# 8: a job that must borrow beyond its VC's quota is considered after the jobs within their quota;
# a rescale proposed for a job that is stopping by the time it is decided is not committed.
# 9: what a VC borrows is its usage beyond its quota now, held by its newest placements first: only
# those are reclaimed, not the jobs whose ``borrowed`` (frozen at placement) outlived the borrowing.
# 10: SRTF counts a job's work done as its attained service, an elastic job's at each of its sizes
# (before, a resized job's GPU time before its resize counted twice, and its current size not at all).
# 11: a VC's first waiting job, which may preempt within its VC, is its first not held back (dependency,
# array or user limit): before, a held first job kept every job of its VC from preempting. A backfill
# reservation counts only GPUs its head can use: of nodes whose executor can run it, and per node for a
# gang split over nodes (then only jobs that end before its start overtake it).
# 12: an elastic job's rollback keeps only the committed workers whose GPUs it still holds (a recover
# gives a dead worker's GPU back, and another job may hold it by then). A grow is not committed where a
# job waiting for the victims it preempted would then no longer fit (its preemption counted on free GPUs).
# A rescale not reported done within ``rescale_timeout_s`` (a tick's time) is rolled back, or its
# attempt stopped where too few committed workers are left (its report is one datagram, and can be lost).
# 13: a VC's quota head's reservation counts a job placed by the same pass at the GPUs it was placed on
# (an elastic job started smaller counted at the size it asked for, and the quota looked freer than it was).
# 14: a gang split over nodes reserves the nodes it needs at its reserved start: a job behind it that runs
# past that start may use GPUs that leave it enough nodes with its per-node share (before, none).
SCHEDULING_RULES = 14


class PolicyConfigured(Command, kw_only=True, frozen=True):
    """The cluster's scheduling policy from now on (see ``services/scheduler/policy.py``).

    ``params`` tune it (e.g. ``half_life_s`` for fair share, ``thresholds_gpu_s`` for LAS). The
    scheduler applies it only if the policy and every parameter exist; otherwise it records a
    ``CommandRefused`` with the reason and the policy before it stays in force. ``rules``: the
    version of the pass's rules (``SCHEDULING_RULES``); a scheduler of newer rules records its
    own when it starts on a log of older ones."""

    VERSION: ClassVar[int] = 3
    v: int = 3
    policy: str
    backfill: bool = True
    params: dict[str, float] = msgspec.field(default_factory=dict)
    rules: int = SCHEDULING_RULES

    def subject(self) -> str:
        return "herd.cluster.policy"


command_upcaster("VcConfigured")
command_upcaster("PolicyConfigured")


@upcaster("VcConfigured", 2)
def _vc_v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    raw["v"] = 3  # (no limits: the defaults of the new fields)
    return raw


@upcaster("PolicyConfigured", 2)
def _policy_v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    raw["rules"] = 1  # recorded before the pass had versioned rules
    raw["v"] = 3
    return raw


class CommandRefused(Decision, kw_only=True, frozen=True):
    """An operator command (``command``: its event type; ``command_id``: its id) that the service
    applying it found invalid: it changed nothing, and ``reason`` says why. Recorded so that a bad
    value is never silently replaced by a default."""

    command: str
    command_id: str
    reason: str

    def subject(self) -> str:
        return f"herd.cluster.refused.{self.source or 'anon'}"


# ---------------------------------------------------------------------------
# timers: time reaches a decider as an event, so a replay decides the same


class Tick(Event, kw_only=True, frozen=True):
    """A service's timer went off. Each service has a tick type of its own (one writer per type),
    and only its own decider acts on it."""

    CATALOGUED: ClassVar[bool] = False

    def subject(self) -> str:
        return f"herd.clock.{self.source or 'anon'}"


# A ClockTicked with this timeout (and no nodes heard) only marks time: no node can have been
# silent that long, so it declares no loss. Simulations tick this way.
TICK_ONLY_TIMEOUT_S = 1e15


class ClockTicked(Tick, kw_only=True, frozen=True):
    """The scheduler's timer: a pass when its period is up, and node liveness.

    ``last_heard`` is when the scheduler last heard from each node (a heartbeat, or its own
    reconnect: an outage of the observer is no evidence against a node); it declares a node lost
    when a tick shows it silent for longer than ``lost_after_s``.

    v1 was every service's timer; v2 is the scheduler's alone (the others have their own types).
    """

    VERSION: ClassVar[int] = 2
    v: int = 2
    last_heard: dict[str, float] = msgspec.field(default_factory=dict)
    lost_after_s: float = TICK_ONLY_TIMEOUT_S


class LeadershipTaken(Event, kw_only=True, frozen=True):
    """An instance of a decider service took the lead (``instance``: its holder id). It is the fence
    of that leadership: the instance appends it with the subject's last sequence expected (so two
    cannot both take it), and every later append of that instance expects it to still be the last
    event of the subject. Once a newer leader appended its own, a former leader that wakes up (a
    paused process, a partition healed) has every append refused: it cannot act on stale state.
    Written by the decider runtime of each service; deciders never follow it."""

    service: str
    instance: str

    def subject(self) -> str:
        return leadership_subject(self.service)


def leadership_subject(service: str) -> str:
    """The subject whose last sequence fences ``service``'s leader."""
    return f"herd.cluster.leader.{service}"


class ElasticTicked(Tick, kw_only=True, frozen=True):
    """The elastic service's timer: minimum intervals and holds after a shrink end when due."""


class MemoryTicked(Tick, kw_only=True, frozen=True):
    """The memory broker's timer: lease expiries and revocation deadlines fire when due."""


class AnalyticsTicked(Tick, kw_only=True, frozen=True):
    """The analytics service's timer: energy saving samples demand and decides power."""


_TICK_OF = {"elastic": "ElasticTicked", "memory": "MemoryTicked", "analytics": "AnalyticsTicked"}


@upcaster("ClockTicked", 1)
def _clock_ticked_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """v1 ticks of the elastic, memory and analytics services become their own tick types; the
    scheduler's (and a simulation's) stay ClockTicked."""
    renamed = _TICK_OF.get(str(raw.get("source", "")))
    if renamed is not None:
        raw.pop("last_heard", None)
        raw.pop("lost_after_s", None)
        raw["type"] = renamed
        raw["v"] = 1
    else:
        raw["v"] = 2
    return raw
