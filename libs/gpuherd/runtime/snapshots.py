"""Snapshots of a fold: a cache of the log, kept in the snapshot bucket under the folder's name.

A snapshot carries the folder's state format and the sequence it was folded to. One of another
format, or one that does not read, is ignored (and the state rebuilt from the log): it can always
be rebuilt, so it is never trusted beyond what it says it is. Nor is one folded beyond the log's
head (``beyond_the_log``): it was taken of another log.

A snapshot larger than ``PART_BYTES`` (compressed) is stored in parts, and the key holds their
manifest, written last: a state that outgrows what one NATS message may carry (the server's
``max_payload``, 1 MB unless raised) is still snapshotted. Parts go to one of two slots
(``<key>.parts.<slot>.<n>``), the one the manifest does not name, so a save that fails or dies
half-way leaves the last snapshot whole; what it left in its slot is removed by the next save
there (a save removes the run of parts beyond its own). A reader checks the parts against the
manifest's checksum; one that finds them rewritten under it (two saves while it read) reads the
manifest again.
"""

from __future__ import annotations

import asyncio
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


PART_BYTES = 512 * 1024  # one part of a large snapshot: well under NATS's default max_payload (1 MB)
PARTS_MAGIC = b"gpuherd-snapshot-parts\n"  # a manifest's first bytes (a snapshot's are zlib's)
READ_TRIES = 3  # manifests read while parts change under a reader


class SnapshotParts(msgspec.Struct):
    """What the key of a snapshot stored in parts holds: where its parts are and how to check them."""

    slot: int  # 0 or 1
    parts: int
    size: int  # bytes in all
    crc: int  # zlib.crc32 of them


def part_key(key: str, slot: int, n: int) -> str:
    return f"{key}.parts.{slot}.{n}"


def _manifest(data: bytes | None) -> SnapshotParts | None:
    """The manifest ``data`` holds; None where it holds a whole snapshot (or nothing). A manifest
    that does not read, or names no slot, raises one of ``UNDECODABLE``."""
    if data is None or not data.startswith(PARTS_MAGIC):
        return None
    manifest = msgspec.msgpack.decode(data[len(PARTS_MAGIC) :], type=SnapshotParts)
    if manifest.slot not in (0, 1) or manifest.parts < 1:
        raise msgspec.ValidationError(f"not a manifest of snapshot parts: {manifest}")
    return manifest


async def load_snapshot(store: KeyValue, key: str, state_format: int) -> Snapshot | None:
    """The snapshot under ``key`` if there is one of ``state_format`` that reads; else None."""
    try:
        data = await _stored(store, key)
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


async def _stored(store: KeyValue, key: str) -> bytes | None:
    """The snapshot's bytes as saved: the value under ``key``, or the parts its manifest names."""

    async def get(name: str) -> bytes | None:
        return await patiently(lambda: store.kv_get(SNAPSHOT_BUCKET, name), what="snapshot", patience_s=60)

    for _ in range(READ_TRIES):
        data = await get(key)
        try:
            manifest = _manifest(data)
        except UNDECODABLE as exc:
            log.warning("snapshot manifest unreadable; rebuilding from the log", key=key, error=str(exc))
            return None
        if manifest is None:
            return data
        parts = [await get(part_key(key, manifest.slot, n)) for n in range(manifest.parts)]
        whole = b"".join(part or b"" for part in parts)
        if len(whole) == manifest.size and zlib.crc32(whole) == manifest.crc:
            return whole
        await asyncio.sleep(0.1)  # rewritten under it by two saves: their manifest is written last
    log.warning("snapshot parts do not match their manifest; rebuilding from the log", key=key, tries=READ_TRIES)
    return None


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
    """Store a snapshot (``pack_snapshot``, ``store_snapshot``)."""
    return await store_snapshot(store, key, pack_snapshot(state_format, seq, state))


def pack_snapshot(state_format: int, seq: int, state: bytes) -> bytes:
    """A snapshot of an encoded state, as stored (compressed)."""
    return zlib.compress(msgspec.msgpack.encode(Snapshot(v=state_format, seq=seq, state=state)), 1)


async def store_snapshot(store: KeyValue, key: str, data: bytes) -> int | None:
    """Store a packed snapshot; its size in bytes, or None when it could not be stored (a missed
    snapshot costs a longer catch-up, nothing else). One over ``PART_BYTES`` is stored in parts: in
    the slot the manifest does not name, then the parts beyond them there (an earlier, larger
    snapshot's, or a failed save's) are removed, then the manifest is written. One stored whole that
    replaces a snapshot in parts first removes the parts (its manifest stays until they are gone,
    so a failure leaves them known to the next save)."""
    try:
        try:
            before = _manifest(await store.kv_get(SNAPSHOT_BUCKET, key))
        except UNDECODABLE:
            before = None  # (a slot's parts are then overwritten, and those beyond removed, in time)
        if len(data) <= PART_BYTES:
            if before is not None:
                await _purge_from(store, key, 1 - before.slot, 0)
                await _purge_from(store, key, before.slot, 0)
            await store.kv_put(SNAPSHOT_BUCKET, key, data)
            return len(data)
        slot = 1 - before.slot if before is not None else 0  # (the other slot holds the last snapshot)
        parts = -(-len(data) // PART_BYTES)
        for n in range(parts):
            await store.kv_put(SNAPSHOT_BUCKET, part_key(key, slot, n), data[n * PART_BYTES : (n + 1) * PART_BYTES])
        try:
            await _purge_from(store, key, slot, parts)
        except Exception as exc:  # (they only take room: removed by a later save in this slot)
            log.warning("parts of an older snapshot not removed", key=key, slot=slot, error=repr(exc))
        manifest = SnapshotParts(slot=slot, parts=parts, size=len(data), crc=zlib.crc32(data))
        await store.kv_put(SNAPSHOT_BUCKET, key, PARTS_MAGIC + msgspec.msgpack.encode(manifest))
    except Exception as exc:
        log.warning("snapshot not saved", key=key, error=repr(exc), bytes=len(data))
        return None
    return len(data)


async def _purge_from(store: KeyValue, key: str, slot: int, first: int) -> None:
    """Remove the slot's parts from part ``first`` on. Every save writes its parts from 0 up, and
    parts are removed from the last down, so a slot holds one run of parts from 0 whatever failed:
    those from ``first`` are found by reading on until one is missing."""
    names = []
    while await store.kv_get(SNAPSHOT_BUCKET, name := part_key(key, slot, first + len(names))) is not None:
        names.append(name)
    for name in reversed(names):
        await store.kv_purge(SNAPSHOT_BUCKET, name)


@dataclass
class Cadence:
    """When a fold's next snapshot is due: ``every`` events after the last one, or ``interval_s``
    after it if anything was folded since (a quiet fold is not snapshotted again and again).
    Events are counted as they are folded (``folded``): log positions are not contiguous (a page
    of events spans a message's positions), so a distance between positions counts nothing.

    A snapshot that cost ``cost_s`` to make (``taken``) puts the next one off until ``cost_s /
    share`` has passed: a large state under a fast log (the duration model's training rows, some
    7 MB, at 10,000 events a second) would otherwise be encoded and compressed every second, a
    tenth of its service's time; so snapshots take at most ``share`` of it, and a restart folds at
    most that much longer a tail of the log."""

    every: int
    interval_s: float
    share: float = 0.02
    seq: int = 0  # the position the last snapshot (saved or loaded) was folded to
    at: float = field(default_factory=time.monotonic)
    since: int = 0  # events folded since that snapshot
    not_before: float = 0.0  # (monotonic) the time the last one's cost puts the next one off to

    def folded(self, events: int = 1) -> None:
        self.since += events

    def due(self, seq: int) -> bool:
        if seq <= self.seq:
            return False
        now = time.monotonic()
        return now >= self.not_before and (self.since >= self.every or now - self.at >= self.interval_s)

    def taken(self, seq: int, cost_s: float = 0.0) -> None:
        self.seq, self.at, self.since = seq, time.monotonic(), 0
        self.not_before = self.at + cost_s / self.share

    def missed(self) -> None:
        """A snapshot could not be stored: the next try is a whole cadence later. (Tried again at every
        quiescent moment, a state too large for the server was encoded and sent after every event.)
        The last one stored stays what a restart starts from."""
        self.at, self.since = time.monotonic(), 0
