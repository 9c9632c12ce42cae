"""Snapshots of a fold: a cache of the log, kept in the snapshot bucket under the folder's name.

A snapshot carries the folder's state format and the sequence it was folded to. One of another
format, or one that does not read, is ignored (and the state rebuilt from the log): it can always
be rebuilt, so it is never trusted beyond what it says it is.
"""

from __future__ import annotations

import zlib

import msgspec

from gpuherd.aio import patiently
from gpuherd.errors import LogUnavailable
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
    except (msgspec.DecodeError, msgspec.ValidationError, zlib.error) as exc:
        log.warning("snapshot unreadable; rebuilding from the log", key=key, error=str(exc))
        return None
    if snap.v != state_format:
        log.warning("snapshot of another state format; rebuilding from the log", key=key, snapshot_format=snap.v)
        return None
    return snap


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
