"""How far a reader must travel to follow one placement through the node agent.

An agent with the ``cpu`` executor (real processes, in-memory log) is given a job; from its
``JobPlaced`` until the agent has written the part's ``TaskEnded`` (and folded it), every call the
agent's process makes into ``services/nodeagent`` is watched (the agent's own loops that have
nothing to do with the job, heartbeats, telemetry, status, the warm pool, are left out). Each
distinct call from a function of one file of the agent into a function of another (a *crossing*)
is a trip a reader following the placement must make, there and back: two *stops*. In the order
the crossings are first made, a *return* is a stop in a file the walk had already been in and
left: every way back, and every trip out into a file seen before (a call back, a second visit).

Three placements: a plain 1-GPU job, a 1-GPU elastic job (plans, grows and worker deaths are
looked after on every pass) and a 1-GPU job that leases memory (lease requests, the lease file).
The figures are counts of code paths, not times: no lock needed.

Usage: python bench/agent_walk.py [--json] [--edges]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuherd import events as ev
from gpuherd.log import InProcessLog
from gpuherd.obs import configure
from services.nodeagent.agent import Agent
from services.nodeagent.executors.cpu import CpuExecutor

ROOT = Path(__file__).resolve().parents[1]
AGENT_DIR = str(ROOT / "services" / "nodeagent") + "/"
UNRELATED_LOOPS = {"heartbeat", "telemetry", "status", "warm-pool", "stop"}


@dataclass
class Walk:
    edges: list[tuple[str, str]] = field(default_factory=list)  # (caller, callee) as "file:function", first-seen order
    _seen: set[tuple[str, str]] = field(default_factory=set)

    def profile(self, frame: FrameType, what: str, _: Any) -> None:
        if what != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back
        if not callee.startswith(AGENT_DIR) or caller is None or not caller.f_code.co_filename.startswith(AGENT_DIR):
            return
        if caller.f_code.co_filename == callee:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        if task is not None and task.get_name() in UNRELATED_LOOPS:
            return
        edge = (_where(caller), _where(frame))
        if edge not in self._seen:
            self._seen.add(edge)
            self.edges.append(edge)

    def stops(self) -> tuple[int, int]:
        """(stops, returns to a file already left): each crossing is a trip there and back."""
        visited = {"agent.py"}  # where the reader starts
        returns = 0
        for caller, callee in self.edges:
            source, target = caller.split(":")[0], callee.split(":")[0]
            returns += 1 + (target in visited)  # the way back, and the way out if it was seen before
            visited |= {source, target}
        return 2 * len(self.edges), returns


def _where(frame: FrameType) -> str:
    path = frame.f_code.co_filename.removeprefix(AGENT_DIR)
    return f"{path}:{frame.f_code.co_qualname}"


async def walk(kind: str) -> Walk:
    with tempfile.TemporaryDirectory(prefix="gpuherd-walk-") as folder:
        data = Path(folder)
        log = InProcessLog(leadership_ttl=0.5)
        executor = CpuExecutor(data, gpus=2, alive_file=data / "alive", fence_after_s=60.0, kill_grace_s=1.0)
        agent = Agent(log, "n1", executor, address="127.0.0.1", port_range=(29000, 29009))
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        job = f"walk-{kind}"
        spec = ev.JobSpec(
            name=job,
            user="u",
            gpus=1,
            command=(sys.executable, "-c", "import time; time.sleep(1)"),
            elastic=ev.Elastic(min=1, max=2) if kind == "elastic" else None,
            memory=ev.MemoryNeeds(extra_mb=1024) if kind == "memory" else None,
        )
        walked = Walk()
        try:
            await asyncio.wait_for(agent.caught_up.wait(), 10)
            await log.append([ev.JobSubmitted(id=f"sub-{job}", job=job, spec=spec, intake_source="walk")])
            await _until(lambda: agent.state.jobs.get(job) is not None)
            await agent.settled()
            placed = ev.JobPlaced(
                id=f"place-{job}",
                at=time.time(),
                job=job,
                attempt=0,
                allocations=(ev.Allocation("n1", (0,)),),
                rendezvous=ev.Rendezvous("127.0.0.1", 29000),
            )
            sys.setprofile(walked.profile)
            try:
                await log.append([placed])
                await _until(lambda: any(isinstance(r.event, ev.TaskEnded) for r in log._records))
                await _until(lambda: agent.state.seq == len(log._records))
                await agent.settled()
            finally:
                sys.setprofile(None)
        finally:
            stop.set()
            await asyncio.wait_for(running, 20)
    return walked


async def _until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the placement did not get there in time")
        await asyncio.sleep(0.02)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for kind in ("plain", "elastic", "memory"):
        walked = await walk(kind)
        stops, returns = walked.stops()
        files = sorted({e.split(":")[0] for edge in walked.edges for e in edge})
        result[kind] = {"crossings": len(walked.edges), "stops": stops, "returns": returns, "files": files}
        if args.edges:
            result[kind]["edges"] = [f"{a} -> {b}" for a, b in walked.edges]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--edges", action="store_true", help="list every stop, in the order first taken")
    args = parser.parse_args()
    configure("bench", level="WARNING", json=False)
    result = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(result))
        return
    console = Console()
    table = Table(title="one placement through the node agent")
    for column in ("job", "crossings", "stops", "returns to a file already left", "files"):
        table.add_column(column)
    for kind, row in result.items():
        cells = (row["crossings"], row["stops"], row["returns"], len(row["files"]))
        table.add_row(kind, *map(str, cells))
    console.print(table)
    if args.edges:
        for kind, row in result.items():
            console.print(f"[bold]{kind}[/bold]")
            for edge in row["edges"]:
                console.print(f"  {edge}")


if __name__ == "__main__":
    main()
