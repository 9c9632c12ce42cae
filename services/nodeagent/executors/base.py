"""The executor interface: what a node has (inventory, samples) and how a task runs on it.

A *task* is one node's part of a job attempt: the processes of that node's
ranks (or, for ``sim``, a timer). The agent decides what should run from the
log; an executor only carries it out and says how it ended: it puts a ``TaskExit``
on its ``exits`` queue for every task that ended by itself, and the agent takes them
from there (an executor never calls the agent).
"""

from __future__ import annotations

import abc
import asyncio
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from gpuherd.control import RescaleReport
from gpuherd.events import GpuInfo, JobSpec, Rendezvous
from gpuherd.jobenv import ElasticPlan
from services.nodeagent.taskfiles import WorkerDeath


class TaskKey(NamedTuple):
    job: str
    attempt: int


class TaskLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to start this node's part of a job attempt."""

    key: TaskKey
    spec: JobSpec
    gpus: tuple[int, ...]  # this node's GPUs for the job
    group_rank: int = 0  # this node's index in the gang (0 leads)
    rank_offset: int = 0  # the global rank of this node's first process
    world_size: int = 1
    procs: int = 1  # processes on this node
    rendezvous: Rendezvous | None = None
    resume: bool = False  # the log says it started here before an agent restart: adopt, never start twice
    elapsed_s: float = 0.0  # how long it has been running, when resumed
    attained_s: float = 0.0  # work its earlier attempts did (a checkpointed sim job does only the rest)
    elastic: bool = False  # one worker per GPU, each named <node>/<gpu>; workers come and go with rescales
    generation: int = 0  # elastic: the job's generation its workers start in (a death names its worker's)


class TaskExit(msgspec.Struct, frozen=True, kw_only=True):
    key: TaskKey
    outcome: Literal["completed", "failed", "stopped"]
    exit_code: int | None = None
    reason: str = ""
    output_tail: str = ""


class TaskWorkers(msgspec.Struct, frozen=True, kw_only=True):
    """An elastic task's workers, as its folder has them."""

    launched: frozenset[int] = frozenset()  # the GPUs with a worker started (at the start or by a grow)
    dead: tuple[WorkerDeath, ...] = ()  # the current worker of each GPU, if it died, as the task's shim recorded it
    # The GPUs whose current worker left at a rescale (it said so): it takes no part in any later
    # generation, so one that names its GPU again needs a new worker there.
    left: frozenset[int] = frozenset()
    # The last rescale a worker of the task reported completed (its datagram may not have reached the agent).
    rescaled: RescaleReport | None = None


class GpuSample(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One telemetry reading of one GPU; None where the hardware does not say."""

    index: int
    utilization_pct: float | None = None
    memory_used_mb: float | None = None
    power_w: float | None = None
    temperature_c: float | None = None
    ecc_uncorrected: int | None = None
    xid: int | None = None  # the last critical XID error seen since the previous sample
    healthy: bool = True
    problem: str = ""  # why it is unhealthy


class Executor(abc.ABC):
    kind: str
    node: str = ""  # set by the agent; process executors pass it to the job (GPUHERD_NODE)
    agent_addr: str = ""  # the agent's control socket, for executors whose jobs can talk to it
    alive_file: Path | None = None  # touched by the agent while it is in contact with the log

    def __init__(self) -> None:
        self.exits: asyncio.Queue[TaskExit] = asyncio.Queue()  # tasks that ended, unless the agent stopped them

    @abc.abstractmethod
    def inventory(self, node: str) -> list[GpuInfo]: ...

    @abc.abstractmethod
    async def start(self, launch: TaskLaunch) -> None:
        """Run the task (or adopt it, when ``launch.resume``); how it ends goes on ``exits``,
        unless the agent stopped it."""

    @abc.abstractmethod
    async def stop(self, key: TaskKey, reason: str, *, checkpoint_grace_s: float = 0.0) -> TaskExit | None:
        """Stop the task if it runs and wait until nothing of it is left; None if it did not run.

        With ``checkpoint_grace_s`` > 0 its processes first get SIGUSR1 (save a checkpoint and exit)
        and that long to do it, before SIGTERM and SIGKILL."""

    @abc.abstractmethod
    def running(self) -> set[TaskKey]: ...

    async def recover(self) -> set[TaskKey]:
        """After an agent restart: take back the tasks still running from before (those that
        ended while no agent was there go on ``exits``)."""
        return set()

    def sample(self) -> list[GpuSample]:
        return []

    def attempts(self, job: str) -> list[int]:
        """The attempts of ``job`` this node has output of."""
        return []

    def output(self, key: TaskKey, max_bytes: int = 65536) -> dict[str, str]:
        """The task's captured output, per log file (the last ``max_bytes`` of each)."""
        return {}

    def request_profile(self, key: TaskKey, request: str, steps: int) -> bool:
        """Leave a profile request where the task's processes look for it; False if this
        executor's tasks cannot profile (no processes)."""
        return False

    def profile_result(self, key: TaskKey, name: str) -> bytes | None:
        """A profile a task's process wrote (``name`` as its report says), or None."""
        return None

    def write_plan(self, key: TaskKey, plan: ElasticPlan) -> bool:
        """Hand an elastic job's current generation to the task's workers; False if this executor
        runs no processes (or the task is not here)."""
        return False

    def write_task_file(self, key: TaskKey, name: str, text: str) -> bool:
        """Replace file ``name`` in the task's folder at once (the job's processes read it); False if
        this executor runs no processes (or the task is not here)."""
        return False

    def grow(self, key: TaskKey, launch: TaskLaunch) -> bool:
        """Start more workers in a running elastic task (``launch.gpus``: the new ones)."""
        return False

    def workers(self, key: TaskKey) -> TaskWorkers:
        """The elastic task's workers: those started, and those that died (none: no processes)."""
        return TaskWorkers()

    async def shutdown(self) -> None:
        """The agent is stopping. By default its tasks stop too."""
        for key in list(self.running()):
            await self.stop(key, "agent shutting down")
