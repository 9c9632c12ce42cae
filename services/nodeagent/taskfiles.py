"""The files of a task's folder, typed: what the agent writes for the task's shim, and what the
shim (and a worker from the warm pool) writes back. Both sides encode and decode these Structs.

``<data>/jobs/<job>/attempt-<n>/`` holds:

- ``task.json`` (``TaskDescription``, by the agent): the processes to start and how to supervise them;
- ``grow-NNNN.json`` (``GrowRequest``, by the agent): an elastic task's new workers; the shim
  renames each to ``grow-NNNN.json.started`` once it took it;
- ``stop.json`` (``StopRequest``, by the agent, before it signals the shim): why, and the grace;
- ``shim.json`` (``ShimInfo``, by the shim): its pid, process group and the processes it watches;
- ``dead-workers.json`` (a list of ``WorkerDeath``, by the shim): an elastic task's dead workers;
- ``exit.json`` (``ExitRecord``, by the shim; by the next agent for a shim that died without one): how
  the task ended;
- ``worker-N.exit`` (``WorkerExitRecord``, by a worker from the pool or the agent that reaped it).

A running task outlives its agent: an agent of a newer version adopts shims an older one started,
so every field a previous version did not write has a default, and the names are the ones the
files always had (a shim of the previous version reads ``grow-*.json`` and ``stop.json`` written by
this one).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import msgspec

from gpuherd.errors import UNDECODABLE

TASK_FILE = "task.json"
SHIM_FILE = "shim.json"
EXIT_FILE = "exit.json"
STOP_FILE = "stop.json"
DEAD_WORKERS_FILE = "dead-workers.json"
GROW_PATTERN = "grow-*.json"  # requests the shim has not taken yet
GROWN_PATTERN = "grow-*.json*"  # and those it took (``.started``)


class ProcLaunch(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One process of a task: a rank, or one worker of an elastic task."""

    argv: list[str]
    env: dict[str, str]
    log: str  # its output goes here
    gpu: int | None = None  # an elastic task's worker: the GPU it owns
    pid: int | None = None  # a worker taken from the warm pool runs already: the shim watches this pid
    pid_start: int = 0  # with ``pid``, names that very process (a pid may be reused)
    exit_file: str | None = None  # with ``pid``: where its exit code is written (``WorkerExitRecord``)
    generation: int | None = None  # an elastic task's worker: the job's generation it started in


class TaskDescription(msgspec.Struct, frozen=True, kw_only=True):
    """``task.json``: what the shim runs, and the rules it supervises by."""

    procs: list[ProcLaunch]
    alive_file: str  # touched by the agent while it is in contact with the log (fencing)
    fence_after_s: float
    kill_grace_s: float
    job: str = ""
    attempt: int = 0
    cwd: str | None = None
    elastic: bool = False
    agent_addr: str = ""  # the agent's control socket (dead workers are told there)
    node: str = ""


class GrowRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``grow-NNNN.json``: workers to add to a running elastic task (``task.json`` reads as one too)."""

    procs: list[ProcLaunch] = msgspec.field(default_factory=list)


class StopRequest(msgspec.Struct, frozen=True, kw_only=True):
    reason: str = ""
    checkpoint_grace_s: float = 0.0  # SIGUSR1 first, and this long to save a checkpoint


class ShimInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``shim.json``: written when the shim starts (pid and time only), again once its processes run."""

    pid: int
    started_at: float = 0.0
    start_ticks: int = 0  # when the shim started (clock ticks since boot): with ``pid`` it names it (0: not written)
    pgid: int | None = None
    pids: list[int] = msgspec.field(default_factory=list)  # per local rank (or worker), in launch order
    standby: int | None = None  # an elastic task's warm interpreter for its next worker
    attached: list[tuple[int, int]] = msgspec.field(default_factory=list)  # pooled workers: (pid, start ticks)
    launched_at: float | None = None


class WorkerDeath(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An elastic task's worker that ended with a code other than 0 (or could not start)."""

    gpu: int | None
    code: int
    reason: str = ""
    # The generation the worker started in: a worker started on the same GPU later (the job grew back
    # onto it) is another one, alive (None: a shim of a version before it; the death counts as before).
    generation: int | None = None


class ExitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """``exit.json``: every process's exit code, and the failure or stop that ended the task."""

    codes: list[int | None] = msgspec.field(default_factory=list)
    failure: str | None = None
    failed_rank: int | None = None
    stopped: str | None = None
    ended_at: float = 0.0
    # Each process's log, in the order of ``codes`` (the order the shim started them in, grown workers
    # included): ``failed_rank`` indexes it, so the output tail is the failed process's (empty: a
    # shim of a version before it).
    logs: list[str] = msgspec.field(default_factory=list)


class WorkerExitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """``worker-N.exit``: a pooled worker's exit code, by the worker itself or the agent that reaped it."""

    code: int
    by: str = ""


class StandbyLaunch(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The line a warm interpreter (``gpuherd.train.standby``) reads on its stdin to become a worker."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    log: str
    exit_file: str | None = None


T = TypeVar("T")


class UnreadableTaskFile(ValueError):
    """A task file that is there but not what its writer writes."""


def write(path: Path, data: msgspec.Struct | list) -> None:
    """Write atomically: a reader sees the old file or the whole new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(msgspec.json.encode(data))
    os.replace(tmp, path)


def read(path: Path, kind: type[T]) -> T | None:
    """The file decoded as ``kind``; None if it is not there (yet). One that is there but unreadable
    raises ``UnreadableTaskFile`` (naming the file and what is wrong)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=kind)
    except UNDECODABLE as exc:
        raise UnreadableTaskFile(f"{path}: {exc}") from exc
