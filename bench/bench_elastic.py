"""Elastic rescales: gpuherd's in-process re-formation against kill, restart, restore.

The example CNN (``examples/train_cnn.py``'s SmallResNet on its synthetic data, a constant global
batch) trains in real worker processes over gloo on this machine's CPU. The workers run the way a
node agent runs them: each node is a ``cpu`` executor (``services/nodeagent/executors``) with its
task shims, and this benchmark plays the scheduler and the agents, committing each generation by
writing the plan into the task folders (and starting the task of a node the job grows onto). Every
way is measured in the same run, on the same model, data and job:

- **grow within the node, the job's standby**: 2 -> 3 workers on the node the job runs on; the
  task's shim hands the new worker to the warm standby it keeps (``gpuherd.train.standby``);
- **grow onto another node, pool warm**: 2 -> 3 with the new worker on a second node, which the
  job does not run on yet; that node's agent-wide pool of warm workers (``pool.py``) gives it an
  interpreter with torch already imported;
- **shrink**: 3 -> 2, after each grow, the new worker leaves at the next step boundary;
- with ``--cold``, **grow onto another node, pool empty**: the new worker starts as a new process
  (what the pool saves);
- **restart baseline** (what torchrun-style elastic agents do): stop every worker, start the new
  set at the new size as new processes, each loads the last checkpoint from disk and forms a new
  group. Rank 0 checkpoints every ``--ckpt-every`` steps; the steps since then are lost.

Measured for each: **decision -> first step at the new size** (the decision is the moment the
generation is committed, or the workers are killed), the time training **stood still** (from the
last step that ended before the switch to the first step at the new size, less one step), and the
baseline's **lost work**. Medians over ``--repeats``; each row's ratio is the restart baseline of
the same change over it. ``--json``: a list of one object per row.

``--device cuda`` trains on the GPU. With one GPU every worker shares it and the group talks over
gloo (NCCL refuses two ranks on one GPU); the shim's standby creates its CUDA context ahead
(``GPUHERD_WARM_CUDA``). ``--backend nccl`` gives each worker its own GPU (3 or more needed). Either
way a fresh process's setup is timed apart first: importing torch, creating the CUDA context, and a
one-rank NCCL communicator's setup, which is what a warm worker saves and what a restart pays.

    python bench/bench_elastic.py [--repeats 3] [--ckpt-every 20] [--cold] [--device cuda] [--backend nccl] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "libs"))
sys.path.insert(0, str(ROOT))

from gpuherd import jobenv  # noqa: E402
from gpuherd.jobenv import ElasticPlan  # noqa: E402
from gpuherd.train.standby import WARM_CUDA  # noqa: E402

SAMPLES, GLOBAL_BATCH, MICRO = 3072, 48, 8  # world sizes that keep the batch: 1, 2, 3, 6
JOB = "bench"
# --backend nccl: a GPU each. The third worker (a/2, b/0 or c/0) is never in a group with another.
GPU_OF_WORKER = {"a/0": 0, "a/1": 1}
THIRD_GPU = 2


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """How every worker trains: torch threads, the device, the process group's backend."""

    threads: int = 1
    device: str = "cpu"
    backend: str = "gloo"

    def argv(self) -> list[str]:
        return ["--threads", str(self.threads), "--device", self.device, "--backend", self.backend]

    def env(self) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": str(self.threads)}
        if self.device == "cuda" and self.backend == "gloo":  # one GPU for all: a standby may take it early
            env[WARM_CUDA] = "1"
        return env


# -- the worker: this file, run as the job's script ----------------------------------------------


def run_worker(args: argparse.Namespace) -> None:
    """One worker: builds the example CNN, optionally restores the checkpoint, trains until told
    to leave (or killed). Reports every step and every rescale to the benchmark's socket."""
    import torch
    from synthetic import elastic_steps, make_dataset
    from train_cnn import SmallResNet

    from gpuherd.train.elastic import ElasticSampler, ElasticState, Membership, PlanFile

    worker_id = os.environ[jobenv.ELASTIC_WORKER]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    address = b"\0" + args.report.encode()

    def send(*message: Any) -> None:
        sock.sendto(json.dumps(message).encode(), address)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    if args.backend == "nccl":
        device = torch.device("cuda", GPU_OF_WORKER.get(worker_id, THIRD_GPU))
        torch.cuda.set_device(device)
    inputs, labels = make_dataset(SAMPLES, (3, 32, 32), 10, seed=0)
    inputs, labels = inputs.to(device), labels.to(device)
    model = SmallResNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = ElasticState(model, optimizer, sampler=ElasticSampler(SAMPLES, GLOBAL_BATCH), micro_batch=MICRO)
    if args.ckpt and Path(args.ckpt).exists():
        state.restore(torch.load(args.ckpt, weights_only=False, map_location=device))  # the baseline's restart
    state.membership = Membership(
        worker_id,
        PlanFile(Path(os.environ[jobenv.TASK_DIR]) / jobenv.ELASTIC_PLAN_FILE),
        backend=args.backend,
        reform_timeout_s=60.0,
        join_timeout_s=300.0,
        reporter=lambda message: send("report", worker_id, message),
    )

    def on_step(state: ElasticState, loss: float) -> None:
        send("step", worker_id, state.step, time.time(), state.world)
        if args.ckpt and args.ckpt_every and state.rank == 0 and state.step % args.ckpt_every == 0:
            tmp = f"{args.ckpt}.tmp"
            torch.save(state.capture(), tmp)
            os.replace(tmp, args.ckpt)
            send("checkpoint", worker_id, state.step)

    elastic_steps(state, inputs, labels, 10**9, on_step=on_step)
    state.membership.close()
    send("left", worker_id, state.step)


# -- what the workers say ---------------------------------------------------------------------------


class Reports:
    """The workers' messages (one datagram each, on an abstract unix socket) and waits on them."""

    def __init__(self, wait_s: float = 300.0) -> None:
        self.wait_s = wait_s  # how long any wait on the workers lasts before the run is given up
        self.name = f"gpuherd-bench-elastic-{os.getpid()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + self.name.encode())
        self.sock.setblocking(False)
        self.steps: list[tuple[str, int, float, int]] = []  # (worker, step, at, world)
        self.checkpoints: list[int] = []
        self.rescales: list[dict] = []
        self.left: set[str] = set()

    async def until(self, done: Callable[[], bool], what: str = "") -> None:
        timeout = self.wait_s
        deadline = time.monotonic() + timeout
        while not done():
            try:
                kind, who, *rest = json.loads(self.sock.recv(65536))
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:.0f}s for {what or 'the workers'}") from None
                await asyncio.sleep(0.002)
                continue
            if kind == "step":
                self.steps.append((who, *rest))
            elif kind == "checkpoint":
                self.checkpoints.append(rest[0])
            elif kind == "report":
                self.rescales.append(rest[0])
            elif kind == "left":
                self.left.add(who)

    def completed(self, generation: int) -> dict | None:
        return next((r for r in self.rescales if r.get("event") == "completed" and r["generation"] == generation), None)

    def step_now(self) -> int:
        return max((s for _, s, _, _ in self.steps), default=0)

    def first_step_at(self, world: int, after: float) -> float | None:
        return next((at for _, _, at, w in self.steps if w == world and at > after), None)

    def last_step_before(self, moment: float) -> float:
        return max((at for _, _, at, _ in self.steps if at <= moment), default=moment)

    def step_time(self, world: int) -> float:
        """Median time between two steps of the job at ``world`` workers."""
        ended: dict[int, float] = {}  # step -> when its last worker finished it
        for _, step, at, w in self.steps:
            if w == world:
                ended[step] = max(ended.get(step, 0.0), at)
        times = [ended[s] for s in sorted(ended)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return statistics.median(gaps) if gaps else float("nan")

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass
class Rescale:
    way: str
    change: str
    to_first_step_s: float
    stood_still_s: float
    lost_steps: int = 0
    lost_s: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(reports: Reports, options: WorkerOptions) -> list[str]:
    """This file as the job's script, reporting to ``reports``."""
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--worker", "--report", reports.name, *options.argv()]


# -- gpuherd: the job on cpu executors, rescaled as the scheduler and agents do ------------------------


def executor_class(options: WorkerOptions) -> type:
    """The ``cpu`` executor; with ``--device cuda`` the same, its virtual GPUs on this machine's
    real ones. The cpu executor hides CUDA from its workers (``CUDA_VISIBLE_DEVICES=""``): here
    every worker sees the machine's GPUs, and shares GPU 0 (gloo) or takes its own (nccl). The
    ``nvml`` executor would give each worker a GPU of its own, which one GPU cannot do for three."""
    from services.nodeagent.executors.cpu import CpuExecutor

    if options.device == "cpu":
        return CpuExecutor

    class GpuSharingExecutor(CpuExecutor):
        def device_env(self, gpus: tuple[int, ...], local_rank: int, neighbors: tuple[int, ...] = ()) -> dict[str, str]:
            env = super().device_env(gpus, local_rank, neighbors)
            del env[jobenv.CUDA_VISIBLE_DEVICES]
            return env

    return GpuSharingExecutor


class Nodes:
    """Node ``a`` runs the job's first two workers (its shim keeps their standby); node ``b`` is where
    a grow onto another node lands (its agent keeps a warm pool); node ``c``, the same without a pool."""

    def __init__(self, folder: Path, reports: Reports, options: WorkerOptions) -> None:
        from gpuherd import events as ev

        make_executor = executor_class(options)
        folder.mkdir(parents=True, exist_ok=True)
        self.alive = folder / "alive"
        self.alive.touch()
        settings = {"alive_file": self.alive, "fence_after_s": 3600.0, "kill_grace_s": 5.0, "gpus": 4}
        self.nodes = {
            "a": make_executor(folder / "a", **settings),  # type: ignore[arg-type]
            "b": make_executor(folder / "b", warm_workers=1, warm_min_free_mb=512, **settings),  # type: ignore[arg-type]
            "c": make_executor(folder / "c", **settings),  # type: ignore[arg-type]
        }
        for name, executor in self.nodes.items():
            executor.node = name
        command = tuple(worker_command(reports, options))
        self.spec = ev.JobSpec(
            name=JOB,
            user="bench",
            gpus=2,
            command=command,
            env=options.env(),
            elastic=ev.Elastic(min=1, max=6, global_batch=GLOBAL_BATCH, micro_batch=MICRO),
        )
        self.generation = -1
        self.running: set[str] = set()  # nodes with a task of the job
        self.standby_taken = 0  # grows within node a: its shim's standby became the new worker
        self._watchers: list[asyncio.Task[None]] = []

    def launch(self, gpus: tuple[int, ...]) -> Any:
        from services.nodeagent.executors import TaskKey, TaskLaunch

        return TaskLaunch(
            key=TaskKey(JOB, 0), spec=self.spec, gpus=gpus, procs=len(gpus), world_size=len(gpus), elastic=True
        )

    async def start(self, node: str, gpus: tuple[int, ...]) -> None:
        async def ended() -> None:
            await self.nodes[node].exits.get()
            self.running.discard(node)  # its last worker left

        self.running.add(node)
        await self.nodes[node].start(self.launch(gpus))
        self._watchers.append(asyncio.create_task(ended()))

    def commit(self, workers: tuple[str, ...], joiners: tuple[str, ...] = ()) -> tuple[ElasticPlan, float]:
        """A new generation, handed to every node the job runs on (as each agent's WritePlan does)."""
        from services.nodeagent.executors import TaskKey

        self.generation += 1
        decided = time.time()
        plan = ElasticPlan(self.generation, workers, "127.0.0.1", _free_port(), workers[0], joiners, decided)
        for node in self.running:
            self.nodes[node].write_plan(TaskKey(JOB, 0), plan)
        return plan, decided

    def standby_warm(self) -> int:
        """How often the shim's standby on node a got warm (its log says so each time)."""
        from gpuherd.train.standby import WARM_MARKER

        path = self.nodes["a"].task_dir(self.launch(()).key) / "standby.log"
        return path.read_text().count(WARM_MARKER) if path.exists() else 0

    async def close(self) -> None:
        from services.nodeagent.executors import TaskKey

        for node in list(self.running):
            await self.nodes[node].stop(TaskKey(JOB, 0), "the benchmark is over")
        for watcher in self._watchers:
            watcher.cancel()
        for executor in self.nodes.values():
            await executor.shutdown()


async def measure_gpuherd(
    folder: Path, repeats: int, warm_steps: int, options: WorkerOptions, cold: bool, wait_s: float
) -> list[Rescale]:
    reports = Reports(wait_s)
    nodes = Nodes(folder, reports, options)
    results: list[Rescale] = []
    try:
        nodes.nodes["b"].start_pool()
        pool = nodes.nodes["b"].pool
        assert pool is not None
        await nodes.start("a", (0, 1))
        nodes.commit(("a/0", "a/1"))
        await reports.until(lambda: reports.step_now() >= warm_steps, what="the first steps")
        ways = [("grow within the node (its standby)", "a"), ("grow onto another node, pool warm", "b")]
        if cold:
            ways.append(("grow onto another node, pool empty", "c"))

        async def settled() -> None:
            """As long after the last rescale: the standby and the pool warm again (no import running),
            a few steps at the current size."""
            await reports.until(lambda: nodes.standby_warm() > nodes.standby_taken, what="the standby")
            await reports.until(lambda: pool.ready() >= 1, what="the pool")
            target = reports.step_now() + 8
            await reports.until(lambda: reports.step_now() >= target)

        for _ in range(repeats):
            for way, node in ways:
                await reports.until(lambda n=node: n == "a" or n not in nodes.running, what=f"node {node} free")
                await settled()
                joiner = f"{node}/{2 if node == 'a' else 0}"
                results.append(await _rescale(nodes, reports, "2 -> 3", way, ("a/0", "a/1", joiner), joiner))
                await settled()
                results.append(await _rescale(nodes, reports, "3 -> 2", "shrink", ("a/0", "a/1"), ""))
                await reports.until(lambda j=joiner: j in reports.left, what=f"{joiner} to leave")
    finally:
        await nodes.close()
        reports.close()
    return results


async def _rescale(
    nodes: Nodes, reports: Reports, change: str, way: str, workers: tuple[str, ...], joiner: str
) -> Rescale:
    world = len(workers)
    if joiner:
        node, gpu = joiner.split("/")
        key = nodes.launch(()).key
        if node in nodes.running:  # a grow within a node that runs the job: the agent's StartWorkers
            plan, decided = nodes.commit(workers, (joiner,))
            nodes.nodes[node].grow(key, nodes.launch((int(gpu),)))
            nodes.standby_taken += 1
        else:  # a grow onto another node: that agent starts the job's task there, then hands it the plan
            plan, decided = nodes.commit(workers, (joiner,))
            await nodes.start(node, (int(gpu),))
            nodes.nodes[node].write_plan(key, plan)
    else:
        plan, decided = nodes.commit(workers)
    await reports.until(lambda: reports.first_step_at(world, decided) is not None, what=f"{change} {way}")
    first = reports.first_step_at(world, decided)
    assert first is not None
    await reports.until(lambda: reports.completed(plan.generation) is not None, what="the rescale's report")
    t = (reports.completed(plan.generation) or {})["times"]
    phases = {
        "wait_s": t["quiesced"] - t["noticed"],
        "reform_s": t["reformed"] - t["quiesced"],
        "restore_s": t["restored"] - t["reformed"],
        "first_step_s": t["first_step"] - t["restored"],
        "pause_s": t["first_step"] - t["quiesced"],  # what `gpuherd rescales` and the demo call the pause
    }
    target = reports.step_now() + 6
    await reports.until(lambda: reports.step_now() >= target)
    still = first - reports.last_step_before(t["quiesced"]) - reports.step_time(world)  # less the step it takes anyway
    print(f"{change} {way}: {first - decided:.2f}s to the first step", file=sys.stderr)
    return Rescale(way, change, first - decided, max(0.0, still), phases=phases)


# -- the baseline: kill, restart cold, restore from disk ---------------------------------------------


async def measure_baseline(
    folder: Path, repeats: int, warm_steps: int, ckpt_every: int, options: WorkerOptions, wait_s: float
) -> list[Rescale]:
    reports = Reports(wait_s)
    ckpt = str(folder / "checkpoint.pt")
    procs: list[subprocess.Popen[bytes]] = []
    results = []

    def start(workers: tuple[str, ...]) -> None:
        task_dir = folder / f"restart-{time.monotonic_ns()}"  # a fresh group: generation 0, a new store
        task_dir.mkdir()
        plan = ElasticPlan(0, workers, "127.0.0.1", _free_port(), workers[0], decided_at=time.time())
        (task_dir / jobenv.ELASTIC_PLAN_FILE).write_text(plan.to_json())
        for w in workers:
            env = dict(os.environ, PYTHONUNBUFFERED="1") | options.env()
            env.pop(WARM_CUDA, None)  # a restart has no standby: each worker creates its context
            env |= {jobenv.ELASTIC_WORKER: w, jobenv.TASK_DIR: str(task_dir)}
            argv = [*worker_command(reports, options), "--ckpt", ckpt, "--ckpt-every", str(ckpt_every)]
            with open(task_dir / f"{w.replace('/', '-')}.log", "ab") as log:
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True))

    def kill_all() -> None:
        for proc in procs:
            with_group(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        procs.clear()
        reports.steps.clear()  # the next workers count from the checkpoint they restore

    try:
        start(("a/0", "a/1"))
        await reports.until(lambda: reports.step_now() >= warm_steps and bool(reports.checkpoints))
        for _ in range(repeats):
            for change, workers in (("2 -> 3", ("a/0", "a/1", "b/0")), ("3 -> 2", ("a/0", "a/1"))):
                # Decide half-way between two checkpoints (on average, that is what a restart loses).
                await reports.until(lambda: reports.step_now() % ckpt_every == ckpt_every // 2)
                at_decision, last_ckpt = reports.step_now(), max(reports.checkpoints)
                step_before = reports.step_time(3 if change == "3 -> 2" else 2)
                decided = time.time()
                last = reports.last_step_before(decided)
                kill_all()
                start(workers)
                world = len(workers)
                await reports.until(lambda w=world, d=decided: reports.first_step_at(w, d) is not None)
                first = reports.first_step_at(world, decided)
                assert first is not None
                lost = at_decision - last_ckpt
                target = reports.step_now() + ckpt_every
                await reports.until(lambda t=target: reports.step_now() >= t)
                still = first - last - reports.step_time(world)
                print(f"{change} restart: {first - decided:.2f}s to the first step", file=sys.stderr)
                way = "restart from checkpoint"
                results.append(Rescale(way, change, first - decided, max(0.0, still), lost, lost * step_before))
    finally:
        kill_all()
        reports.close()
    return results


def with_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


# -- the table ----------------------------------------------------------------------------------------


def rows(ours: list[Rescale], baseline: list[Rescale]) -> list[dict[str, Any]]:
    out = []
    restart = {
        change: statistics.median(r.to_first_step_s for r in baseline if r.change == change)
        for change in {r.change for r in baseline}
    }
    ways = list(dict.fromkeys((r.change, r.way) for r in ours))
    ways += list(dict.fromkeys((r.change, r.way) for r in baseline))
    for change, way in ways:
        mine = [r for r in [*ours, *baseline] if (r.change, r.way) == (change, way)]
        first = statistics.median(r.to_first_step_s for r in mine)
        row = {
            "change": change,
            "way": way,
            "decision_to_first_step_s": round(first, 3),
            "stood_still_s": round(statistics.median(r.stood_still_s for r in mine), 3),
            "restart_baseline_s": round(restart[change], 3),
            "vs_restart": round(restart[change] / first, 1),
            "samples": len(mine),
        }
        if mine[0].phases:
            row["phases_s"] = {k: round(statistics.median(r.phases[k] for r in mine), 3) for k in mine[0].phases}
        if way == "restart from checkpoint":
            row["lost_steps"] = statistics.median(r.lost_steps for r in mine)
            row["lost_s"] = round(statistics.median(r.lost_s for r in mine), 2)
        out.append(row)
    return out


SETUP_PROBE = """
import json, os, sys, time
t0 = time.perf_counter()
import torch, torch.distributed as dist
t1 = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, is_master=True)
dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.ones(1, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
t3 = time.perf_counter()
dist.destroy_process_group()
print(json.dumps({"import_torch_s": t1 - t0, "cuda_context_s": t2 - t1, "nccl_communicator_s": t3 - t2}))
"""


def cuda_setup_times(samples: int = 3) -> dict[str, float]:
    """A fresh process's GPU setup, each part timed apart (medians of ``samples`` processes): what
    a warm worker has done before it is needed, and what every worker of a restart pays."""
    runs = []
    for _ in range(samples):
        out = subprocess.run(
            [sys.executable, "-c", SETUP_PROBE, str(_free_port())], capture_output=True, text=True, timeout=60
        )
        if out.returncode != 0:
            raise RuntimeError(f"the CUDA setup probe failed: {out.stderr.strip()[-2000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def print_table(table_rows: list[dict[str, Any]], repeats: int, options: WorkerOptions) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    where = f"{options.device}/{options.backend}"
    table = Table(title=f"Rescale of the example CNN ({where}, global batch {GLOBAL_BATCH}), median of {repeats}")
    for name in ("change", "way", "decision -> first step s", "stood still s", "lost work", "restart s", "vs restart"):
        table.add_column(name, justify="right")
    for row in sorted(table_rows, key=lambda r: (r["change"], r["way"] == "restart from checkpoint")):
        lost = f"{row['lost_steps']:.0f} steps ({row['lost_s']:.1f} s)" if "lost_steps" in row else "0"
        table.add_row(
            row["change"],
            row["way"],
            f"{row['decision_to_first_step_s']:.2f}",
            f"{row['stood_still_s']:.2f}",
            lost,
            f"{row['restart_baseline_s']:.2f}",
            f"{row['vs_restart']:.1f}x",
        )
    console.print(table)
    console.print("vs restart: the restart baseline's decision -> first step over the row's (same change, same run).")
    phases = Table(title="gpuherd rescale phases (medians, s): from RescaleCompleted's timestamps")
    for name in ("change", "way", "wait (new worker starts; training goes on)", "re-form", "restore", "first step"):
        phases.add_column(name, justify="right")
    phases.add_column("pause (quiesce -> first step)", justify="right")
    for row in table_rows:
        if "phases_s" in row:
            p = row["phases_s"]
            phases.add_row(row["change"], row["way"], *(f"{p[k]:.3f}" for k in p))
    console.print(phases)
    console.print("pause: what `gpuherd rescales` and the demo show (RescaleCompleted's quiesced -> first_step).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="grow/shrink cycles per way")
    parser.add_argument("--warm-steps", type=int, default=10)
    parser.add_argument("--ckpt-every", type=int, default=20, help="baseline: steps between checkpoints")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--cold", action="store_true", help="also grow onto a node whose pool is empty")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the workers train")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="the workers' process group")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of tables")
    parser.add_argument("--wait-s", type=float, default=300.0, help="give up when the workers are this late")
    # The worker's own arguments (this file is also the job's script).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    options = WorkerOptions(args.threads, args.device, args.backend)
    setup = check_device(options)
    if setup:
        print(f"a fresh process's setup on this GPU (median of 3, s): {setup}", file=sys.stderr)
    from gpuherd.obs import configure

    configure("bench-elastic", level="WARNING")  # the executors' logs: to stderr, and only what went wrong
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        try:
            ours = asyncio.run(
                measure_gpuherd(folder / "gpuherd", args.repeats, args.warm_steps, options, args.cold, args.wait_s)
            )
            (folder / "restart").mkdir()
            baseline = asyncio.run(
                measure_baseline(
                    folder / "restart", args.repeats, args.warm_steps, args.ckpt_every, options, args.wait_s
                )
            )
        except BaseException:
            print_worker_logs(folder)
            raise
    table_rows = rows(ours, baseline)
    if args.json:
        print(json.dumps({"rows": table_rows, "fresh_process_setup_s": setup} if setup else table_rows, indent=2))
    else:
        if setup:
            print(f"a fresh process's setup on this GPU (median of 3, s): {setup}")
        print_table(table_rows, args.repeats, options)


def print_worker_logs(folder: Path, lines: int = 25) -> None:
    """The end of every log the workers and their shims wrote: why a run that failed did."""
    for path in sorted(folder.rglob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {path.relative_to(folder)} (last {len(tail)} lines)", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)


def check_device(options: WorkerOptions) -> dict[str, float]:
    """Refuses what this machine cannot run; on CUDA, the fresh-process setup times."""
    import torch

    if options.backend == "nccl" and options.device != "cuda":
        raise SystemExit("--backend nccl trains on GPUs: add --device cuda")
    if options.device == "cpu":
        return {}
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU on this machine")
    if options.backend == "nccl" and torch.cuda.device_count() <= THIRD_GPU:
        raise SystemExit(
            f"--backend nccl needs {THIRD_GPU + 1} GPUs (NCCL refuses two ranks on one GPU) and this machine has "
            f"{torch.cuda.device_count()}: use --backend gloo, which lets the workers share a GPU"
        )
    try:
        return cuda_setup_times()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the rescales are still worth measuring
        print(f"the CUDA setup probe failed: {exc}", file=sys.stderr)
        return {}


if __name__ == "__main__":
    main()
