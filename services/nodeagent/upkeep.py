"""A node agent's periodic duties: heartbeats (and its node's leadership), GPU telemetry, and what the
samples say that the log must hear: a GPU turned unhealthy, memory use that moved, leases of
running tasks to renew."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import msgspec

from gpuherd import events as ev
from gpuherd.aio import off_loop
from gpuherd.errors import LeadershipLost
from gpuherd.log import Leadership, TelemetryBus
from gpuherd.obs import get_logger
from services.nodeagent import leases
from services.nodeagent.executors import Executor
from services.nodeagent.state import AgentState
from services.nodeagent.writer import AgentWriter

log = get_logger("gpuherd.nodeagent")


class Heartbeat(msgspec.Struct, frozen=True):
    node: str
    boot_id: str
    at: float
    running: int
    warm_workers: int = 0  # warm interpreters waiting in the node's pool
    warm_memory_mb: float = 0.0  # their resident memory (host memory the pool holds)


class NodeUpkeep:
    def __init__(
        self,
        node: str,
        boot_id: str,
        state: Callable[[], AgentState],
        executor: Executor,
        writer: AgentWriter,
        telemetry: TelemetryBus,
        *,
        heartbeat_s: float,
        telemetry_s: float,
        holdings: leases.LeaseHoldings | None = None,
    ) -> None:
        self.node = node
        self.boot_id = boot_id
        self._state = state
        self.executor = executor
        self.writer = writer
        self.telemetry = telemetry
        self.heartbeat_s = heartbeat_s
        self.telemetry_s = telemetry_s
        self._reported_unhealthy: set[int] = set()
        self._memory = leases.MemoryReporter()
        self.holdings = holdings or leases.LeaseHoldings(started_at=writer.clock())
        self._memory_reports = 0

    def warm_pool(self) -> dict[str, float | int]:
        """The node's warm pool (size, warm, starting, memory_mb, taken, given_back); {} without one."""
        pool = getattr(self.executor, "pool", None)
        return pool.status() if pool is not None else {}

    def touch_alive(self) -> None:
        """Tell this node's shims the agent is in contact with the log (they fence themselves otherwise)."""
        alive: Path | None = self.executor.alive_file
        if alive is not None:
            alive.parent.mkdir(parents=True, exist_ok=True)
            alive.touch()

    async def heartbeats(self, leadership: Leadership) -> None:
        while True:
            pool = self.warm_pool()
            beat = Heartbeat(
                node=self.node,
                boot_id=self.boot_id,
                at=self.writer.clock(),
                running=len(self.executor.running()),
                warm_workers=int(pool.get("warm", 0)),
                warm_memory_mb=float(pool.get("memory_mb", 0.0)),
            )
            try:
                await self.telemetry.publish_telemetry(f"{self.node}.heartbeat", msgspec.json.encode(beat))
                # Taken again if it expired unclaimed while NATS failed over. LeadershipLost: another agent
                # runs this node now, and this one must stop (its tasks fence themselves).
                await leadership.renew()
                self.touch_alive()
            except LeadershipLost:
                raise
            except Exception as exc:  # the shims fence themselves if this goes on for long
                log.warning("heartbeat failed", error=repr(exc))
            await asyncio.sleep(self.heartbeat_s)

    async def samples(self) -> None:
        while True:
            await asyncio.sleep(self.telemetry_s)
            # What borrowers hold, as they said before the sample: any allocation said is in it.
            borrowed = self.holdings.borrowed_mb(self._state().leases, self.node, self._gpu_count())
            samples = await off_loop(self.executor.sample, name="gpu-sample")  # (a hung driver call: no exit wait)
            if not samples:
                continue
            me = self._state().me
            holders = {s.info.index: s.job for s in me.gpus} if me is not None else {}
            await self._report_health(samples)
            await self._report_memory(samples, borrowed)
            await self._renew_leases()
            payload = {
                "node": self.node,
                "at": self.writer.clock(),
                "gpus": [dict(msgspec.structs.asdict(s), job=holders.get(s.index)) for s in samples],
                "warm_pool": self.warm_pool(),  # host memory its idle warm workers hold
            }
            with contextlib.suppress(Exception):
                await self.telemetry.publish_telemetry(f"{self.node}.gpus", msgspec.json.encode(payload))

    def _gpu_count(self) -> int:
        me = self._state().me
        return len(me.gpus) if me is not None else 0

    async def _report_memory(self, samples: list, borrowed: tuple[int, ...] | None) -> None:
        if borrowed is not None and len(borrowed) != len(samples):
            borrowed = None  # (the node's GPUs changed between the two reads)
        used = self._memory.changed(self._state(), self.node, [s.memory_used_mb for s in samples], borrowed)
        if used is None:
            return
        self._memory_reports += 1
        stamp = self.writer.stamp("memory", self.boot_id, str(self._memory_reports))
        await self.writer.append(ev.GpuMemoryReported(**stamp, node=self.node, used_mb=used, borrowed_mb=borrowed))

    async def _renew_leases(self) -> None:
        state = self._state()
        running = {(k.job, k.attempt) for k in self.executor.running()}
        for lease_id, job in leases.renewals_due(state.leases, self.node, running, self.writer.clock()):
            expires = state.leases[lease_id].expires_at
            stamp = self.writer.stamp("renew", lease_id, f"{expires:.0f}")
            await self.writer.append(ev.MemoryLeaseRenewed(**stamp, lease=lease_id, job=job, node=self.node))

    async def _report_health(self, samples: list) -> None:
        """A GPU that turns unhealthy is reported once per agent run; it stays out of service until an
        operator undrains its node (XID errors and ECC counts do not heal by themselves)."""
        me = self._state().me
        for sample in samples:
            if sample.healthy or me is None or sample.index >= len(me.gpus):
                continue
            if not me.gpus[sample.index].healthy or sample.index in self._reported_unhealthy:
                continue
            self._reported_unhealthy.add(sample.index)
            event = ev.GpuHealthChanged(
                **self.writer.stamp("health", self.boot_id, str(sample.index)),
                node=self.node,
                index=sample.index,
                healthy=False,
                reason=sample.problem or "unhealthy",
            )
            await self.writer.append(event)
            log.warning("GPU unhealthy", index=sample.index, reason=event.reason)
