"""The node agent: register, heartbeat, sample, and reconcile this node's tasks with the log.

The agent folds what concerns its node (``state.py``) and, for every job an event touches, runs the
pure reconcile step (``reconcile.py``: the log and a snapshot of what runs, to actions) and carries
out its actions with the executor, one by one, deciding nothing itself. Its parts:

- ``Agent`` (here): its life cycle, the ``follow`` loop (fold the log; reconcile each job an
  event touches, each job in a task of its own so one job's slow stop never holds up another's
  start), carrying out the reconcile step's actions, and the ``exits`` loop (the tasks that ended,
  from the executor's queue);
- ``upkeep.py``: heartbeats and the node's leadership, GPU telemetry (health, memory use, lease renewals);
- ``messages.py``: what the job's processes report over the control socket (``gpuherd.control``);
- ``power.py``: powering the node down and up; ``writer.py``: how it writes to the log.

What it writes: ``JobStarted`` when it starts its part, ``TaskEnded`` when its part ends
(completed, failed with the output's tail, or stopped because the attempt is ending elsewhere),
and what the job's processes report. Every id is derived from what the event is about, so a
repeat after a crash changes nothing (the log drops it by its id, or, stored twice through a report
relay's page, every reader folds the second copy as nothing new).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import Gauge

from gpuherd import events as ev
from gpuherd.aio import run_until_stopped
from gpuherd.errors import UNDECODABLE
from gpuherd.log import EventLog, Leadership, open_log
from gpuherd.log.jetstream import JetStreamLog
from gpuherd.log.relay import RelayClient
from gpuherd.metrics import ServiceMetrics, serve_until_signal_with_http, status_reporter
from gpuherd.obs import configure, current_traceparent, get_logger, span_from
from gpuherd.runtime.deadletters import report_unreadable
from gpuherd.runtime.runner import SHUTDOWN_REQUEST_TIMEOUT_S, unless_stopped
from gpuherd.runtime.serve import close_promptly, run_process
from gpuherd.runtime.snapshots import Cadence, beyond_the_log, load_snapshot, save_snapshot
from gpuherd.service_args import service_parser
from services.nodeagent import leases
from services.nodeagent.control_socket import ControlSocket, control_address
from services.nodeagent.executors import Executor, TaskExit, TaskKey, make_executor
from services.nodeagent.executors.base import TaskWorkers
from services.nodeagent.messages import JobMessages
from services.nodeagent.power import PowerSwitch
from services.nodeagent.reconcile import (
    Action,
    AgentEvents,
    Record,
    RecordEnd,
    ReportLostWorker,
    RequestLease,
    StartTask,
    StartWorkers,
    StopTask,
    Tasks,
    WritePlan,
    WriteTaskFile,
    reconcile,
)
from services.nodeagent.state import STATE_FORMAT, AgentState, evolve, new_state
from services.nodeagent.upkeep import NodeUpkeep
from services.nodeagent.writer import AgentWriter

log = get_logger("gpuherd.nodeagent")

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class LogsRequest(msgspec.Struct, frozen=True):
    job: str
    attempt: int | None = None  # None: every attempt that ran here
    max_bytes: int = 65536


# NATS's default max_payload: what a logs reply is held to where the log has no NATS connection to ask.
DEFAULT_MAX_REPLY_BYTES = 1024 * 1024


def reply_limit(log_: object) -> int:
    """The most bytes one reply may hold: the NATS connection's ``max_payload`` (as its server
    announced it, after a reconnect too), else NATS's default."""
    limit = getattr(getattr(log_, "nc", None), "max_payload", None)
    return limit if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_REPLY_BYTES


def _json_size(text: str) -> int:
    return len(msgspec.json.encode(text)) - 2  # (without its quotes)


def _cut_front(text: str, room: int, marker: str) -> str:
    """The end of ``text`` after ``marker``, at most ``room`` bytes of JSON in all (nothing if not
    even the marker fits)."""
    room -= _json_size(marker)
    if room <= 0:
        return ""
    # The most characters whose JSON fits (escapes and UTF-8 take more than a byte a character; each
    # character's JSON is its own, so fewer characters never take more).
    fits, over = 0, min(len(text), room) + 1
    while over - fits > 1:
        middle = (fits + over) // 2
        fits, over = (middle, over) if _json_size(text[-middle:]) <= room else (fits, middle)
    return marker + text[len(text) - fits :]


def logs_reply(node: str, attempts: dict[str, dict[str, str]], max_bytes: int) -> bytes:
    """The answer to a logs request, at most ``max_bytes``: a reply over the connection's
    max_payload was never sent, and the asker saw only "no answer within 5s". Where the outputs do
    not fit, the largest are cut from the front (each keeps an equal share, a smaller one all of
    itself), each cut one says so in its first line, and ``truncated`` says why."""
    whole = msgspec.json.encode({"ok": True, "node": node, "attempts": attempts})
    if len(whole) <= max_bytes:
        return whole
    note = (
        f"outputs were cut from the front to fit the reply's limit of {max_bytes} bytes (NATS's max_payload); "
        f"ask for fewer bytes or one attempt, or read the files under the agent's data folder on {node}"
    )
    marker = f"[gpuherd: the start of this output was cut to fit the reply's limit of {max_bytes} bytes]\n"
    cut = {attempt: dict.fromkeys(files, "") for attempt, files in attempts.items()}  # (in the order given)
    room = max_bytes - len(msgspec.json.encode({"ok": True, "node": node, "attempts": cut, "truncated": note}))
    files = sorted(
        (_json_size(text), attempt, name) for attempt, texts in attempts.items() for name, text in texts.items()
    )
    for done, (size, attempt, name) in enumerate(files):  # smallest first: what it leaves goes to the larger
        share = max(room, 0) // (len(files) - done)
        text = attempts[attempt][name]
        cut[attempt][name] = kept = text if size <= share else _cut_front(text, share, marker)
        room -= _json_size(kept)
    reply = msgspec.json.encode({"ok": True, "node": node, "attempts": cut, "truncated": note})
    if len(reply) > max_bytes:  # (so many files that not even their names fit)
        error = f"the {len(files)} output files do not fit the reply's limit of {max_bytes} bytes; ask for one attempt"
        return msgspec.json.encode({"ok": False, "error": error})
    return reply


class Agent:
    def __init__(
        self,
        log_: EventLog,
        node: str,
        executor: Executor,
        *,
        rack: str = "",
        address: str = "",
        port_range: tuple[int, int] | None = None,
        heartbeat_s: float = 1.0,
        telemetry_s: float = 5.0,
        power_hook: str | None = None,
        clock: Callable[[], float] = time.time,
        snapshot_every: int = 5000,
        snapshot_interval_s: float = 30.0,
        relay: RelayClient | None = None,
    ) -> None:
        self.log = log_
        self.node = node
        self.executor = executor
        self.rack = rack
        self.address = address
        self.port_range = port_range
        self.clock = clock
        self.boot_id = uuid.uuid4().hex[:12]
        self.state: AgentState = new_state(node)
        self.caught_up = asyncio.Event()
        self.writer = AgentWriter(log_, AgentEvents(node), clock, relay)
        # What borrowers' runtimes say they hold (messages) goes into the memory reports (upkeep).
        holdings = leases.LeaseHoldings(started_at=self.writer.clock())
        self.messages = JobMessages(
            node, lambda: self.state, executor, self.writer, log_, holdings=holdings, reconcile_job=self._reconcile_soon
        )
        self.upkeep = NodeUpkeep(
            node,
            self.boot_id,
            lambda: self.state,
            executor,
            self.writer,
            log_,
            heartbeat_s=heartbeat_s,
            telemetry_s=telemetry_s,
            holdings=holdings,
        )
        self.power = PowerSwitch(node, lambda: self.state, self.writer, power_hook)
        self._exited: set[TaskKey] = set()  # tasks that ended by themselves
        self._unrecorded: dict[TaskKey, TaskExit] = {}  # of those, the ends not recorded yet
        # Tasks of those whose job was resized onto this node again before their end was recorded:
        # started again only once it is, and only after a completed end (see ``_remember``).
        self._resized_while_ending: set[TaskKey] = set()
        self._traces: dict[str, str] = {}  # job -> traceparent of its placement
        self._reconciling: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        self._planned: dict[TaskKey, int] = {}  # elastic: the generation last written to each task
        self._files: dict[tuple[TaskKey, str], str] = {}  # the text last written to each task file
        self._deadline_missed: dict[TaskKey, str] = {}  # tasks to stop: they kept a revoked lease
        self.snapshots = Cadence(snapshot_every, snapshot_interval_s)
        self._snapshotting: asyncio.Task[int | None] | None = None
        executor.node = node
        if hasattr(executor, "idle_gpus"):  # warm workers pin to idle GPUs (process executors)
            executor.idle_gpus = self._idle_gpus
        self.metrics = ServiceMetrics(f"agent-{node}")
        self.metrics_port: int | None = None
        registry = self.metrics.registry
        tasks_running = Gauge("gpuherd_agent_tasks_running", "Tasks this agent runs now", registry=registry)
        tasks_running.set_function(lambda: len(self.executor.running()))
        warm = Gauge("gpuherd_agent_warm_workers", "Warm workers waiting in this node's pool", registry=registry)
        warm.set_function(lambda: self.upkeep.warm_pool().get("warm", 0))
        warm_memory = Gauge(
            "gpuherd_agent_warm_memory_bytes", "Resident memory of this node's idle warm workers", registry=registry
        )
        warm_memory.set_function(lambda: self.upkeep.warm_pool().get("memory_mb", 0) * 2**20)

    def _idle_gpus(self) -> list[int]:
        me = self.state.me
        return me.free_gpus() if me is not None else []

    def health(self) -> tuple[bool, dict[str, Any]]:
        connected = self.log.is_connected()
        self.metrics.nats_connected.set(1 if connected else 0)
        return connected, {"service": self.metrics.service, "nats_connected": connected, "seq": self.state.seq}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        ok, detail = self.health()
        return ok and self.caught_up.is_set(), detail

    # -- life cycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        leadership = self.log.leadership(f"agent.{self.node}", self.boot_id)  # one agent per node
        # (Each try waits for NATS, up to its request timeout: the stop must not wait for it.)
        if not await unless_stopped(leadership.acquire(stop, f"node {self.node}"), stop):
            return
        self.upkeep.touch_alive()
        socket_ = None
        if self.executor.agent_addr:
            socket_ = ControlSocket(self.executor.agent_addr, self.messages.on_message)
            await socket_.start()
        stop_serving = await self.log.serve_requests(
            f"{self.node}.logs", lambda data: self._serve_logs(data, max_reply_bytes=reply_limit(self.log))
        )
        try:
            if not await unless_stopped(self._begin(), stop):
                return
            status = status_reporter(
                self.log,
                self.metrics,
                instance=self.boot_id,
                role=lambda: "agent",
                folded=lambda: self.state.seq,
                decisions=lambda: 0,
                metrics_port=self.metrics_port,
            )
            loops = {
                "heartbeat": self.upkeep.heartbeats(leadership),
                "telemetry": self.upkeep.samples(),
                "follow": self._follow(),
                "exits": self._exits(),
                "status": status,
            }
            await run_until_stopped(loops, stop)
        finally:
            for task in self._reconciling.values():
                task.cancel()
            if self._snapshotting is not None:
                self._snapshotting.cancel()
            self.writer.cancel()
            self.power.cancel()
            await self.executor.shutdown()
            with contextlib.suppress(Exception):
                await stop_serving()
            if socket_ is not None:
                socket_.close()
            await self._release_node(leadership)

    async def _begin(self) -> bool:
        """Load the snapshot, adopt the tasks left running, register the node: True once done.
        (Loading and registering wait through NATS outages: ``run`` stops them when stopped.)"""
        await self.load_snapshot()
        await self.executor.recover()
        start_pool = getattr(self.executor, "start_pool", None)
        if start_pool is not None:
            start_pool()  # warm workers for the grows that land here
        await self.register()
        return True

    async def _release_node(self, leadership: Leadership) -> None:
        """Let the node's next agent take it at once, if NATS answers in time. Otherwise this agent
        still ends at once: the leadership's key expires ``ttl`` after its last renewal, and the
        next agent takes the node then."""
        if not self.log.is_connected():  # (a request would wait out its timeout)
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(leadership.release(), SHUTDOWN_REQUEST_TIMEOUT_S)

    async def register(self, after_seq: int = 0) -> None:
        """Announce the node; ``after_seq`` > 0 re-registers a node the scheduler declared lost."""
        suffix = f":{after_seq}" if after_seq else ""
        event = ev.NodeRegistered(
            **self.writer.stamp("register", f"{self.boot_id}{suffix}"),
            node=self.node,
            gpus=tuple(self.executor.inventory(self.node)),
            rack=self.rack,
            executor=self.executor.kind,
            boot_id=self.boot_id,
            address=self.address,
            port_range=self.port_range,
            host_memory_mb=leases.host_memory_mb() if self.executor.kind != "sim" else 0,
        )
        await self.writer.append(event)
        log.info("registered", node=self.node, gpus=len(event.gpus), executor=self.executor.kind)

    # -- following the log -------------------------------------------------------------------

    async def _follow(self) -> None:
        head = await self.log.last_seq()
        if beyond_the_log(self.snapshot_key, self.state.seq, head):
            self.state = new_state(self.node)
            self.snapshots.seq = 0  # (and the next snapshot replaces it)
        if head <= self.state.seq:  # an empty log, or a snapshot of all of it
            await self._caught_up(self.state.seq)
        async for record in self.log.read(self.state.seq + 1, follow=True):
            event = record.event
            self.metrics.events_consumed.inc()
            if isinstance(event, ev.Unreadable):
                await report_unreadable(self.log, record, f"agent-{self.node}", self.metrics)
            reclaimed = self.state.leases.get(event.lease) if isinstance(event, ev.MemoryLeaseReclaimed) else None
            evolve(self.state, record.seq, event)
            self.snapshots.folded()
            self._remember(event, record.trace, reclaimed)
            if not self.caught_up.is_set():
                if record.seq >= head:
                    await self._caught_up(record.seq)
                continue
            await self._react(event, record.seq)
            self._maybe_snapshot()

    async def _caught_up(self, seq: int) -> None:
        self.caught_up.set()
        self._maybe_snapshot()  # a restart after a long catch-up should not repeat it
        self.reconcile_all()
        me = self.state.me
        if me is not None and me.status == "lost":
            await self.register(after_seq=seq)

    # -- snapshots ------------------------------------------------------------------------------
    # What the agent folded, so a restart reads only the log's tail. Any folded state is a valid
    # snapshot: after catching up the agent reconciles every job it knows, whatever it missed. One
    # folded beyond the log's head was of another log, and is dropped (``_follow``).

    async def load_snapshot(self) -> None:
        snap = await load_snapshot(self.log, self.snapshot_key, STATE_FORMAT)
        if snap is None:
            return
        try:
            state = msgspec.msgpack.decode(snap.state, type=AgentState)
        except UNDECODABLE as exc:
            log.warning("snapshot unreadable; folding the log from the start", error=str(exc))
            return
        if state.node == self.node:
            self.state = state
            self.snapshots.seq = state.seq

    def _maybe_snapshot(self) -> None:
        seq = self.state.seq
        if not self.snapshots.due(seq) or (self._snapshotting is not None and not self._snapshotting.done()):
            return
        self.snapshots.taken(seq)
        data = msgspec.msgpack.encode(self.state)  # now: the state moves on while it is stored
        self._snapshotting = asyncio.create_task(save_snapshot(self.log, self.snapshot_key, STATE_FORMAT, seq, data))

    @property
    def snapshot_key(self) -> str:
        return f"agent.{self.node}"

    def _remember(self, event: ev.Event, trace: str | None, reclaimed: Any) -> None:
        """What the agent keeps beside the fold, about its own tasks."""
        if isinstance(event, ev.JobPlaced) and trace:
            self._traces[event.job] = trace
        elif isinstance(event, ev.JobFinished | ev.JobRequeued):
            self._forget(event.job)
        elif isinstance(event, ev.JobResized) and any(a.node == self.node for a in event.allocations):
            key = TaskKey(event.job, event.attempt)
            if key in self._unrecorded:
                # Its end is not recorded yet: started again now, the next reconcile would record a
                # failed end and restart the task in one pass, for an attempt that end stops.
                self._resized_while_ending.add(key)
            else:
                self._exited.discard(key)  # back on this node: start it again
        elif reclaimed is not None and reclaimed.node == self.node and getattr(event, "deadline_missed", False):
            key = TaskKey(reclaimed.job, reclaimed.attempt)
            self._deadline_missed[key] = f"stopped: it kept leased memory past its deadline ({event.reason})"

    async def _react(self, event: ev.Event, seq: int) -> None:
        job_id = getattr(event, "job", None)
        if isinstance(event, ev.ProfileRequested):
            self.messages.pass_profile_request(event)
        elif job_id is not None:
            self.kick(job_id)
            if isinstance(event, ev.JobFinished | ev.JobRequeued):
                self.power.kick()  # a draining node may now be empty
        elif isinstance(event, ev.NodePowerDownRequested | ev.NodePowerUpRequested | ev.NodeWakeRequested):
            if event.node == self.node:
                self.power.kick()
        elif isinstance(event, ev.NodeLost) and event.node == self.node:
            # We are alive, so the scheduler lost sight of us (a partition, a NATS outage): its
            # requeues stand, and the node comes back for new work.
            log.warning("this node was declared lost; registering again", reason=event.reason)
            self.reconcile_all()
            await self.register(after_seq=seq)

    def _forget(self, job_id: str) -> None:
        """Drop what the agent kept about the attempts of a job that ended or was requeued."""
        job = self.state.jobs.get(job_id)
        current = job.attempt if job is not None else None
        if current is None:
            self._traces.pop(job_id, None)
        self._exited = {k for k in self._exited if k.job != job_id or k.attempt == current}
        self._resized_while_ending = {k for k in self._resized_while_ending if k.job != job_id or k.attempt == current}
        self._planned = {k: v for k, v in self._planned.items() if k.job != job_id or k.attempt == current}
        self._files = {k: v for k, v in self._files.items() if k[0].job != job_id or k[0].attempt == current}
        self.messages.forget(job_id, current)

    # -- reconciliation --------------------------------------------------------------------

    def reconcile_all(self) -> None:
        jobs = {k.job for k in self.executor.running()}
        jobs |= {j.job for j in self.state.active_jobs() if self.node in j.nodes}
        for job_id in sorted(jobs):
            self.kick(job_id)
        self.power.kick()  # a power request may have come while this agent was down

    def kick(self, job_id: str) -> None:
        """Reconcile one job soon; one job's slow stop never holds up another's start."""
        if job_id in self._reconciling:
            self._dirty.add(job_id)
            return
        self._reconciling[job_id] = asyncio.create_task(self._reconcile_loop(job_id), name=f"reconcile-{job_id}")

    def _reconcile_soon(self, job_id: str) -> None:
        """Reconcile a job at its workers' word, once the log is caught up (until then the state is
        partial, and the catch-up reconciles every job anyway)."""
        if self.caught_up.is_set():
            self.kick(job_id)

    async def _reconcile_loop(self, job_id: str) -> None:
        try:
            while True:
                self._dirty.discard(job_id)
                await self.reconcile(job_id)
                if job_id not in self._dirty:
                    return
        except Exception:
            log.exception("reconcile failed", job=job_id)
        finally:
            self._reconciling.pop(job_id, None)

    async def settled(self) -> None:
        """Wait until no reconciliation is in flight (tests and benchmarks)."""
        while self._reconciling:
            await asyncio.gather(*self._reconciling.values(), return_exceptions=True)

    async def reconcile(self, job_id: str) -> None:
        simulated = self.executor.kind == "sim"
        now, events, leases = self.clock(), self.writer.events, self.state.leases
        actions = reconcile(
            self.state, self.node, job_id, self._tasks(job_id), now, events, simulated=simulated, leases=leases
        )
        for action in actions:
            if not await self._carry_out(action):
                return

    def _tasks(self, job_id: str) -> Tasks:
        """What runs, as the reconcile step reads it: the executor's tasks and this agent's notes of
        them; for an elastic job's task here, its workers as its folder has them."""
        self._take_exits()  # (an end queued a moment ago: its task must not look like one to start)
        running = self.executor.running()
        workers: dict[TaskKey, TaskWorkers] = {}
        job = self.state.jobs.get(job_id)
        if job is not None and job.spec.elastic is not None:
            key = TaskKey(job_id, job.attempt)
            if key in running or self.node in job.nodes:
                workers[key] = self.executor.workers(key)
        return Tasks(
            running,
            self._exited,
            self._deadline_missed,
            workers=workers,
            planned=self._planned,
            files=self._files,
            asked=self.state.leases.keys(),  # (a request on its way has its id: appended twice, stored once)
            unrecorded=self._unrecorded,
            progress=self.messages.progress,
        )

    async def _carry_out(self, action: Action) -> bool:
        """Carry out one action, and note what it did; False when the ones after it must not follow
        (a task did not start)."""
        match action:
            case Record(event):
                await self.writer.append(event)
            case RecordEnd(key, event):
                await self.writer.append(event)
                self._unrecorded.pop(key, None)
                if key in self._resized_while_ending:
                    self._resized_while_ending.discard(key)
                    if event.outcome == "completed":  # (its workers left at a shrink: a grow brings it back)
                        self._exited.discard(key)
                        self.kick(key.job)
                log.info("task ended", job=key.job, attempt=key.attempt, outcome=event.outcome, reason=event.reason)
            case StartTask():
                return await self._start(action)
            case StopTask():
                await self._stop(action)
            case WritePlan(key, plan):
                if self.executor.write_plan(key, plan):
                    self._planned[key] = plan.generation
            case WriteTaskFile(key, name, text):
                if self.executor.write_task_file(key, name, text):
                    self._files[key, name] = text
            case StartWorkers(launch):
                if self.executor.grow(launch.key, launch):
                    log.info("workers added", job=launch.key.job, attempt=launch.key.attempt, gpus=list(launch.gpus))
            case RequestLease(event):
                self.writer.append_soon(event)
            case ReportLostWorker(event):
                log.warning("elastic worker died", job=event.job, gpu=event.gpu, code=event.exit_code)
                self.writer.append_soon(event)
        return True

    async def _start(self, action: StartTask) -> bool:
        launch = action.launch
        key = launch.key
        if action.started is not None:
            with span_from(self._traces.get(key.job), "agent.start", job=key.job, node=self.node):
                started = msgspec.structs.replace(action.started, at=self.clock())
                await self.writer.append(started, trace=current_traceparent())
        try:
            await self.executor.start(launch)
        except Exception as exc:  # cannot even launch: the gang must not wait for this part
            log.exception("task could not start", job=key.job, attempt=key.attempt)
            failed = TaskExit(key=key, outcome="failed", exit_code=None, reason=f"agent could not start it: {exc}")
            # Over at once, as a task that ended by itself: a reconcile before this end is read back
            # (its JobStarted may be read first) must not launch it again, and if the append below
            # fails, the next reconcile records the end.
            self._exited.add(key)
            self._unrecorded[key] = failed
            await self._report(failed)
            self._unrecorded.pop(key, None)
            return False
        log.info("task started", job=key.job, attempt=key.attempt, resumed=launch.resume)
        return True

    async def _stop(self, action: StopTask) -> None:
        exit_ = await self.executor.stop(action.key, action.reason, checkpoint_grace_s=action.grace_s)
        self._deadline_missed.pop(action.key, None)
        if action.report is not None:
            self._exited.add(action.key)  # this part of the attempt is over: never started again
            tail = exit_.output_tail if exit_ else ""
            ended = TaskExit(key=action.key, outcome=action.report, reason=action.reason, output_tail=tail)  # type: ignore[arg-type]
            await self._report(ended)
        else:
            log.info("task stopped", job=action.key.job, attempt=action.key.attempt, reason=action.reason)

    async def _exits(self) -> None:
        """The tasks that ended by themselves, as the executor queues them: noted (never started
        again) once the log is caught up, and their job reconciled (which records how they ended)."""
        while True:
            exit_ = await self.executor.exits.get()
            await self.caught_up.wait()
            self._note_exit(exit_)

    def _take_exits(self) -> None:
        while not self.executor.exits.empty():
            self._note_exit(self.executor.exits.get_nowait())

    def _note_exit(self, exit_: TaskExit) -> None:
        self._exited.add(exit_.key)
        self._unrecorded[exit_.key] = exit_
        self.kick(exit_.key.job)

    async def _report(self, exit_: TaskExit) -> None:
        key = exit_.key
        ended = self.writer.events.ended(
            key,
            exit_.outcome,
            self.clock(),
            exit_code=exit_.exit_code,
            reason=exit_.reason,
            output_tail=exit_.output_tail,
            metrics=self.messages.progress.get(key),
            job=self.state.jobs.get(key.job),
        )
        await self.writer.append(ended)
        log.info("task ended", job=key.job, attempt=key.attempt, outcome=exit_.outcome, reason=exit_.reason)

    # -- what people ask it ---------------------------------------------------------------------

    async def _serve_logs(self, data: bytes, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> bytes:
        try:
            req = msgspec.json.decode(data, type=LogsRequest)
        except UNDECODABLE as exc:
            return msgspec.json.encode({"ok": False, "error": f"bad logs request: {exc}"})
        if not _JOB_ID.match(req.job):
            return msgspec.json.encode({"ok": False, "error": f"not a job id: {req.job!r}"})
        attempts = [req.attempt] if req.attempt is not None else self.executor.attempts(req.job)
        # (No file's tail can be longer than the whole reply: never read more of it than that.)
        max_bytes = min(req.max_bytes, max_reply_bytes)
        out = {str(a): self.executor.output(TaskKey(req.job, a), max_bytes) for a in attempts}
        return logs_reply(self.node, out, max_reply_bytes)


def _port_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    lo, hi = int(first), int(last or first)
    if not 1024 <= lo <= hi <= 65535:
        raise argparse.ArgumentTypeError(f"want FIRST-LAST within 1024-65535, got {text!r}")
    return lo, hi


async def serve(args: argparse.Namespace) -> None:
    data_dir = Path(args.data_dir or Path(os.environ.get("GPUHERD_DATA_DIR", ".gpuherd")) / "agents" / args.node)
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    executor = make_executor(
        args.executor,
        data_dir=data_dir,
        gpus=args.gpus,
        island=args.island,
        agent_addr=control_address(str(data_dir), args.node),
        fence_after_s=args.fence_after,
        kill_grace_s=args.kill_grace,
        warm_workers=(0 if args.executor == "sim" else 1) if args.warm_workers is None else args.warm_workers,
        warm_min_free_mb=args.warm_min_free_mb,
    )
    log_ = await open_log(args.nats_url, name=f"agent-{args.node}")
    relay = RelayClient(log_.nc, args.node) if args.relay and isinstance(log_, JetStreamLog) else None
    agent = Agent(
        log_,
        args.node,
        executor,
        rack=args.rack,
        address=args.address or socket.gethostname(),
        port_range=None if executor.kind == "sim" else args.rendezvous_ports,
        heartbeat_s=args.heartbeat,
        telemetry_s=args.telemetry,
        power_hook=args.power_hook,
        relay=relay,
    )
    try:
        await serve_until_signal_with_http(agent, args.metrics_port)
    finally:
        await close_promptly(log_)  # (draining waits for the server: 12 s with NATS frozen)


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("agent", "gpuherd node agent: runs this node's part of every job placed on it")
    parser.add_argument("--node", required=True, help="node name (a NATS subject token)")
    parser.add_argument("--executor", default="sim", choices=["sim", "cpu", "nvml"])
    parser.add_argument("--gpus", type=int, default=8, help="declared GPUs (sim and cpu executors)")
    parser.add_argument("--island", type=int, default=0, help="GPUs per NVLink island, declared (0: one island)")
    parser.add_argument("--rack", default="")
    parser.add_argument("--address", default="", help="how peers reach this node (default: its hostname)")
    parser.add_argument("--rendezvous-ports", type=_port_range, default=(29500, 29999), metavar="FIRST-LAST")
    parser.add_argument("--data-dir", default=None, help="task folders and job logs (default .gpuherd/agents/NODE)")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    parser.add_argument("--telemetry", type=float, default=5.0, help="seconds between GPU samples")
    parser.add_argument(
        "--fence-after",
        type=float,
        default=4.0,
        help="a job stops itself when the agent is out of contact this long; keep it well under the "
        "scheduler's --lost-after",
    )
    parser.add_argument("--kill-grace", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument(
        "--warm-workers",
        type=int,
        default=None,
        metavar="N",
        help="interpreters with torch imported kept ready for elastic jobs' new workers on this node "
        "(default: 1 for the cpu and nvml executors, 0 for sim)",
    )
    parser.add_argument(
        "--warm-min-free-mb",
        type=int,
        default=None,
        metavar="MB",
        help="host memory the warm pool leaves free: below it, warm workers are given back "
        "(default: a tenth of the RAM, at least 1024)",
    )
    parser.add_argument(
        "--relay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send reports to a report relay (stored with other agents' reports in one commit); the agent "
        "appends a report itself whenever no relay answers (default: on)",
    )
    parser.add_argument(
        "--power-hook",
        default=os.environ.get("GPUHERD_POWER_HOOK"),
        help="command run as `HOOK down|up NODE` when energy saving powers this node down or up",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure(f"agent.{args.node}")
    run_process(lambda: serve(args))
