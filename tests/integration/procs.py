"""Real service processes for integration tests: start, SIGKILL, restart."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply
from gpuherd.fold.leases import Leases, apply_lease
from gpuherd.log import EventLog

FAST_ENV = {"GPUHERD_LEADERSHIP_TTL": "2", "PYTHONUNBUFFERED": "1", "GPUHERD_LOG_LEVEL": "INFO"}


class Services:
    def __init__(
        self,
        nats_url: str,
        log_dir: Path,
        *,
        agents: int = 2,
        gpus: int = 4,
        lost_after: float = 6.0,
        executor: str = "sim",
        fence_after: float = 1.5,
        kill_grace: float = 2.0,
        agent_args: tuple[str, ...] = (),
    ):
        self.url = nats_url
        self.log_dir = log_dir
        self.specs: dict[str, list[str]] = {
            "scheduler": ["-m", "services.scheduler", "--nats-url", nats_url, "--lost-after", str(lost_after)],
        }
        # Tests may share a machine: no fixed rendezvous ports. And none of the kernel's ephemeral ports
        # (32768-60999 on Linux): a connection's local port (gloo's, NATS's) could hold one when a
        # generation's store opens there ("cannot open the store").
        ports = random.randrange(20000, 32000, 100)
        for i in range(1, agents + 1):
            self.specs[f"agent-{i}"] = [
                *("-m", "services.nodeagent", "--nats-url", nats_url, "--node", f"n{i}", "--gpus", str(gpus)),
                *("--executor", executor, "--data-dir", str(log_dir / "agents" / f"n{i}"), "--address", "127.0.0.1"),
                *("--rendezvous-ports", f"{ports + 10 * i}-{ports + 10 * i + 9}", "--heartbeat", "0.5"),
                *(
                    "--fence-after",
                    str(fence_after),
                    "--kill-grace",
                    str(kill_grace),
                    "--island",
                    str(max(1, gpus // 2)),
                ),
                *agent_args,
            ]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, **FAST_ENV)
        self.env_of: dict[str, dict[str, str]] = {}  # per process, over ``env`` (e.g. its NATS user)

    def start(self, name: str) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        self.procs[name] = subprocess.Popen(
            [sys.executable, *self.specs[name]],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, **self.env_of.get(name, {})},
            start_new_session=True,
        )
        log.close()

    def start_all(self) -> None:
        for name in self.specs:
            self.start(name)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def crashed(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() not in (None, -9, -15, 0)]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


class View(ClusterState, kw_only=True):
    """What the tests look at: the core fold with every job the log ever held, the memory leases not
    ended, and how many submissions were rejected."""

    leases: Leases = msgspec.field(default_factory=dict)
    rejected: int = 0


def view_of(records: list) -> View:
    state = View()
    for record in records:
        apply(state, record.seq, record.event)
        apply_lease(state.leases, record.event)
        state.rejected += isinstance(record.event, ev.JobRejected)
    return state


async def wait_state(log: EventLog, predicate: Callable[[View], bool], timeout: float) -> View:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            state = view_of(await log.read_all())
            if predicate(state):
                return state
        except Exception:  # the server may be restarting
            state = None
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"condition not reached in {timeout}s; last state: "
                f"{None if state is None else {j.job: j.status for j in state.jobs.values()}}"
            )
        await asyncio.sleep(0.3)


async def wait_scheduler_ready(log: EventLog, timeout: float = 30.0) -> None:
    """Until the leading scheduler's intake listens (plain NATS requests sent earlier get no reply)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await log.request("scheduler.ready", b"", timeout=1.0)
            return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)
