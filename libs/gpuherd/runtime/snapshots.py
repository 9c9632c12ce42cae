"""Snapshots of a fold: a cache of the log, kept in the snapshot bucket under the folder's name.

A snapshot carries the folder's state format and the sequence it was folded to. One of another
format, or one that does not read, is ignored (and the state rebuilt from the log): it can always
be rebuilt, so it is never trusted beyond what it says it is. Nor is one folded beyond the log's
head (``beyond_the_log``): it was taken of another log.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import msgspec

from gpuherd.aio import patiently
from gpuherd.errors import UNDECODABLE, LogUnavailable
from gpuherd.log import SNAPSHOT_BUCKET
from gpuherd.log.interfaces import KeyValue
from gpuherd.obs import get_logger

log = get_logger("gpuherd.runtime")


class Snapshot(msgspec.Struct):
    v: int  # the folder's state format when it was taken
    seq: int
    state: bytes


async def load_snapshot(store: KeyValue, key: str, state_format: int) -> Snapshot | None:
    """The snapshot under ``key`` if there is one of ``state_format`` that reads; else None."""
    try:
        data = await patiently(lambda: store.kv_get(SNAPSHOT_BUCKET, key), what="snapshot", patience_s=60)
    except LogUnavailable:
        return None  # only a cache: rebuilt from the log instead
    if data is None:
        return None
    try:
        snap = msgspec.msgpack.decode(zlib.decompress(data), type=Snapshot)
    except (*UNDECODABLE, zlib.error) as exc:
        log.warning("snapshot unreadable; rebuilding from the log", key=key, error=str(exc))
        return None
    if snap.v != state_format:
        log.warning("snapshot of another state format; rebuilding from the log", key=key, snapshot_format=snap.v)
        return None
    return snap


def beyond_the_log(key: str, seq: int, head: int) -> bool:
    """Whether a state loaded from a snapshot is folded beyond the log's ``head`` (warned, with why).
    The log only grows, so such a snapshot was taken of another log: the stream recreated, or
    restored from an older backup, while the snapshot bucket survived. Trusted, its reader would
    read from past the head and fold nothing until the new log grew that long."""
    if seq <= head:
        return False
    log.warning(
        "snapshot is beyond the log's head (the stream was recreated or restored from an older backup); "
        "rebuilding from the log",
        key=key,
        snapshot_seq=seq,
        head=head,
    )
    return True


async def save_snapshot(store: KeyValue, key: str, state_format: int, seq: int, state: bytes) -> int | None:
    """Store a snapshot; its size in bytes, or None when it could not be stored (a missed snapshot
    costs a longer catch-up, nothing else)."""
    data = zlib.compress(msgspec.msgpack.encode(Snapshot(v=state_format, seq=seq, state=state)), 1)
    try:
        await store.kv_put(SNAPSHOT_BUCKET, key, data)
    except Exception as exc:
        log.warning("snapshot not saved", key=key, error=repr(exc), bytes=len(data))
        return None
    return len(data)


@dataclass
class Cadence:
    """When a fold's next snapshot is due: ``every`` events after the last one, or ``interval_s``
    after it if anything was folded since (a quiet fold is not snapshotted again and again).
    Events are counted as they are folded (``folded``): log positions are not contiguous (a page
    of events spans a message's positions), so a distance between positions counts nothing."""

    every: int
    interval_s: float
    seq: int = 0  # the position the last snapshot (saved or loaded) was folded to
    at: float = field(default_factory=time.monotonic)
    since: int = 0  # events folded since that snapshot

    def folded(self, events: int = 1) -> None:
        self.since += events

    def due(self, seq: int) -> bool:
        return seq > self.seq and (self.since >= self.every or time.monotonic() - self.at >= self.interval_s)

    def taken(self, seq: int) -> None:
        self.seq, self.at, self.since = seq, time.monotonic(), 0

    def missed(self) -> None:
        """A snapshot could not be stored: the next try is a whole cadence later. (Tried again at every
        quiescent moment, a state too large for the server was encoded and sent after every event.)
        The last one stored stays what a restart starts from."""
        self.at, self.since = time.monotonic(), 0
