"""Every catalogued event in one tagged union (the JSON field ``type`` names the class), so a single
typed decoder reads the whole log; old shapes go through the upcasters.

The union is made from ``EVENT_TYPES`` (each class registers itself when defined) and made again
when a type is added later (a plugin service's events, imported after this module)."""

from __future__ import annotations

from typing import Any, ClassVar, Union

import msgspec

from gpuherd.errors import UNDECODABLE, EventDecodeError
from gpuherd.events.base import CATALOGUE_GENERATION, EVENT_TYPES, UPCASTERS, Command, Event


def upcast(raw: dict[str, Any]) -> dict[str, Any]:
    """Bring a raw event dict up to its class's current version (following a rename, if any)."""
    while True:
        type_name = raw.get("type")
        cls = EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
        if cls is None:
            raise EventDecodeError(f"unknown event type {type_name!r}")
        version = int(raw.get("v", 1))
        if version >= cls.VERSION:
            return raw
        step = UPCASTERS.get((cls.__name__, version))
        if step is None:
            raise EventDecodeError(f"no upcaster for {cls.__name__} v{version} -> v{version + 1}")
        raw = step(dict(raw))
        if raw.get("type") == type_name and int(raw.get("v", version + 1)) <= version:
            raise EventDecodeError(f"the upcaster of {cls.__name__} v{version} did not raise the version")


class Unreadable(Event, kw_only=True, frozen=True):
    """A stored message that does not decode as an event. Readers make it (it is never written):
    deciders fold it as nothing, and their shell reports it as a dead letter, so one bad message
    neither stops every reader of the log nor vanishes."""

    CATALOGUED: ClassVar[bool] = False

    stored_subject: str
    reason: str
    data: bytes = b""

    def subject(self) -> str:
        return self.stored_subject


class _Codecs:
    """The union of the catalogued types and its decoders, made again when the catalogue changed."""

    def __init__(self) -> None:
        self.size = -1
        self.union: Any = None
        self.json: msgspec.json.Decoder[Any] | None = None

    def current(self) -> _Codecs:
        if self.size != CATALOGUE_GENERATION[0]:
            types = tuple(EVENT_TYPES[name] for name in sorted(EVENT_TYPES))
            self.union = Union[types]  # noqa: UP007 - a union of a runtime tuple of classes
            self.json = msgspec.json.Decoder(self.union)
            self.size = CATALOGUE_GENERATION[0]
        return self


_codecs = _Codecs()
_encoder = msgspec.json.Encoder()
_raw_decoder = msgspec.json.Decoder(dict[str, Any])


def any_event() -> Any:
    """The tagged union of every catalogued event type, for a typed decoder of events (msgpack, or
    events inside another structure): ``msgspec.msgpack.Decoder(list[any_event()])``."""
    return _codecs.current().union


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def _unforged(raw: dict[str, Any]) -> dict[str, Any]:
    """Only a v1 command, recorded before services checked commands, is applied unchecked: its
    upcaster says so. The flag stored with a later one was set by its writer, who may not exempt its
    own command from the check (a policy the rules refuse would have been applied)."""
    if raw.get("unchecked") and int(raw.get("v", 1)) >= 2:
        return {**raw, "unchecked": False}
    return raw


def as_decoded(event: Event) -> bool:
    """Whether ``event``, read by a typed decoder of the union (``any_event``), is what ``decode``
    makes of the same bytes: of its class's current version, and no command claiming the exemption
    only v1 commands have (``_unforged``). Where it is not, decode its bytes with ``decode``."""
    return event.v == type(event).VERSION and not (isinstance(event, Command) and event.unchecked)


def decode(data: bytes) -> Event:
    """Decode one stored event; old versions go through the upcasters."""
    codecs = _codecs.current()
    try:
        event = codecs.json.decode(data)  # type: ignore[union-attr]
    except msgspec.ValidationError:
        event = None  # possibly an older shape: take the slow path
    except UNDECODABLE as exc:
        raise EventDecodeError(f"not an event: {exc}") from exc
    if event is not None and event.v == type(event).VERSION:
        if isinstance(event, Command) and event.unchecked:
            return msgspec.structs.replace(event, unchecked=False)  # (see _unforged)
        return event
    try:
        raw = _raw_decoder.decode(data)
        return msgspec.convert(upcast(_unforged(raw)), codecs.union)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"invalid event: {exc}") from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a field an upcaster needs is unusable
        raise EventDecodeError(f"invalid event: {type(exc).__name__}: {exc}") from exc
