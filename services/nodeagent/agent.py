"""The node agent: register, heartbeat, and reconcile this node's tasks with the log.

The agent folds the same ClusterState as every service and *reconciles*:
what the log says should run on this node (jobs placed here, at their current
attempt, not cancelled) against what its executor runs. Reconciling rather
than reacting to single events makes a restart safe: after folding the log
again, the agent adopts tasks that were running (a sim task resumes with the
time already elapsed) and stops tasks whose attempt ended meanwhile. Every
event it appends has an id derived from (node, job, attempt), so a repeat
after a crash is a no-op.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid

import msgspec

from gpuherd import events as ev
from gpuherd.aio import acquire_lease, run_until_stopped, serve_until_signal
from gpuherd.decider import append_reliably
from gpuherd.log import EventLog, open_log
from gpuherd.obs import configure, current_traceparent, get_logger, span_from
from gpuherd.state import ACTIVE, ClusterState, apply
from services.nodeagent.executors import Executor, SimExecutor, TaskExit, TaskKey

log = get_logger("gpuherd.nodeagent")


class Heartbeat(msgspec.Struct, frozen=True):
    node: str
    boot_id: str
    at: float
    running: int


class Agent:
    def __init__(
        self,
        log_: EventLog,
        node: str,
        executor: Executor,
        *,
        rack: str = "",
        heartbeat_s: float = 2.0,
        clock=time.time,
    ) -> None:
        self.log = log_
        self.node = node
        self.executor = executor
        self.rack = rack
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.source = f"agent.{node}"
        self.boot_id = uuid.uuid4().hex[:12]
        self.state = ClusterState()
        self.caught_up = asyncio.Event()
        self._exited: set[TaskKey] = set()
        self._traces: dict[str, str] = {}  # job -> traceparent of its placement

    # -- life cycle ----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        lease = self.log.lease(f"agent.{self.node}", self.boot_id)  # one agent per node
        if not await acquire_lease(lease, stop, f"node {self.node}"):
            return
        await self.register()
        try:
            await run_until_stopped({"heartbeat": self._heartbeat(lease), "follow": self._follow()}, stop)
        finally:
            # Timers of sim tasks die with us; the next agent adopts them from the log.
            await self.executor.shutdown()
            with contextlib.suppress(Exception):
                await lease.release()

    async def register(self, after_seq: int = 0) -> None:
        """Announce the node; ``after_seq`` > 0 re-registers a node the scheduler declared lost."""
        suffix = f":{after_seq}" if after_seq else ""
        event = ev.NodeRegistered(
            id=f"{self.source}:register:{self.boot_id}{suffix}",
            at=self.clock(),
            source=self.source,
            node=self.node,
            gpus=tuple(self.executor.inventory(self.node)),
            rack=self.rack,
            executor=self.executor.kind,
            boot_id=self.boot_id,
        )
        await append_reliably(self.log, [event])
        log.info("registered", node=self.node, gpus=len(event.gpus), executor=self.executor.kind)

    async def _heartbeat(self, lease) -> None:
        while True:
            beat = Heartbeat(
                node=self.node, boot_id=self.boot_id, at=self.clock(), running=len(self.executor.running())
            )
            with contextlib.suppress(Exception):
                await self.log.publish_telemetry(f"{self.node}.heartbeat", msgspec.json.encode(beat))
                await lease.renew()
            await asyncio.sleep(self.heartbeat_s)

    async def _follow(self) -> None:
        head = await self.log.last_seq()
        if head == 0:
            self.caught_up.set()
        async for record in self.log.read(1, follow=True):
            apply(self.state, record.seq, record.event)
            job_id = getattr(record.event, "job", None)
            if isinstance(record.event, ev.JobPlaced) and record.trace:
                self._traces[record.event.job] = record.trace
            elif isinstance(record.event, ev.JobFinished):
                self._traces.pop(record.event.job, None)
            if not self.caught_up.is_set():
                if record.seq >= head:
                    self.caught_up.set()
                    await self.reconcile_all()
                    me = self.state.nodes.get(self.node)
                    if me is not None and me.status == "lost":
                        await self.register(after_seq=record.seq)
                continue
            if job_id is not None:
                await self.reconcile(job_id)
            elif isinstance(record.event, ev.NodeLost) and record.event.node == self.node:
                # We are alive, so the scheduler lost sight of us (a partition, a NATS outage): its
                # requeues stand, and the node comes back for new work.
                log.warning("this node was declared lost; registering again", reason=record.event.reason)
                await self.reconcile_all()
                await self.register(after_seq=record.seq)

    # -- reconciliation --------------------------------------------------------------------

    async def reconcile_all(self) -> None:
        jobs = {k.job for k in self.executor.running()}
        jobs |= {
            j.job
            for j in self.state.jobs.values()
            if j.status in ACTIVE and any(a.node == self.node for a in j.allocations)
        }
        for job_id in sorted(jobs):
            await self.reconcile(job_id)

    def _my_gpus(self, allocations: tuple[ev.Allocation, ...]) -> tuple[int, ...] | None:
        for alloc in allocations:
            if alloc.node == self.node:
                return alloc.gpus
        return None

    async def reconcile(self, job_id: str) -> None:
        job = self.state.jobs.get(job_id)
        if job is None:
            return
        gpus = self._my_gpus(job.allocations) if job.status in ACTIVE else None
        key = TaskKey(job_id, job.attempt)
        for running in [k for k in self.executor.running() if k.job == job_id]:
            if gpus is None or running != key or job.cancel_requested:
                await self.executor.stop(running, "attempt ended" if not job.cancel_requested else "cancelled")
                log.info("task stopped", job=job_id, attempt=running.attempt, status=job.status)
        if gpus is None:
            return
        leader = job.allocations[0].node == self.node
        if job.cancel_requested:
            if leader:
                await self._finish(TaskExit(key=key, outcome="cancelled", reason="cancelled on request"))
            return
        if key in self._exited or key in self.executor.running():
            return
        elapsed = 0.0
        if self.node in job.started_nodes and job.started_at is not None:
            elapsed = max(0.0, self.clock() - job.started_at)  # adopt what ran before an agent restart
        else:
            with span_from(self._traces.get(job_id), "agent.start", job=job_id, node=self.node):
                started = ev.JobStarted(
                    id=f"{self.source}:start:{job_id}:{job.attempt}",
                    at=self.clock(),
                    source=self.source,
                    job=job_id,
                    attempt=job.attempt,
                    node=self.node,
                )
                await append_reliably(self.log, [started], trace=current_traceparent())
        await self.executor.start(key, job.spec, gpus, elapsed_s=elapsed, on_exit=self._on_exit)
        log.info("task started", job=job_id, attempt=job.attempt, gpus=list(gpus), adopted=elapsed > 0)

    async def _on_exit(self, exit_: TaskExit) -> None:
        self._exited.add(exit_.key)
        job = self.state.jobs.get(exit_.key.job)
        if job is None or not job.allocations or job.allocations[0].node != self.node:
            return  # the gang's first node reports for the whole job
        await self._finish(exit_)

    async def _finish(self, exit_: TaskExit) -> None:
        finished = ev.JobFinished(
            id=f"{self.source}:finish:{exit_.key.job}:{exit_.key.attempt}",
            at=self.clock(),
            source=self.source,
            job=exit_.key.job,
            attempt=exit_.key.attempt,
            outcome=exit_.outcome,  # type: ignore[arg-type]
            node=self.node,
            exit_code=exit_.exit_code,
            reason=exit_.reason,
        )
        await append_reliably(self.log, [finished])
        log.info("job finished", job=exit_.key.job, outcome=exit_.outcome)


def make_executor(kind: str, gpus: int, island: int) -> Executor:
    if kind == "sim":
        return SimExecutor(gpus, island=island)
    raise SystemExit(f"executor {kind!r} is not available yet; use --executor sim")


async def serve(url: str, node: str, executor: Executor, rack: str) -> None:
    log_ = await open_log(url, name=f"agent-{node}")
    try:
        await serve_until_signal(Agent(log_, node, executor, rack=rack).run)
    finally:
        await log_.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpuherd-nodeagent", description="gpuherd node agent")
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--node", required=True, help="node name (a NATS subject token)")
    parser.add_argument("--executor", default="sim", choices=["sim"])
    parser.add_argument("--gpus", type=int, default=8, help="declared GPUs (sim executor)")
    parser.add_argument("--island", type=int, default=0, help="GPUs per NVLink island (0: one island)")
    parser.add_argument("--rack", default="")
    args = parser.parse_args(argv)
    configure(f"agent.{args.node}")
    asyncio.run(serve(args.nats_url, args.node, make_executor(args.executor, args.gpus, args.island), args.rack))
