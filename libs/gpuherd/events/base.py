"""The base of every event, and the helpers their definitions share.

Every event has ``id`` (also the JetStream ``Nats-Msg-Id``, so appends are idempotent), ``at``
(event time, Unix seconds), ``source`` (who wrote it) and ``v`` (its schema version). Decisions,
events a service writes in reaction to the log, also carry ``based_on`` (the last stream sequence
the decider had folded) and ``cause`` (the id of the event that triggered them); an audit re-runs
the decider on the state at ``based_on`` and checks it would decide the same again.

Defining a class registers it: every subclass of ``Event`` goes into ``EVENT_TYPES`` (and so into
the codec's union and ``gpuherd.events``) unless its own body says ``CATALOGUED = False`` (the bases
``Command``, ``Decision``, ``Tick``, and ``Unreadable``, which readers make and nobody writes).

When a class changes shape its ``VERSION`` goes up and an *upcaster* (registered with
``@upcaster`` beside the class) turns the stored old shape into the next one on read, so the log
is never rewritten (the ``eventsourcing`` library's approach). An upcaster may also rename the
type, when one old type became several (``ClockTicked`` of other services than the scheduler).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from gpuherd.jobenv import worker_id as worker_id

# Every event type by name, filled as the classes are defined (``Event.__init_subclass__``).
EVENT_TYPES: dict[str, type[Event]] = {}
# Bumped on every registration (a class defined again replaces its name's entry without growing
# the table), so codecs built from the catalogue know when they are stale.
CATALOGUE_GENERATION = [0]


class Event(msgspec.Struct, kw_only=True, frozen=True, tag_field="type", tag=True, gc=False):
    """Base of every event. ``VERSION`` is the current schema version of the class."""

    VERSION: ClassVar[int] = 1
    CATALOGUED: ClassVar[bool] = False  # (read from each class's own body: a subclass is catalogued)

    id: str = ""
    at: float = 0.0
    source: str = ""
    v: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("CATALOGUED", True):
            catalogue(cls)

    def subject(self) -> str:
        """The subject of the aggregate this event belongs to (one per job, node, ...)."""
        raise NotImplementedError


def catalogue(cls: type[Event]) -> None:
    """Register an event type under its class name (the ``type`` field of its stored form). A name
    is one type: a second class of that name is refused, unless it is the same class defined again
    (a module imported twice)."""
    known = EVENT_TYPES.get(cls.__name__)
    if (
        known is not None
        and known is not cls
        and (known.__module__, known.__qualname__)
        != (
            cls.__module__,
            cls.__qualname__,
        )
    ):
        raise TypeError(
            f"two event types named {cls.__name__}: {known.__module__}.{known.__qualname__} and "
            f"{cls.__module__}.{cls.__qualname__}; the stored type field must name one class"
        )
    EVENT_TYPES[cls.__name__] = cls
    CATALOGUE_GENERATION[0] += 1


def uncatalogue(name: str) -> None:
    """Forget an event type (a plugin unloaded); records of it then decode as unreadable."""
    if EVENT_TYPES.pop(name, None) is not None:
        CATALOGUE_GENERATION[0] += 1


class Command(Event, kw_only=True, frozen=True):
    """An operator's command (a VC, the policy, a drain, a cancel, a service's parameters). The service
    that applies it checks it there and records ``CommandRefused`` with the reason for one it cannot
    apply, which then changes nothing.

    v1 commands were recorded before services checked them: they upcast with ``unchecked`` set and
    are applied the way they were then (a bad policy or parameter meant the service's default)."""

    CATALOGUED: ClassVar[bool] = False
    VERSION: ClassVar[int] = 2
    v: int = 2
    unchecked: bool = False


def _command_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    raw["unchecked"] = True
    raw["v"] = 2
    return raw


def command_upcaster(event_type: str) -> None:
    """Register the v1 -> v2 upcaster of a command type (every command gained ``unchecked``)."""
    UPCASTERS[(event_type, 1)] = _command_v1_to_v2


class Decision(Event, kw_only=True, frozen=True):
    """An event a service decided on, from the log it had folded up to ``based_on``."""

    CATALOGUED: ClassVar[bool] = False

    based_on: int = 0
    cause: str = ""


def reported_by(aggregate: str, node: str) -> str:
    """The subject of an event a node's agent writes: its aggregate's subject tagged with the node
    (``herd.job.<id>.by.<node>``), so NATS permissions can hold each agent to its own node."""
    return f"{aggregate}.by.{node}" if node else aggregate


# ---------------------------------------------------------------------------
# value types


def stable_id(*parts: str, length: int = 12) -> str:
    """A short deterministic id from its inputs (safe as a NATS subject token)."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()
    return digest[:length]


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register a function turning version ``from_version`` of ``event_type`` into the next one."""

    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(event_type, from_version)] = fn
        return fn

    return register
