"""One nemesis run, start to verdict, and the power-cut demonstration of both fsync settings."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from apps.nemesis import checker
from apps.nemesis.cluster import NemesisCluster, facilities
from apps.nemesis.faults import KINDS, NEEDS, Fault, run_fault, schedule
from gpuherd import events as ev
from gpuherd.log import open_log
from gpuherd.natsd import SYNC_ALWAYS


class Unavailable(RuntimeError):
    """The nemesis cannot run here at all (not root, no network namespaces)."""


@dataclass
class NemesisConfig:
    seed: int = 2026
    jobs: int = 120
    rate: float = 2.0  # submissions per second
    faults: int = 4
    kinds: tuple[str, ...] = KINDS
    sync: str = SYNC_ALWAYS
    agents: int = 4
    settle_s: float = 240.0  # after the last submission: time for every acknowledged job to end
    root: Path | None = None  # keep the run's files here (default: a temporary folder, removed)


@dataclass
class NemesisResult:
    config: dict[str, Any]
    kinds: list[str]
    skipped: dict[str, str]
    faults: list[Fault]
    verdict: dict[str, Any]
    leftovers: list[str]
    wall_s: float
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The one JSON object of ``bench_nemesis.py --json``."""
        recoveries = [f.recovery_s for f in self.faults if f.recovery_s is not None]
        v = self.verdict
        return {
            "kinds": self.kinds,
            "skipped_kinds": self.skipped,
            "faults": len(self.faults),
            "acknowledged": v["acknowledged"],
            "lost": v["lost"],
            "duplicated": v["duplicated"],
            "double_booked": v["double_booked"],
            "overlapping_attempts": v["overlapping_attempts"],
            "audit_mismatches": v["audit_mismatches"],
            "finished_twice": v["finished_twice"],
            "max_recovery_s": max(recoveries) if recoveries else None,
            "unrecovered_faults": sum(1 for f in self.faults if f.recovery_s is None),
            "fault_errors": [f"{f.describe()}: {f.error}" for f in self.faults if f.error],
            "sync": self.config["sync"],
            "seed": self.config["seed"],
            "jobs_submitted": self.config["jobs"],
            "outcomes": v["outcomes"],
            "leftovers": self.leftovers,
            "wall_s": round(self.wall_s, 1),
            "history": [
                {
                    "kind": f.kind,
                    "target": f.hit or f.target,
                    "at_s": round(f.start_s, 1),
                    "held_s": round(f.duration_s, 1),
                    "recovery_s": None if f.recovery_s is None else round(f.recovery_s, 2),
                    **({"detail": {k: v for k, v in f.detail.items()}} if f.detail else {}),
                    **({"error": f.error} if f.error else {}),
                }
                for f in self.faults
            ],
        }


def usable_kinds(wanted: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """The kinds that can run here, and why each other one cannot (never skipped silently)."""
    have = facilities()
    if have["netns"] is not None:
        raise Unavailable(f"the nemesis needs network namespaces: {have['netns']}")
    kinds, skipped = [], {}
    for kind in wanted:
        missing = have.get(NEEDS.get(kind, ""), None)
        if missing:
            skipped[kind] = missing
        else:
            kinds.append(kind)
    return kinds, skipped


async def _wait(predicate, timeout: float, what: str, every: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await predicate():
                return
        except Exception:  # the log may be electing its leader right now
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        await asyncio.sleep(every)


async def run_nemesis(config: NemesisConfig, log_progress=print) -> NemesisResult:
    kinds, skipped = usable_kinds(config.kinds)
    for kind, why in skipped.items():
        log_progress(f"nemesis: SKIPPING fault kind {kind!r}: {why}")
    rng = random.Random(config.seed)
    run_s = config.jobs / config.rate
    plan = schedule(kinds, config.faults, run_s, rng, agents=config.agents)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nemesis-") as tmp:
        root = Path(config.root or tmp)
        lazy = "power_loss" in kinds
        with NemesisCluster(root, agents=config.agents, sync=config.sync, lazyfs=lazy, faketime="clock" in kinds) as c:
            log = await open_log(c.direct_url(), name="nemesis-checker", replicas=3)
            try:
                c.start_schedulers()
                c.start_agents()

                async def nodes_up() -> bool:
                    from gpuherd.fold import fold

                    return len(fold((r.seq, r.event) for r in await log.read_all()).nodes) == config.agents

                await _wait(nodes_up, 90, "the agents registering")
                client_config = root / "client.json"
                acks = root / "acks.jsonl"
                client_config.write_text(
                    json.dumps(
                        {
                            "url": c.proxied_url(),
                            "seed": config.seed,
                            "count": config.jobs,
                            "rate": config.rate,
                            "out": str(acks),
                            "run": f"nem{config.seed}",
                            "runs_dir": str(c.runs_dir),
                            "give_up_after_s": run_s + config.settle_s,
                        }
                    )
                )
                client = c.start_client(client_config)
                t0 = time.monotonic()
                log_progress(f"nemesis: {config.jobs} jobs at {config.rate}/s, {len(plan)} faults, sync {config.sync}")
                for fault in plan:
                    log_progress(f"  planned at {fault.start_s:6.1f}s for {fault.duration_s:4.1f}s: {fault.describe()}")
                await asyncio.gather(*(run_fault(c, f, t0) for f in plan))
                for fault in plan:
                    log_progress(f"  done: {fault.describe()}" + (f" ERROR {fault.error}" if fault.error else ""))

                async def client_done() -> bool:
                    return client.popen is not None and client.popen.poll() is not None

                await _wait(client_done, run_s + config.settle_s, "the client's last submission")
                acked = set(checker.read_acks(acks)[0].values())

                async def settled() -> bool:
                    from gpuherd.fold.invariants import unfinished

                    return not (acked & set(unfinished(await log.read_all())))

                try:
                    await _wait(settled, config.settle_s, "every acknowledged job ending", every=3.0)
                except TimeoutError as exc:
                    log_progress(f"nemesis: {exc} (the checker reports the rest as lost)")
                records = await log.read_all()
            finally:
                await log.close()
            for fault in plan:
                if fault.healed is not None:
                    fault.recovery_s = checker.recovery(records, fault.healed)
            verdict = await asyncio.to_thread(checker.judge, acks, c.runs_dir, records)
        leftovers = c.leftovers()
    return NemesisResult(
        config={
            k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
            for k, v in asdict(config).items()
        },
        kinds=kinds,
        skipped=skipped,
        faults=plan,
        verdict=verdict,
        leftovers=leftovers,
        wall_s=time.monotonic() - started,
    )


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else str(value) if isinstance(value, Path) else value


async def power_cut(sync: str, jobs: int = 60, seed: int = 7, log_progress=print, root: Path | None = None):
    """Submit ``jobs`` jobs (each acknowledged), cut the power of all three NATS servers at once
    (SIGKILL, then drop what their filesystems had not fsynced), power them on, and count the
    acknowledged jobs the log no longer has."""
    kinds, skipped = usable_kinds(("power_loss",))
    if not kinds:
        return {"sync": sync, "skipped": skipped["power_loss"]}
    with tempfile.TemporaryDirectory(prefix="nemesis-cut-") as tmp:
        root = Path(root or tmp)
        with NemesisCluster(root, agents=1, sync=sync, lazyfs=True, faketime=False) as c:
            log = await open_log(c.direct_url(), name="nemesis-checker", replicas=3)
            c.start_schedulers()
            c.start_agents()  # a node to place on: a job that fits nowhere is rejected, not acknowledged

            async def node_up() -> bool:
                return any(isinstance(r.event, ev.NodeRegistered) for r in await log.read_all())

            await _wait(node_up, 90, "the agent registering")
            acks = root / "acks.jsonl"
            config = {"url": c.proxied_url(), "seed": seed, "count": jobs, "rate": 20.0, "out": str(acks)}
            config |= {"run": f"cut{seed}", "runs_dir": str(c.runs_dir), "give_up_after_s": 120}
            (root / "client.json").write_text(json.dumps(config))
            client = c.start_client(root / "client.json")
            await asyncio.to_thread(client.popen.wait, 180)  # type: ignore[union-attr]
            await log.close()
            acked = checker.read_acks(acks)[0]
            cut = Fault("power_loss", "all-nats", 0.0, 2.0)
            from apps.nemesis.faults import _inject

            power_on = await _inject(c, cut)
            await asyncio.sleep(cut.duration_s)
            await power_on()
            log = await open_log(c.direct_url(), name="nemesis-checker", replicas=3)
            try:
                records = []

                async def readable() -> bool:
                    records[:] = await log.read_all()
                    return True

                await _wait(readable, 120, "the log after the power cut")
            finally:
                await log.close()
            in_log = {r.event.job for r in records if hasattr(r.event, "job")}
            lost = sorted(job for job in acked.values() if job not in in_log)
            log_progress(f"power cut with sync {sync}: {len(lost)} of {len(acked)} acknowledged jobs lost")
            return {
                "sync": sync,
                "acknowledged": len(acked),
                "lost": len(lost),
                "dropped": cut.detail.get("lost", ""),
                "leftovers": [],
            }
