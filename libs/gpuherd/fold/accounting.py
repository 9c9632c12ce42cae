"""Accounting: the log folded into usage figures and the history of finished jobs (what Slurm's
``sreport`` and ``sacct`` answer), for ``gpuherd usage``, ``gpuherd history`` and the dashboard.

It is a fold of the events, so the same log always gives the same figures, and they are exact:
the GPU-seconds are the ones the core fold charges (``ClusterState.accounted``: each attempt from
its start to its end, at the GPUs it held, an elastic job at each of its sizes), the same the
scheduler charges to fair share. A charge spans the time since the job's previous charge; within
a period (``per``) or a window (``since``/``until``) it counts pro rata to the part of that span
inside it. Jobs are counted by how they ended, in the period of their end; the time each queued
(its first start less its submission), in the period of its first start. Usage of jobs still
running counts up to the log's newest event.

The fold holds the live jobs and the figures of each (group, period), never the history of every
job, unless it is asked to keep finished jobs' rows (``history``). It follows each job's life cycle
as the core fold does, as far as GPU-time goes (placements as the log has them, starts, resizes,
requeues, ends), and nothing else, and it can read events as the log stores them, decoding only
those and only what it reads of them (``fold_stored``): a long log folds fast.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import msgspec

from gpuherd import events as ev

GroupBy = Literal["vc", "user"]
Per = Literal["hour", "day", "week"]
_DAY = 86400.0
_WEEK_ORIGIN = 4 * _DAY  # 1970-01-05 was a Monday: ISO weeks start there


class Figures(msgspec.Struct, kw_only=True, gc=False):
    """What one group used in one period."""

    gpu_s: float = 0.0
    ended: dict[str, int] = msgspec.field(default_factory=dict)  # jobs by how they ended
    started: int = 0  # jobs whose first start falls in the period
    queued_s: float = 0.0  # their time queued, summed

    def add(self, other: Figures) -> None:
        self.gpu_s += other.gpu_s
        for outcome, n in other.ended.items():
            self.ended[outcome] = self.ended.get(outcome, 0) + n
        self.started += other.started
        self.queued_s += other.queued_s

    def row(self) -> dict[str, Any]:
        return {
            "gpu_seconds": self.gpu_s,
            "gpu_hours": self.gpu_s / 3600.0,
            "jobs": {outcome: self.ended.get(outcome, 0) for outcome in ev.OUTCOMES},
            "started": self.started,
            "avg_queue_s": self.queued_s / self.started if self.started else None,
        }


class FinishedJob(msgspec.Struct, kw_only=True, gc=False):
    """One finished job, as ``gpuherd history`` lists it (sacct's row)."""

    job: str
    name: str
    user: str
    vc: str
    state: str
    submitted: float
    start: float | None
    end: float
    gpus: int
    nodes: list[str]
    exit_code: int | None
    attempts: int
    gpu_seconds: float
    reason: str = ""
    workflow: str | None = None
    array: str | None = None


class _Live:
    """What accounting keeps of a job until it ends: who it is, and its attempt's use of GPUs as the
    core fold keeps it (``held`` GPUs, charged from ``service_from``, else its start)."""

    __slots__ = (
        "alloc",
        "array",
        "attempt",
        "elastic",
        "first_start",
        "generation",
        "gpu_s",
        "gpus",
        "group",
        "held",
        "name",
        "nodes",
        "releasing",
        "rescaling",
        "service_from",
        "started_at",
        "status",
        "submitted",
        "user",
        "vc",
        "workflow",
    )  # fmt: skip

    def __init__(self, spec: Any, at: float, group: tuple[str, ...]) -> None:
        self.name: str = spec.name
        self.user: str = spec.user
        self.vc: str = spec.vc
        self.gpus: int = spec.gpus
        self.submitted = at
        self.group = group
        self.workflow: str | None = spec.workflow_of.workflow if spec.workflow_of is not None else None
        self.array: str | None = spec.array_of.array if spec.array_of is not None else None
        self.elastic = spec.elastic is not None
        self.status = _PENDING
        self.attempt = 0
        self.held = 0
        self.started_at: float | None = None
        self.service_from: float | None = None
        self.first_start: float | None = None
        self.gpu_s = 0.0
        self.nodes: list[str] = []
        self.alloc: set[tuple[str, int]] = set()  # (elastic jobs) the GPUs of its generation
        self.releasing: set[tuple[str, int]] = set()  # (elastic jobs) GPUs its rescale in flight gives back
        self.generation = 0
        self.rescaling = False


_PENDING, _PLACED, _RUNNING = 0, 1, 2


def _gpus_of(allocations: Iterable[Any]) -> set[tuple[str, int]]:
    return {(a.node, g) for a in allocations for g in a.gpus}


# -- a fast path for stored events: decode only what accounting reads (the log's JSON lines) ----------


class _Alloc(msgspec.Struct, gc=False):
    node: str
    gpus: tuple[int, ...]


class _Member(msgspec.Struct, gc=False):
    workflow: str = ""
    array: str = ""


class _Spec(msgspec.Struct, gc=False):
    name: str
    user: str
    gpus: int
    vc: str = "default"
    elastic: Any = None
    workflow_of: _Member | None = None
    array_of: _Member | None = None


class _Submitted(msgspec.Struct, gc=False):
    job: str
    spec: _Spec
    at: float = 0.0


class _JobEvent(msgspec.Struct, gc=False):
    job: str
    attempt: int
    at: float = 0.0
    allocations: tuple[_Alloc, ...] = ()
    releasing: tuple[_Alloc, ...] = ()
    generation: int = 0
    outcome: str = ""
    exit_code: int | None = None
    reason: str = ""


class _At(msgspec.Struct, gc=False):
    at: float = 0.0


_JOB_EVENT = msgspec.json.Decoder(_JobEvent)
_SUBMITTED = msgspec.json.Decoder(_Submitted)
_AT = msgspec.json.Decoder(_At)
_TYPE_PREFIX = b'{"type":"'
_TYPE_AT = len(_TYPE_PREFIX)


_LABELS: dict[tuple[str, int], str] = {}


def period_of(at: float, per: Per | None) -> tuple[str, float]:
    """The label and start of the period (UTC hour or day, or ISO week from Monday) that holds ``at``."""
    if per is None:
        return "", -math.inf
    length = _period_length(per)
    origin = 0.0 if per == "day" else _WEEK_ORIGIN
    index = math.floor((at - origin) / length)
    start = index * length + origin
    label = _LABELS.get((per, index))
    if label is None:
        when = dt.datetime.fromtimestamp(start, dt.UTC)
        if per == "day":
            label = when.strftime("%Y-%m-%d")
        elif per == "hour":
            label = when.strftime("%Y-%m-%d %H:00")
        else:
            year, week, _ = when.isocalendar()
            label = f"{year}-W{week:02d}"
        _LABELS[(per, index)] = label
    return label, start


def _period_length(per: Per) -> float:
    return {"hour": 3600.0, "day": _DAY, "week": 7 * _DAY}[per]


class Accounting:
    """Folds a log into usage by ``by`` (vc, user, or both) and ``per`` period, within ``since`` to
    ``until`` (Unix seconds; None: unbounded); ``history`` keeps each finished job's row."""

    def __init__(
        self,
        *,
        by: Sequence[GroupBy] = ("vc",),
        per: Per | None = None,
        since: float | None = None,
        until: float | None = None,
        history: bool = False,
    ) -> None:
        for key in by:
            if key not in ("vc", "user"):
                raise ValueError(f"usage is grouped by vc, user or both; not {key!r}")
        if per not in (None, "hour", "day", "week"):
            raise ValueError(f"usage is given per hour, day or week; not {per!r}")
        self.by = tuple(dict.fromkeys(by))
        self.per = per
        self.since = -math.inf if since is None else since
        self.until = math.inf if until is None else until
        self.now = 0.0  # the newest event's time
        self.live: dict[str, _Live] = {}
        self.figures: dict[tuple[tuple[str, ...], str], Figures] = {}
        self.finished: list[FinishedJob] | None = [] if history else None
        self._period: tuple[float, float, str] = (-math.inf, math.inf, "") if per is None else (0.0, 0.0, "")
        self._starts: dict[str, float] = {}  # each period's start, by its label
        self._handlers: dict[str, Callable[[_Live, Any], None]] = {
            "JobPlaced": self._placed,
            "JobStarted": self._started,
            "JobResized": self._resized,
            "RescaleCompleted": self._rescaled,
            "JobRequeued": self._requeued,
            "JobFinished": self._finished,
        }
        # The stored events it reads (by the type at the start of their JSON): their decoder, their handler.
        self._stored: dict[bytes, tuple[msgspec.json.Decoder[Any], Callable[[Any], None]]] = {
            b"JobSubmitted": (_SUBMITTED, self._submitted),
            **{
                kind.encode(): (_JOB_EVENT, functools.partial(self._job_event, handler))
                for kind, handler in self._handlers.items()
            },
        }
        self._tail: bytes | None = None  # the last stored event read, if it was not decoded

    # -- folding ---------------------------------------------------------------------------------

    def fold(self, seq: int, event: ev.Event) -> None:
        """Fold one event of the log (``seq`` is its place in it; the figures need only the order)."""
        self._fold(type(event).__name__, event)

    def fold_stored(self, seq: int, data: bytes) -> None:
        """Fold one event as the log stores it (its JSON), decoding only what accounting reads: the
        fast path for a long log (``gpuherd usage --log``). Events that change no figure are not
        decoded (the time of the last of them is read when asked: it is the log's end); an event of
        an older shape is decoded in full (the upcasters)."""
        if data.startswith(_TYPE_PREFIX):
            end = data.find(b'"', _TYPE_AT)
            entry = self._stored.get(data[_TYPE_AT:end])
            if entry is None:
                self._tail = data
                return
            try:
                event = entry[0].decode(data)
            except msgspec.ValidationError:
                pass  # (an older shape: the full decoder upcasts it)
            else:
                self._tail = None
                entry[1](event)
                return
        self._tail = None
        self.fold(seq, ev.decode(data))

    def fold_all(self, records: Iterable[Any]) -> Accounting:
        for record in records:
            self.fold(record.seq, record.event)
        return self

    def _fold(self, kind: str, event: Any) -> None:
        if kind == "JobSubmitted":
            self._submitted(event)
            return
        handler = self._handlers.get(kind)
        if handler is None:
            if event.at > self.now:
                self.now = event.at
            return
        self._job_event(handler, event)

    def _job_event(self, handler: Callable[[_Live, Any], None], event: Any) -> None:
        if event.at > self.now:
            self.now = event.at
        live = self.live.get(event.job)
        if live is not None and event.attempt == live.attempt:
            handler(live, event)

    def _submitted(self, event: Any) -> None:
        if event.at > self.now:
            self.now = event.at
        if event.job in self.live or event.spec.gpus < 1:
            return  # (a second submission of an id changes nothing; nor does a spec intake would refuse)
        spec = event.spec
        group = tuple(spec.vc if key == "vc" else spec.user for key in self.by)
        self.live[event.job] = _Live(spec, event.at, group)

    # The job's life cycle as the core fold has it (``gpuherd.fold.core``), for what charges GPU-time.

    def _placed(self, live: _Live, e: Any) -> None:
        if live.status != _PENDING:
            return
        live.status = _PLACED
        live.held = sum(len(a.gpus) for a in e.allocations)
        live.service_from = None
        live.nodes = list(dict.fromkeys(a.node for a in e.allocations))
        if live.elastic:
            live.alloc, live.releasing, live.generation, live.rescaling = _gpus_of(e.allocations), set(), 0, False

    def _started(self, live: _Live, e: Any) -> None:
        if live.status != _PLACED:
            return
        live.status = _RUNNING
        live.started_at = e.at
        if live.first_start is None:
            live.first_start = e.at
            if self._within(e.at):
                figures = self._figures(live, e.at)
                figures.started += 1
                figures.queued_s += e.at - live.submitted

    def _resized(self, live: _Live, e: Any) -> None:
        if live.status == _PENDING or e.generation != live.generation + 1:
            return
        new = _gpus_of(e.allocations)
        releasing = (live.releasing | _gpus_of(e.releasing)) - new
        self._account(live, e.at)
        live.alloc, live.releasing = new, releasing
        live.held = len(new) + len(releasing)
        live.generation = e.generation
        live.rescaling = True
        live.nodes = list(dict.fromkeys(a.node for a in e.allocations))

    def _rescaled(self, live: _Live, e: Any) -> None:
        if live.status == _PENDING or e.generation != live.generation or not live.rescaling:
            return
        self._account(live, e.at)
        live.releasing = set()
        live.held = len(live.alloc)
        live.rescaling = False

    def _requeued(self, live: _Live, e: Any) -> None:
        if live.status == _PENDING:
            return
        self._account(live, e.at)
        live.status = _PENDING
        live.attempt += 1
        live.held = 0
        live.started_at = None

    def _finished(self, live: _Live, e: Any) -> None:
        self._account(live, e.at)
        del self.live[e.job]
        if self._within(e.at):
            ended = self._figures(live, e.at).ended
            ended[e.outcome] = ended.get(e.outcome, 0) + 1
        if self.finished is not None:
            self.finished.append(
                FinishedJob(
                    job=e.job,
                    name=live.name,
                    user=live.user,
                    vc=live.vc,
                    state=e.outcome,
                    submitted=live.submitted,
                    start=live.first_start,
                    end=e.at,
                    gpus=live.gpus,
                    nodes=live.nodes,
                    exit_code=e.exit_code,
                    attempts=e.attempt + 1,
                    gpu_seconds=live.gpu_s,
                    reason=e.reason,
                    workflow=live.workflow,
                    array=live.array,
                )
            )

    def _account(self, live: _Live, at: float) -> None:
        """Charge the GPU-time since the last charge (``core._account``)."""
        if live.status != _RUNNING or live.started_at is None:
            return
        start = live.service_from or live.started_at
        used = live.held * max(0.0, at - start)
        live.service_from = at
        live.gpu_s += used
        for when, share in self._spread(start, at, used):
            self._figures(live, when).gpu_s += share

    def _within(self, at: float) -> bool:
        return self.since <= at < self.until

    def _label(self, at: float) -> str:
        """The label of ``at``'s period (the last one looked up is kept: events come in time order)."""
        start, end, label = self._period
        if start <= at < end:
            return label
        if self.per is None:
            return ""
        label, start = period_of(at, self.per)
        self._period = (start, start + _period_length(self.per), label)
        self._starts[label] = start
        return label

    def _figures(self, live: _Live, at: float) -> Figures:
        key = (live.group, self._label(at))
        figures = self.figures.get(key)
        if figures is None:
            figures = self.figures[key] = Figures()
        return figures

    def _spread(self, start: float, end: float, used: float) -> Iterable[tuple[float, float]]:
        """(a time within each period, GPU-seconds in it) of a charge, within the window."""
        lo, hi = max(start, self.since), min(end, self.until)
        if end <= start:  # (an instant: all of it where it happened)
            if self._within(end):
                yield end, used
            return
        if hi <= lo:
            return
        rate = used / (end - start)
        if self.per is None:
            yield lo, rate * (hi - lo)
            return
        length = _period_length(self.per)
        at = lo
        while at < hi:
            boundary = min(hi, period_of(at, self.per)[1] + length)
            yield at, rate * (boundary - at)
            at = boundary

    # -- answers -----------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The figures per group and period (jobs still running: their use up to the log's end), and
        their total."""
        figures = {key: msgspec.structs.replace(f, ended=dict(f.ended)) for key, f in self.figures.items()}
        if self._tail is not None:  # the log ends with events not decoded: its end is the last one's time
            self.now = max(self.now, _AT.decode(self._tail).at)
            self._tail = None
        now = self.now
        for live in self.live.values():
            if live.status != _RUNNING or live.started_at is None:
                continue
            since = live.service_from or live.started_at
            used = live.held * max(0.0, now - since)
            for at, share in self._spread(since, now, used):
                key = (live.group, self._label(at))
                figures.setdefault(key, Figures()).gpu_s += share
        rows = []
        total = Figures()
        for (group, period), f in sorted(figures.items()):
            row: dict[str, Any] = dict(zip(self.by, group, strict=True))
            if self.per is not None:
                row["period"] = period
                row["period_start"] = self._starts[period]
            rows.append(row | f.row())
            total.add(f)
        return {
            "by": list(self.by),
            "per": self.per,
            "since": None if math.isinf(self.since) else self.since,
            "until": None if math.isinf(self.until) else self.until,
            "log_end": now,
            "running": sum(1 for live in self.live.values() if live.status != _PENDING),
            "rows": rows,
            "total": total.row(),
        }
