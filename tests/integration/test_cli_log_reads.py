"""The CLI's reads of a live log, a record at a time: ``gpuherd why``, ``jobs``, ``replay --audit``,
the analytics tables and the rescales read the log as it goes instead of holding all of it (a
year's log does not fit in a CLI's memory). What they read must be the log, in order, whole, and
the same at each of a command's reads, however the server pages it."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from apps.cli import common
from apps.cli.common import LogReader, log_state, records_of
from gpuherd.fold import fold
from gpuherd.log import open_log
from gpuherd.natsd import NatsServer
from tests.unit.test_workflows import job, pipeline, simulate


@pytest.fixture
def history_in_nats(tmp_path: Path):
    """A short history of a workflow and an array, appended to a server of its own: (its events,
    the CLI's arguments naming that server)."""
    submitted = [(1.0, pipeline()), (2.0, job("sweep", duration=5, array={"count": 3}))]
    events = [r.event for r in simulate(submitted).records]
    with NatsServer(data_dir=tmp_path / "nats").start() as server:

        async def append() -> None:
            log_ = await open_log(server.url, name="history")
            try:
                for start in range(0, len(events), 5):  # (appends of several events: pages of positions)
                    await log_.append(events[start : start + 5])
            finally:
                await log_.close()

        asyncio.run(append())
        yield events, argparse.Namespace(nats_url=server.url, log=None, data_dir=None)


def test_records_of_reads_the_whole_log_in_order_a_chunk_at_a_time(history_in_nats, monkeypatch) -> None:
    events, args = history_in_nats
    monkeypatch.setattr(common, "READ_CHUNK", 4)
    records = list(records_of(args))
    assert [r.event for r in records] == events
    assert [r.seq for r in records] == sorted({r.seq for r in records})  # (positions: increasing, unique)
    assert log_state(args).jobs.keys() == fold((r.seq, r.event) for r in records).jobs.keys()


def test_every_read_of_a_log_reader_sees_the_same_records_though_the_log_grows(history_in_nats) -> None:
    events, args = history_in_nats

    async def two_reads() -> tuple[list, list]:
        async with LogReader.open(args) as reader:
            first = [record async for record in reader.read()]
            log_ = await open_log(args.nats_url, name="later")
            try:
                await log_.append(events[:1])  # (appended between the reads: not the command's log)
            finally:
                await log_.close()
            second = [record async for record in reader.read()]
        return first, second

    first, second = asyncio.run(two_reads())
    assert [r.event for r in first] == events and first == second


def test_every_read_of_a_log_file_sees_the_lines_it_had_when_first_opened(tmp_path: Path) -> None:
    from gpuherd import events as ev
    from gpuherd.log import Record
    from gpuherd.log.files import write_log_file

    submitted = [(1.0, pipeline())]
    records = simulate(submitted).records
    path = tmp_path / "events.jsonl"
    write_log_file(records[:-3], path)

    async def two_reads() -> tuple[list[Record], list[Record]]:
        async with LogReader.open(argparse.Namespace(log=str(path))) as reader:
            first = [record async for record in reader.read()]
            with path.open("ab") as f:  # (a simulation still writing it: a whole line, then half of one)
                f.write(ev.encode(records[-3].event) + b"\n" + ev.encode(records[-2].event)[:20])
            second = [record async for record in reader.read()]
        return first, second

    first, second = asyncio.run(two_reads())
    assert first == second == records[:-3]


def test_a_log_files_last_line_without_a_newline_is_read(tmp_path: Path) -> None:
    from gpuherd.log.files import write_log_file

    records = simulate([(1.0, pipeline())]).records
    path = tmp_path / "events.jsonl"
    write_log_file(records, path)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # (a file written by hand, or by another tool)

    async def read() -> list:
        async with LogReader.open(argparse.Namespace(log=str(path))) as reader:
            return [record async for record in reader.read()]

    assert asyncio.run(read()) == records
