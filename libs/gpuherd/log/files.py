"""An event log as a file: one JSON event per line, line n holding sequence n.

Simulations write their log this way so it can be replayed and audited like a live one
(``gpuherd replay --log FILE --audit``) without a NATS server.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from gpuherd import events as ev
from gpuherd.errors import EventDecodeError, GpuherdError
from gpuherd.log.records import Record


class LogFileError(GpuherdError):
    """A log file that cannot be read."""


def write_log_file(records: Iterable[Record], path: str | Path) -> int:
    count = 0
    with Path(path).open("wb") as f:
        for expected, record in enumerate(records, 1):
            if record.seq != expected:
                raise LogFileError(f"records must be gap-free from 1: got seq {record.seq} at line {expected}")
            f.write(ev.encode(record.event))
            f.write(b"\n")
            count += 1
    return count


def read_log_file(path: str | Path) -> list[Record]:
    return list(iter_log_file(path))


def iter_log_file(path: str | Path) -> Iterator[Record]:
    """The file's records, a line at a time (a reader that folds as it reads holds none of them)."""
    path = Path(path)
    if not path.is_file():
        raise LogFileError(f"{path}: no such log file")
    with path.open("rb") as f:
        for seq, line in enumerate(f, 1):
            try:
                yield Record(seq, ev.decode(line))
            except EventDecodeError as exc:
                raise LogFileError(f"{path}:{seq}: {exc}") from None


def count_log_file(path: str | Path) -> int:
    """How many records the file holds: its lines, without decoding them, and a last line without
    a newline if it reads as an event (one half written by a writer still at work does not)."""
    count, tail = 0, b""
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            tail = (tail + chunk).rpartition(b"\n")[2] if b"\n" in chunk else tail + chunk
    if tail.strip():
        try:
            ev.decode(tail)
        except EventDecodeError:
            return count
        count += 1
    return count
