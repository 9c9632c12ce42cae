"""What every command group shares: where NATS is, reading the log, printing.

The NATS address comes from ``--nats-url``, else ``NATS_URL``, else the cluster file
that ``gpuherd up`` writes in its data folder, else nats://127.0.0.1:4222. The data folder is
``--data-dir``, else ``GPUHERD_DATA_DIR``, else ``.gpuherd``: in this folder or, as git finds its
repository, the nearest parent folder that has one with a cluster file (so a command run in a
subfolder of where ``up`` ran finds the cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from gpuherd.client import Client
from gpuherd.errors import GpuherdError
from gpuherd.fold import ClusterState, apply
from gpuherd.log import EventLog, Record, open_log
from gpuherd.runtime.decider import Decider

# Tables of many columns stay whole where no terminal says how wide it is (a pipe, a log, CI): rich
# would take 80 columns and cut job ids short.
console = Console(width=None if sys.stdout.isatty() else 160)
DEFAULT_DATA_DIR = ".gpuherd"
CLUSTER_FILE = "cluster.json"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def cluster_file(args: argparse.Namespace) -> Path | None:
    """The cluster file of ``gpuherd up`` that this command should use, if there is one: in the data
    folder given, or (the default folder's name) in the nearest parent folder that has one."""
    data_dir = Path(getattr(args, "data_dir", None) or DEFAULT_DATA_DIR)
    if (data_dir / CLUSTER_FILE).exists():
        return data_dir / CLUSTER_FILE
    if data_dir != Path(DEFAULT_DATA_DIR):
        return None  # (a folder named on purpose is not looked for elsewhere)
    for folder in Path.cwd().parents:
        if (folder / DEFAULT_DATA_DIR / CLUSTER_FILE).exists():
            return folder / DEFAULT_DATA_DIR / CLUSTER_FILE
    return None


def nats_url_of(args: argparse.Namespace) -> str:
    if getattr(args, "nats_url", None):
        return args.nats_url
    if os.environ.get("NATS_URL"):
        return os.environ["NATS_URL"]
    cluster = cluster_file(args)
    if cluster is not None:
        return msgspec.json.decode(cluster.read_bytes())["nats_url"]
    return DEFAULT_NATS_URL


def nats_monitor_urls(args: argparse.Namespace) -> list[str]:
    """The NATS servers' monitoring endpoints: ``NATS_MONITOR_URL`` (comma-separated), else the
    embedded server's, from the cluster file of ``gpuherd up``; none when neither says."""
    if os.environ.get("NATS_MONITOR_URL"):
        return [u.strip() for u in os.environ["NATS_MONITOR_URL"].split(",") if u.strip()]
    if getattr(args, "nats_url", None) or os.environ.get("NATS_URL"):
        return []
    cluster = cluster_file(args)
    if cluster is not None:
        url = msgspec.json.decode(cluster.read_bytes()).get("nats_monitor_url")
        return [url] if url else []
    return []


CLI_NATS_PATIENCE_S = 10.0  # how long a command waits for NATS and its JetStream


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__  # (a timeout's text is empty)


def _where_to_look(args: argparse.Namespace) -> str:
    """What to do when NATS does not answer: is a cluster up, and is it the one meant?"""
    if getattr(args, "nats_url", None) or os.environ.get("NATS_URL") or cluster_file(args) is not None:
        return "is `gpuherd up` running, or NATS_URL set?"
    data_dir = getattr(args, "data_dir", None) or DEFAULT_DATA_DIR
    return (
        f"no cluster file ({Path(data_dir) / CLUSTER_FILE}) here or in a parent folder: run the command where "
        "`gpuherd up` ran, or pass --data-dir (its data folder), --nats-url or NATS_URL"
    )


async def open_cli_log(args: argparse.Namespace) -> EventLog:
    """The log, or GpuherdError saying why not. A server that answers without JetStream, or without
    gpuherd's streams, says so itself (a LogError from the log, at once): only a server that does not
    answer at all gets here as a timeout or a connection error."""
    url = nats_url_of(args)
    try:
        return await asyncio.wait_for(open_log(url, name="gpuherd-cli", persistent=False), CLI_NATS_PATIENCE_S)
    except TimeoutError:
        raise GpuherdError(
            f"no answer from NATS at {url} within {CLI_NATS_PATIENCE_S:.0f}s: {_where_to_look(args)}"
        ) from None
    except (OSError, nats.errors.Error) as exc:
        raise GpuherdError(f"cannot reach NATS at {url}: {_where_to_look(args)} ({_reason(exc)})") from None


class LogReader:
    """The log read a record at a time, as often as a command needs: every read runs from the start
    to ``last``, where the log ended at the first read, so each sees the same records. Nothing of
    the log is held (a year's log does not fit in a CLI's memory). From ``--log FILE`` (a
    simulation's) or from NATS; ``async with LogReader.open(args) as reader``."""

    def __init__(self, last: int, read: Callable[[], AsyncIterator[Record]]) -> None:
        self.last = last
        self._read = read

    def read(self) -> AsyncIterator[Record]:
        return self._read()

    @staticmethod
    @contextlib.asynccontextmanager
    async def open(args: argparse.Namespace) -> AsyncIterator[LogReader]:
        path = getattr(args, "log", None)
        if path:
            from gpuherd.log.files import count_log_file, iter_log_file

            list(itertools.islice(iter_log_file(path), 1))  # (a missing file is said before anything runs)
            lines = count_log_file(path)  # (the whole lines now: a simulation may be writing it still)

            async def from_file() -> AsyncIterator[Record]:
                for record in itertools.islice(iter_log_file(path), lines):
                    yield record

            yield LogReader(lines, from_file)
            return
        log_ = await open_cli_log(args)
        try:
            last = await log_.last_seq()
            yield LogReader(last, lambda: log_.read(1, stop=last))
        finally:
            await log_.close()


async def each_record(reader: LogReader, take: Callable[[Record], None], progress: Progress, what: str) -> None:
    """One read of the log, each record to ``take``, with a progress bar saying ``what``."""
    task = progress.add_task(what, total=reader.last)
    async for record in reader.read():
        take(record)
        if record.seq % 1024 == 0:
            progress.update(task, completed=record.seq)
    progress.update(task, completed=reader.last)


READ_CHUNK = 4096  # records ``records_of`` takes from NATS at a time


def records_of(args: argparse.Namespace) -> Iterator[Record]:
    """The log a record at a time, for code that takes an iterable (an analytics table, the
    rescales): what was read is let go as it is taken. From ``--log FILE`` or from NATS (read a
    chunk at a time on a loop of its own, so the caller need not be async)."""
    if getattr(args, "log", None):
        from gpuherd.log.files import iter_log_file

        yield from iter_log_file(args.log)
        return
    loop = asyncio.new_event_loop()
    try:
        log_ = loop.run_until_complete(open_cli_log(args))
        try:
            last = loop.run_until_complete(log_.last_seq())
            reading = log_.read(1, stop=last)
            while chunk := loop.run_until_complete(_next_chunk(reading)):
                yield from chunk
            loop.run_until_complete(reading.aclose())  # type: ignore[attr-defined] - (an async generator)
        finally:
            loop.run_until_complete(log_.close())
    finally:
        loop.close()


async def _next_chunk(reading: AsyncIterator[Record]) -> list[Record]:
    chunk: list[Record] = []
    async for record in reading:
        chunk.append(record)
        if len(chunk) >= READ_CHUNK:
            break
    return chunk


class Folding:
    """One fold of the log as it is read: the core fold (every job the log ever held, as the CLI
    shows history too), or ``decider``'s own (its state). ``take`` each record; ``state`` so far."""

    def __init__(self, decider: Decider[Any] | None = None) -> None:
        self.decider = decider
        self.state: Any = ClusterState() if decider is None else decider.initial_state()

    def take(self, record: Record) -> None:
        if self.decider is None:
            apply(self.state, record.seq, record.event)
        else:
            self.state = self.decider.evolve(self.state, record.seq, record.event)


def read_log(args: argparse.Namespace, *takers: Callable[[Record], None]) -> int:
    """One read of the log, each record to every one of ``takers`` (nothing of it held); how many
    records it held."""

    async def run() -> int:
        events = 0
        async with LogReader.open(args) as reader:
            async for record in reader.read():
                for take in takers:
                    take(record)
                events += 1
        return events

    return asyncio.run(run())


def log_state(args: argparse.Namespace, decider: Decider[Any] | None = None) -> Any:
    """The log's state by one ``Folding``, folded as the log is read."""
    folding = Folding(decider)
    read_log(args, folding.take)
    return folding.state


def client_call(args: argparse.Namespace, call: Callable[[Client], Awaitable[Any]], *, source: str = "cli") -> Any:
    """Connect as a client, make one call, close."""

    async def run() -> Any:
        from gpuherd.log.jetstream import jetstream_off

        client = await Client.connect(nats_url_of(args), source=source)
        try:
            # Without JetStream a submission is never stored and no verdict comes: say why now, not
            # after the submission's timeout (one request, answered at once).
            off = await jetstream_off(client.nc)
            if off is not None:
                raise GpuherdError(off)
            return await call(client)
        finally:
            await client.close()

    return asyncio.run(run())


def policy_names(text: str) -> list[str]:
    """A comma-separated list of scheduling policies, each checked before anything runs."""
    from services.scheduler.policy import POLICIES

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise GpuherdError(
            f"unknown policies: {', '.join(unknown) or '(none given)'}; choose from {', '.join(sorted(POLICIES))}"
        )
    return names


def print_json(data: Any) -> None:
    sys.stdout.write(msgspec.json.encode(data).decode() + "\n")


def plain(value: object) -> str:
    """A value from the log or the command line (a job's name, a user, a reason) as rich prints it
    as written: read as markup, a job named ``exp[lr=0.1]`` lost its brackets and one whose reason
    held ``[/x]`` stopped the command with a MarkupError."""
    return escape(str(value))


def fmt_time(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


def fmt_datetime(ts: float | None) -> str:
    """A time with its date, in the local zone (a listing that spans days: ``gpuherd history``)."""
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def name_values(items: list[str] | None) -> dict[str, float]:
    """``--param NAME=NUMBER`` options as a dict."""
    params = {}
    for item in items or []:
        key, _, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            raise GpuherdError(f"--param wants NAME=NUMBER, got {item!r}") from None
        if not math.isfinite(number):  # (JSON has no infinity: it would be stored as null, unreadable)
            raise GpuherdError(f"--param {key} must be a finite number, got {value!r}")
        params[key] = number
    return params


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``30m``, ``2h``, ``1d``, ``1w`` or ``[D-]HH:MM:SS`` (Slurm's)."""
    value = text.strip().lower()
    try:
        if ":" in value:
            days, _, clock = value.rpartition("-")
            parts = [float(p) for p in clock.split(":")]
            if len(parts) > 3:
                raise ValueError
            seconds = sum(p * 60.0**i for i, p in enumerate(reversed(parts)))
            seconds += float(days) * 86400.0 if days else 0.0
        else:
            seconds = float(value[:-1]) * _UNITS[value[-1]] if value and value[-1] in _UNITS else float(value)
        if not math.isfinite(seconds) or seconds < 0:  # (JSON has no infinity: it would be stored as null)
            raise ValueError
        return seconds
    except ValueError:
        raise GpuherdError(
            f"not a duration: {text!r} (a finite time, at least 0: e.g. 3600, 90m, 2h, 1d, 1-12:00:00)"
        ) from None


def parse_when(text: str, *, now: float | None = None) -> float:
    """Unix seconds from a date or time (``2024-05-01``, ``2024-05-01T12:00``; UTC unless it says),
    Unix seconds, or a time ago (``7d``, ``12h``)."""
    import datetime as dt

    value = text.strip()
    if value and value[-1].lower() in _UNITS and value[:-1].replace(".", "", 1).isdigit():
        return (time.time() if now is None else now) - parse_duration(value)
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise GpuherdError(f"not a date: {text!r} (e.g. 2024-05-01, 2024-05-01T12:00, 7d for 7 days ago)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()
