"""Agent overhead: from JobPlaced to the job's first training step, against a direct start.

For a 1-process and a 2-node (1 process each) ``examples/train_cnn.py`` job on two
cpu agents (a local cluster: embedded nats-server, scheduler, agents as processes):

- via gpuherd: ``JobPlaced.at`` (the scheduler's decision time) to the wall time of
  step 1, which rank 0 reports to its agent and the agent forwards as telemetry;
- direct (the baseline, measured in the same run): starting the same script with
  ``python`` (two processes with a torch.distributed env for the 2-node case) to
  rank 0 printing step 1.

The agent's own share is shown too: JobPlaced to the leader's shim having started the
ranks (the rest is the script's own start: interpreter, torch import, rendezvous).

Each case runs ``--repeats`` times (default 5), one run at a time, direct and via the
agent alternating; the table shows medians.
Target: the agent adds at most 0.5 s.

Usage: python bench/bench_agent.py [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from apps.cluster.local import ClusterLayout, LocalCluster
from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import open_log

console = Console()
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["examples/train_cnn.py", "--steps", "3", "--batch-size", "8", "--log-every", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_start(ranks: int) -> float:
    """Seconds from starting the script's processes to rank 0 printing step 1."""
    port = free_port()
    started = time.time()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1), PYTHONUNBUFFERED="1")  # as the agent sets it
        if ranks > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks))
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, *SCRIPT],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                text=True,
            )
        )
    first_step = None
    assert procs[0].stdout is not None
    for line in procs[0].stdout:
        if line.startswith("step 1 ") and first_step is None:
            first_step = time.time()
    for p in procs:
        p.wait()
    if first_step is None or any(p.returncode for p in procs):
        raise RuntimeError("the direct run failed")
    return first_step - started


async def via_agent(cluster: LocalCluster, ranks: int, n: int) -> tuple[float, float]:
    """Seconds from JobPlaced to step 1 of rank 0, for one job through the cluster; and from
    JobPlaced to the leader's shim having started the ranks (the agent's own share)."""
    url = cluster.url
    spec = {
        "name": f"bench-{ranks}-{n}",
        "user": "bench",
        "gpus": ranks,
        "command": ["python", *SCRIPT],
        "workdir": str(ROOT),
        "intake_id": f"bench-{ranks}-{n}-{time.time_ns()}",
        **({"nodes": ranks} if ranks > 1 else {}),
    }
    log = await open_log(url, name="bench-agent", persistent=False)
    client = await Client.connect(url, source="bench", persistent=False)
    first_step: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    try:
        job_id = await client.submit(spec, timeout=30)

        async def watch() -> None:
            async for sample in log.telemetry(f"*.job.{job_id}", since_s=60):
                report = msgspec.json.decode(sample.data)
                if report.get("rank") == 0 and report.get("step") == 1 and not first_step.done():
                    first_step.set_result(float(report["at"]))

        watcher = asyncio.create_task(watch())
        step_at = await asyncio.wait_for(first_step, 120)
        watcher.cancel()
        placed = finished = None
        deadline = time.monotonic() + 120
        while finished is None and time.monotonic() < deadline:
            for record in await log.read_all():
                if getattr(record.event, "job", None) != job_id:
                    continue
                if isinstance(record.event, ev.JobPlaced):
                    placed = record.event
                elif isinstance(record.event, ev.JobFinished):
                    finished = record.event
            await asyncio.sleep(0.2)
        if placed is None or finished is None or finished.outcome != "completed":
            raise RuntimeError(f"job {job_id} did not complete: {finished}")
        leader = placed.allocations[0].node
        shim = cluster.data_dir / "agents" / leader / "jobs" / job_id / "attempt-0" / "shim.json"
        launched_at = msgspec.json.decode(shim.read_bytes())["launched_at"]
        return step_at - placed.at, launched_at - placed.at
    finally:
        await client.close()
        await log.close()


async def wait_for_nodes(url: str, count: int) -> None:
    log = await open_log(url, name="bench-wait", persistent=False)
    try:
        for _ in range(300):
            nodes = {r.event.node for r in await log.read_all() if isinstance(r.event, ev.NodeRegistered)}
            if len(nodes) >= count:
                return
            await asyncio.sleep(0.2)
        raise RuntimeError("agents did not register")
    finally:
        await log.close()


async def run(repeats: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpuherd-bench-") as tmp:
        layout = ClusterLayout(cpu_agents=2, cpu_gpus=2)
        with LocalCluster(Path(tmp), layout) as cluster:
            await wait_for_nodes(cluster.url, 2)
            direct_start(1)  # warm the page cache: both sides then start from a warm machine
            for ranks, label in ((1, "1 process"), (2, "2 nodes x 1 process (DDP)")):
                direct, agent, launch = [], [], []
                for i in range(repeats):  # alternate, so drift in the machine's load hits both alike
                    direct.append(direct_start(ranks))
                    to_step, to_launch = await via_agent(cluster, ranks, i)
                    agent.append(to_step)
                    launch.append(to_launch)
                rows.append((label, *(statistics.median(x) for x in (direct, agent, launch))))
    table = Table(title=f"JobPlaced -> first training step, median of {repeats} (train_cnn.py on cpu agents)")
    columns = ("job", "direct python (s)", "via agent (s)", "overhead (s)", "ratio", "placed->launched (s)", "target")
    for col in columns:
        table.add_column(col, justify="right")
    for label, direct, agent, launch in rows:
        overhead = agent - direct
        table.add_row(
            label,
            f"{direct:.3f}",
            f"{agent:.3f}",
            f"{overhead:+.3f}",
            f"{agent / direct:.2f}x",
            f"{launch:.3f}",
            "ok (<= 0.5 s)" if overhead <= 0.5 else "MISSED (> 0.5 s)",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(args.repeats))


if __name__ == "__main__":
    main()
