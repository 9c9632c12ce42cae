"""A snapshot larger than one NATS message may carry. A fold's state grows with what it keeps (the
scheduler's intake index, for one): past the server's ``max_payload`` (1 MB unless an operator
raised it) every snapshot was refused, and each restart read the log from the start. Such a
snapshot is now stored in parts, under a manifest written last."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from structlog.testing import capture_logs

from gpuherd.log import SNAPSHOT_BUCKET, InProcessLog, open_log
from gpuherd.natsd import NatsServer
from gpuherd.runtime import snapshots
from gpuherd.runtime.snapshots import PART_BYTES, load_snapshot, part_key, save_snapshot

KEY = "scheduler"
FORMAT = 7


def state_of(size: int) -> bytes:
    return os.urandom(size)  # (incompressible: the compressed snapshot is as large)


async def test_a_snapshot_over_the_servers_max_payload_is_stored_in_parts(tmp_path: Path) -> None:
    with NatsServer(data_dir=tmp_path / "nats", extra_config="max_payload: 1MB\n").start() as server:
        log = await open_log(server.url, name="parts")
        try:
            assert log.nc.max_payload == 1024 * 1024  # (what a server says when nobody raised it)
            big = state_of(3 * 1024 * 1024)
            assert await save_snapshot(log, KEY, FORMAT, 10, big) is not None
            snap = await load_snapshot(log, KEY, FORMAT)
            assert snap is not None and (snap.seq, snap.state) == (10, big)

            smaller = state_of(PART_BYTES + 1000)  # two parts, in the other slot
            assert await save_snapshot(log, KEY, FORMAT, 20, smaller) is not None
            snap = await load_snapshot(log, KEY, FORMAT)
            assert snap is not None and (snap.seq, snap.state) == (20, smaller)
            again = state_of(PART_BYTES + 1000)  # the first slot again: its parts beyond two are removed
            assert await save_snapshot(log, KEY, FORMAT, 30, again) is not None
            keys = set(await log.kv_entries(SNAPSHOT_BUCKET))
            assert keys == {KEY, *(part_key(KEY, slot, n) for slot in (0, 1) for n in range(2))}

            small = b"a small state"  # stored whole again: no part is left
            assert await save_snapshot(log, KEY, FORMAT, 40, small) is not None
            snap = await load_snapshot(log, KEY, FORMAT)
            assert snap is not None and (snap.seq, snap.state) == (40, small)
            assert set(await log.kv_entries(SNAPSHOT_BUCKET)) == {KEY}
        finally:
            await log.close()


class DiesHalfWay(InProcessLog):
    """Its second part of a snapshot is never stored (the saver crashed, the server went away)."""

    dying = False

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        if self.dying and key.endswith(".1"):
            raise ConnectionError("gone")
        await super().kv_put(bucket, key, value)


async def test_a_save_that_dies_half_way_leaves_the_last_snapshot_whole() -> None:
    log = DiesHalfWay()
    first = state_of(2 * PART_BYTES + 10)
    assert await save_snapshot(log, KEY, FORMAT, 10, first) is not None
    log.dying = True
    assert await save_snapshot(log, KEY, FORMAT, 20, state_of(2 * PART_BYTES + 10)) is None
    snap = await load_snapshot(log, KEY, FORMAT)
    assert snap is not None and (snap.seq, snap.state) == (10, first)


async def test_parts_that_do_not_match_their_manifest_are_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "READ_TRIES", 2)
    log = InProcessLog()
    assert await save_snapshot(log, KEY, FORMAT, 10, state_of(2 * PART_BYTES)) is not None
    await log.kv_put(SNAPSHOT_BUCKET, part_key(KEY, 0, 1), b"rewritten by another save")
    with capture_logs() as logs:
        assert await load_snapshot(log, KEY, FORMAT) is None  # rebuilt from the log instead
    assert any("do not match their manifest" in entry["event"] for entry in logs)


class CannotPurge(InProcessLog):
    async def kv_purge(self, bucket: str, key: str) -> None:
        raise ConnectionError("gone")


async def test_a_whole_snapshot_replaces_one_in_parts_only_once_the_parts_are_removed() -> None:
    """Its manifest stays until then: parts a failed removal left are still known to the next save
    (written over by the whole snapshot first, they would stay for good)."""
    log = CannotPurge()
    first = state_of(PART_BYTES + 1000)  # (two parts)
    assert await save_snapshot(log, KEY, FORMAT, 10, first) is not None
    with capture_logs() as logs:
        assert await save_snapshot(log, KEY, FORMAT, 20, b"small again") is None  # missed: tried a cadence later
    assert any(entry["event"] == "snapshot not saved" for entry in logs)
    snap = await load_snapshot(log, KEY, FORMAT)
    assert snap is not None and snap.state == first, "the last snapshot stands"


class DiesBeforeItsManifest(InProcessLog):
    """Its manifest of a snapshot in parts is never stored (the saver died after the parts)."""

    dying = False
    parts_written = 0

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        if self.dying and key == KEY:
            raise ConnectionError("gone")
        self.parts_written += self.dying
        await super().kv_put(bucket, key, value)


async def test_what_a_failed_save_left_in_a_slot_is_removed_by_the_next_save_there() -> None:
    log = DiesBeforeItsManifest()
    assert await save_snapshot(log, KEY, FORMAT, 10, state_of(PART_BYTES + 1000)) is not None  # slot 0
    log.dying = True
    assert await save_snapshot(log, KEY, FORMAT, 20, state_of(5 * PART_BYTES)) is None
    assert log.parts_written == 6  # in slot 1, which no manifest names
    log.dying = False
    assert await save_snapshot(log, KEY, FORMAT, 30, state_of(PART_BYTES + 1000)) is not None  # slot 1 again
    two_each = {KEY, *(part_key(KEY, slot, n) for slot in (0, 1) for n in (0, 1))}
    assert set(await log.kv_entries(SNAPSHOT_BUCKET)) == two_each
    assert await save_snapshot(log, KEY, FORMAT, 40, b"whole") is not None
    assert set(await log.kv_entries(SNAPSHOT_BUCKET)) == {KEY}


async def test_a_manifest_naming_no_slot_is_not_trusted_and_does_not_stop_later_saves() -> None:
    log = InProcessLog()
    bad = snapshots.PARTS_MAGIC + msgspec.msgpack.encode({"slot": 2, "parts": 1, "size": 1, "crc": 0})
    await log.kv_put(SNAPSHOT_BUCKET, KEY, bad)
    assert await load_snapshot(log, KEY, FORMAT) is None
    assert await save_snapshot(log, KEY, FORMAT, 10, state_of(PART_BYTES + 1000)) is not None
    snap = await load_snapshot(log, KEY, FORMAT)
    assert snap is not None and snap.seq == 10


class PurgeFailsOnce(InProcessLog):
    """Its second removal of a part fails, once (a removal that stops half-way through a slot)."""

    purges = 0

    async def kv_purge(self, bucket: str, key: str) -> None:
        self.purges += 1
        if self.purges == 2:
            raise ConnectionError("gone")
        await super().kv_purge(bucket, key)


async def test_a_removal_that_stops_half_way_leaves_no_part_the_next_save_misses() -> None:
    log = PurgeFailsOnce()
    assert await save_snapshot(log, KEY, FORMAT, 10, state_of(2 * PART_BYTES)) is not None  # (three parts)
    assert await save_snapshot(log, KEY, FORMAT, 20, b"whole") is None  # one part removed, then a failure
    assert await save_snapshot(log, KEY, FORMAT, 30, b"whole") is not None
    assert set(await log.kv_entries(SNAPSHOT_BUCKET)) == {KEY}
