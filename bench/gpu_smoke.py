"""GPU smoke check: NVML inventory and telemetry, then a 1-GPU train_cnn job through a real agent.

1. inventory of this machine's GPUs as the nvml executor registers them (UUID,
   model, memory, NVLink peers and the islands placement derives from them);
2. three telemetry samples (utilization, memory, power, temperature, ECC, XID);
3. a local cluster (embedded nats-server, scheduler, one nvml agent, the
   dashboard) runs ``examples/train_cnn.py`` on one GPU; prints the job's
   events, its final metrics, its log tail, the GPU telemetry the agent
   published meanwhile and what the dashboard's node view shows of it;
4. on the same cluster, a job that holds GPU memory is stopped by its time
   limit, and another by a cancel: NVML lists each one's process on the GPU
   while it runs (the positive control) and none of it once the job ended.

Exits 0 when every step worked, 1 otherwise; 2 when there is no CUDA GPU.
``--executor cpu`` runs step 3 on a cpu agent instead (to check the flow on a
machine without a GPU).

Usage: python bench/gpu_smoke.py [--steps 200] [--executor nvml|cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from apps.cluster.local import ClusterLayout, LocalCluster
from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import open_log

console = Console()
ROOT = Path(__file__).resolve().parents[1]


def inventory_and_telemetry() -> None:
    from gpuherd.fold import islands_of
    from services.nodeagent.executors.nvml import NvmlExecutor

    with tempfile.TemporaryDirectory() as tmp:
        executor = NvmlExecutor(Path(tmp), alive_file=Path(tmp) / "alive")
        gpus = executor.inventory("smoke")
        table = Table(title=f"inventory ({len(gpus)} GPUs)")
        for col in ("index", "uuid", "model", "memory MiB", "NVLink peers"):
            table.add_column(col)
        for g in gpus:
            table.add_row(str(g.index), g.uuid, g.model, str(g.memory_mb), ",".join(map(str, g.nvlink_peers)) or "-")
        console.print(table)
        console.print(f"NVLink islands: {islands_of(gpus)}")
        xids = "watched" if executor.watches_xids else "not readable here (NVML refused the event set)"
        console.print(f"XID events: {xids}")
        samples = Table(title="telemetry samples")
        for col in ("t", "index", "util %", "mem used MiB", "power W", "temp C", "ECC uncorr.", "XID", "healthy"):
            samples.add_column(col)
        for t in range(3):
            for s in executor.sample():
                samples.add_row(
                    str(t),
                    str(s.index),
                    _fmt(s.utilization_pct),
                    _fmt(s.memory_used_mb),
                    _fmt(s.power_w),
                    _fmt(s.temperature_c),
                    _fmt(s.ecc_uncorrected),
                    _fmt(s.xid),
                    str(s.healthy),
                )
            time.sleep(1.0)
        console.print(samples)


def _fmt(value: float | int | None) -> str:
    return "n/a" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


async def train_through_agent(executor: str, steps: int) -> bool:
    layout = ClusterLayout(
        cpu_agents=1 if executor == "cpu" else 0,
        nvml_agents=1 if executor == "nvml" else 0,
        agent_args=("--telemetry", "1"),
        ui_port=0,
    )
    with tempfile.TemporaryDirectory(prefix="gpuherd-smoke-") as tmp, LocalCluster(Path(tmp), layout) as cluster:
        log = await open_log(cluster.url, name="smoke", persistent=False)
        client = await Client.connect(cluster.url, source="smoke", persistent=False)
        gpu_samples: list[dict] = []

        async def watch() -> None:
            async for sample in log.telemetry("*.gpus", since_s=30):
                gpu_samples.append(msgspec.json.decode(sample.data))

        watcher = asyncio.create_task(watch())
        try:
            for _ in range(300):
                if any(isinstance(r.event, ev.NodeRegistered) for r in await log.read_all()):
                    break
                await asyncio.sleep(0.2)
            spec = {
                "name": "smoke-cnn",
                "user": "smoke",
                "gpus": 1,
                "command": ["python", "examples/train_cnn.py", "--steps", str(steps), "--batch-size", "128"],
                "workdir": str(ROOT),
            }
            started = time.monotonic()
            job_id = await client.submit(spec, timeout=30)
            finished = None
            while finished is None and time.monotonic() - started < 300:
                records = [r for r in await log.read_all() if getattr(r.event, "job", None) == job_id]
                finished = next((r.event for r in records if isinstance(r.event, ev.JobFinished)), None)
                await asyncio.sleep(0.5)
            for r in records:
                brief = {k: v for k, v in msgspec.to_builtins(r.event).items() if k not in ("output_tail", "spec")}
                console.print(f"{r.seq:>4} {type(r.event).__name__} {brief}", highlight=False, soft_wrap=True)
            if finished is None:
                console.print("[red]the job did not finish within 300 s[/red]")
                return False
            console.print(f"outcome: {finished.outcome}; metrics: {finished.metrics}")
            console.print("output tail:\n" + finished.output_tail)
            busy = [g for s in gpu_samples for g in s["gpus"] if g.get("job") == job_id and g.get("utilization_pct")]
            if busy:
                peak = max(busy, key=lambda g: g["utilization_pct"])
                console.print(f"telemetry: {len(busy)} samples of the job's GPU; peak {peak}")
            else:
                console.print(f"telemetry: {len(gpu_samples)} samples; none showed the job's GPU busy")
            shown = await dashboard_node_view(cluster.dashboard_url())
            ok = finished.outcome == "completed" and shown
            if executor == "nvml":
                for how in ("time limit", "cancel"):
                    ok = await stop_frees_the_gpu(client, log, how) and ok
            return ok
        finally:
            watcher.cancel()
            await client.close()
            await log.close()


async def dashboard_node_view(url: str | None) -> bool:
    """The dashboard's node view (``/api/nodes``) shows each GPU with the samples it was sent."""
    import aiohttp

    if url is None:
        console.print("[red]the dashboard did not serve[/red]")
        return False
    async with aiohttp.ClientSession() as http, http.get(f"{url.rstrip('/')}/api/nodes") as response:
        nodes = await response.json()
    with_samples = [(n["node"], g["info"]["index"], g["samples"]) for n in nodes for g in n["gpus"] if g["samples"]]
    for node, index, samples in with_samples:
        busiest = max(samples, key=lambda sample: sample[1] or 0)  # (time, utilization %, memory MiB, ...)
        console.print(f"dashboard node view: {node} GPU {index}: {len(samples)} samples, busiest {busiest}")
    if not with_samples:
        console.print(f"[red]the dashboard's node view shows no GPU samples ({len(nodes)} nodes)[/red]")
    return bool(with_samples)


HOLD_GPU = (
    "import time, torch\n"
    "x = torch.empty(256 << 20, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
    "print('holding', flush=True); time.sleep(600)\n"
)


async def stop_frees_the_gpu(client: Client, log: Any, how: str) -> bool:
    """A job holding GPU memory ends by ``how`` (its time limit, or a cancel once NVML lists it);
    NVML must list its process while it runs and none of it after."""
    from services.nodeagent.executors.nvml import NvmlExecutor

    with tempfile.TemporaryDirectory() as tmp:
        nvml = NvmlExecutor(Path(tmp), alive_file=Path(tmp) / "alive")

    def pids() -> set[int]:  # on every GPU: the scheduler picks which one the job gets
        return {pid for index in range(len(nvml.handles)) for pid in nvml.compute_pids(index)}

    before = pids()
    spec: dict[str, Any] = {"name": f"smoke-{how.replace(' ', '-')}", "user": "smoke", "gpus": 1}
    spec["command"] = ["python", "-c", HOLD_GPU]
    if how == "time limit":
        spec["time_limit_s"] = 20
    job_id = await client.submit(spec, timeout=30)
    seen: set[int] = set()
    finished = None
    started = time.monotonic()
    cancelled_at = None
    while finished is None and time.monotonic() - started < 120:
        seen |= pids() - before
        if how == "cancel" and seen and cancelled_at is None:
            await client.cancel(job_id, "smoke: cancel while it holds the GPU")
            cancelled_at = time.monotonic() - started
        records = [r for r in await log.read_all() if getattr(r.event, "job", None) == job_id]
        finished = next((r.event for r in records if isinstance(r.event, ev.JobFinished)), None)
        await asyncio.sleep(0.2)
    if finished is None:
        console.print(f"[red]{how}: the job did not end within 120 s[/red]")
        return False
    ended_after = time.monotonic() - started
    left = seen & pids()
    console.print(
        f"{how}: outcome {finished.outcome} ({finished.reason}) after {ended_after:.1f} s"
        + (f", cancelled at {cancelled_at:.1f} s" if cancelled_at is not None else "")
        + f"; NVML listed its process(es) {sorted(seen)} while it ran, {sorted(left)} after it ended",
        highlight=False,
    )
    expected = "cancelled" if how == "cancel" else "timeout"
    return bool(seen) and not left and finished.outcome == expected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--executor", choices=["nvml", "cpu"], default="nvml")
    args = parser.parse_args()
    if args.executor == "nvml":
        import torch

        if not torch.cuda.is_available():
            console.print("no CUDA GPU on this machine: nothing to smoke-test (try --executor cpu for the flow)")
            return 2
        console.print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
        inventory_and_telemetry()
    ok = asyncio.run(train_through_agent(args.executor, args.steps))
    console.print("[green]smoke test passed[/green]" if ok else "[red]smoke test FAILED[/red]")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
