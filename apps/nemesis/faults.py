"""The nemesis' faults: what each kind does to a host, and a seeded schedule of them.

Kinds (``KINDS``):
- ``partition``: cut one host off (iptables DROP both ways), or split the cluster into a minority
  (one NATS server, one scheduler, an agent) and the majority; healed by flushing the rules;
- ``pause``: SIGSTOP the scheduler that leads, an agent or a NATS server past its lease or
  heartbeat, then SIGCONT (a leader that wakes must be fenced);
- ``kill``: SIGKILL a scheduler, an agent (its task shims live on) or a NATS server; start it again;
- ``power_loss``: SIGKILL a NATS server (or all three at once), drop what its filesystem had not
  fsynced (lazyfs), start it again;
- ``clock``: step a host's wall clock by minutes (its processes run under libfaketime);
- ``latency``: delay, stall and reset a host's links to NATS (its proxy).

Faults overlap where the kind allows: never two on one host, never two on NATS servers at once
(the cluster keeps its quorum, except a coordinated power loss, which runs alone), one partition
at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
import urllib.request
from dataclasses import dataclass, field

from apps.nemesis import lazyfs, proxy
from apps.nemesis.cluster import Host, NemesisCluster

KINDS = ("partition", "pause", "kill", "power_loss", "clock", "latency")
NEEDS = {"partition": "iptables", "power_loss": "fuse", "clock": "faketime"}  # facility each kind needs


@dataclass
class Fault:
    kind: str
    target: str  # a host name, "split", "leader" (the scheduler leading when it starts), "all-nats"
    start_s: float  # from the run's start
    duration_s: float
    detail: dict[str, float | str] = field(default_factory=dict)
    began: float | None = None  # wall clock (the root namespace's, true) when it was put in
    healed: float | None = None
    hit: str = ""  # what it hit, once in (the leader's host, the split's minority)
    error: str = ""
    recovery_s: float | None = None  # healed -> the cluster placing a job again (from the log)

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    def resources(self) -> set[str]:
        if self.target == "all-nats":
            return {"*"}
        out = {f"host:{self.target}"}
        if self.target.startswith("nats") or self.target == "split":
            out.add("nats")
        if self.kind == "partition":
            out.add("partition")
        if self.target in ("leader", "split") or self.target.startswith("sched"):
            out.add("schedulers")
        return out

    def describe(self) -> str:
        what = self.hit or self.target
        extra = ", ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"{self.kind} {what}" + (f" ({extra})" if extra else "")


def schedule(
    kinds: list[str], faults: int, run_s: float, rng: random.Random, *, agents: int, warmup_s: float = 8.0
) -> list[Fault]:
    """``faults`` faults over ``run_s`` seconds, every kind of ``kinds`` at least once (when
    ``faults`` allows), at seeded moments, shifted later where two would collide."""
    picks = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(picks)
    out: list[Fault] = []
    for kind in picks:
        out.append(_draw(kind, rng, agents, warmup_s, run_s))
    out.sort(key=lambda f: f.start_s)
    placed: list[Fault] = []
    for fault in out:
        while True:
            clash = [
                p
                for p in placed
                if p.start_s < fault.end_s + 2
                and fault.start_s < p.end_s + 2
                and ("*" in p.resources() or "*" in fault.resources() or p.resources() & fault.resources())
            ]
            if not clash:
                break
            fault.start_s = max(p.end_s for p in clash) + 2.0
        placed.append(fault)
    return sorted(placed, key=lambda f: f.start_s)


def _draw(kind: str, rng: random.Random, agents: int, warmup_s: float, run_s: float) -> Fault:
    agent = f"agent{rng.randint(1, agents)}"
    nats = f"nats{rng.randint(1, 3)}"
    start = rng.uniform(warmup_s, max(warmup_s + 1, run_s * 0.8))
    if kind == "partition":
        target = rng.choice(["split", "split", agent, nats, "sched1", "sched2", "client"])
        return Fault(kind, target, start, rng.uniform(6, 16))
    if kind == "pause":
        target = rng.choice(["leader", "leader", agent, nats])
        return Fault(kind, target, start, rng.uniform(4, 12))  # past the 3 s lease / 2.5 s fence
    if kind == "kill":
        target = rng.choice(["leader", "sched1", "sched2", agent, agent, nats])
        return Fault(kind, target, start, rng.uniform(0.5, 6))
    if kind == "power_loss":
        target = rng.choice(["all-nats", nats, nats])
        return Fault(kind, target, start, rng.uniform(1, 4))
    if kind == "clock":
        target = rng.choice([agent, agent, "sched1", "sched2", "client"])
        offset = rng.choice([-1, 1]) * rng.randint(60, 600)
        return Fault(kind, target, start, rng.uniform(10, 25), {"offset_s": offset})
    if kind == "latency":
        target = rng.choice([agent, agent, "sched1", "sched2", "client"])
        detail: dict[str, float | str] = {
            "delay_ms": rng.choice([50, 150, 300]),
            "jitter_ms": 50,
            "stall_p": 0.05,
            "stall_ms": 400,
            "reset_p": rng.choice([0.0, 0.005, 0.02]),
        }
        return Fault(kind, target, start, rng.uniform(10, 25), detail)
    raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")


# -- carrying them out ---------------------------------------------------------------------------


def leader_host(cluster: NemesisCluster) -> Host:
    """The scheduler host whose scheduler leads now (its /readyz says so), else the first."""
    for host in cluster.scheduler_hosts:
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(f"http://{host.ip}:9100/readyz", timeout=1) as answer,
        ):
            if json.load(answer).get("role") == "leader":
                return host
    return cluster.scheduler_hosts[0]


def _proc_of(host: Host) -> str:
    """The gpuherd process a host is for (its proxy aside)."""
    return next(name for name in host.procs if not name.startswith("proxy-"))


async def run_fault(cluster: NemesisCluster, fault: Fault, t0: float) -> None:
    """Wait for the fault's moment, put it in, hold it, heal it; the times are recorded on it."""
    await asyncio.sleep(max(0.0, t0 + fault.start_s - time.monotonic()))
    try:
        heal = await _inject(cluster, fault)
        fault.began = time.time()
        await asyncio.sleep(fault.duration_s)
        await heal()
        fault.healed = time.time()
    except Exception as exc:  # a fault that could not be put in or healed is reported, not hidden
        fault.error = f"{type(exc).__name__}: {exc}"
        fault.healed = fault.healed or time.time()


async def _inject(cluster: NemesisCluster, fault: Fault):
    kind, target = fault.kind, fault.target
    host = leader_host(cluster) if target == "leader" else cluster.hosts.get(target)
    if host is not None:
        fault.hit = host.name
    if kind == "partition":
        return await asyncio.to_thread(_partition, cluster, fault, host)
    if kind == "pause":
        proc = host.procs[_proc_of(host)] if not host.name.startswith("nats") else None
        server = cluster.nats.get(host.name)
        pid = proc.pid if proc is not None else (server.proc.pid if server and server.proc else None)
        if pid is None:
            raise RuntimeError(f"nothing runs on {host.name} to pause")
        import os

        os.kill(pid, signal.SIGSTOP)

        async def resume() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

        return resume
    if kind == "kill":
        if host.name.startswith("nats"):
            server = cluster.nats[host.name]
            server.kill()

            async def restart_nats() -> None:
                await asyncio.to_thread(server.start, 30)

            return restart_nats
        proc = host.procs[_proc_of(host)]
        proc.kill()

        async def restart() -> None:
            proc.start()

        return restart
    if kind == "power_loss":
        hosts = cluster.nats_hosts if target == "all-nats" else [host]
        fault.hit = ",".join(h.name for h in hosts)
        lost = []
        for h in hosts:
            cluster.nats[h.name].kill()
        for h in hosts:  # after every server died: nothing writes between the kill and the cut
            lost.append(await asyncio.to_thread(lazyfs.control, cluster.lazyfs_socket(h), "drop"))
        fault.detail["lost"] = "; ".join(lost)

        async def power_on() -> None:
            for h in hosts:
                await asyncio.to_thread(cluster.nats[h.name].start, 30)

        return power_on
    if kind == "clock":
        offset = float(fault.detail["offset_s"])
        host.clock_file.write_text(f"{offset:+.0f}\n")

        async def reset_clock() -> None:
            host.clock_file.write_text("+0\n")

        return reset_clock
    if kind == "latency":
        settings = {k: v for k, v in fault.detail.items() if isinstance(v, int | float)} | {"seed": 1}
        await asyncio.to_thread(proxy.control, host.proxy_socket, settings)

        async def clear() -> None:
            state = await asyncio.to_thread(proxy.control, host.proxy_socket, {})
            fault.detail["resets"] = state.get("resets", 0)

        return clear
    raise ValueError(f"unknown fault kind {kind!r}")


def _partition(cluster: NemesisCluster, fault: Fault, host: Host | None):
    if fault.target == "split":
        minority = [cluster.hosts["nats1"], cluster.hosts["sched1"], cluster.hosts["agent1"]]
        fault.hit = "{" + ",".join(h.name for h in minority) + "} | the rest"
    else:
        assert host is not None
        minority = [host]
    majority = [h for h in cluster.hosts.values() if h not in minority]
    for side, other in ((minority, majority), (majority, minority)):
        for h in side:
            for o in other:
                h.iptables("-A", "INPUT", "-s", o.ip, "-j", "DROP")
                h.iptables("-A", "OUTPUT", "-d", o.ip, "-j", "DROP")
    touched = minority + majority

    async def heal() -> None:
        for h in touched:
            await asyncio.to_thread(h.iptables, "-F")

    return heal
