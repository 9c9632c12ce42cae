"""Elastic rescale pause: gpuherd's in-process re-formation against kill, restart, restore.

The example CNN (``examples/train_cnn.py``'s SmallResNet on its synthetic data, a constant
global batch) trains in real worker processes over gloo on this machine's CPU. Every way is
measured in the same run, on the same model, data and step:

- **gpuherd**: the workers follow plan files as the node agent writes them
  (``gpuherd.train.elastic.Membership`` + ``PlanFile``). A scale-up starts the new worker, which
  imports and connects while the old ones keep training; then all switch at a step boundary,
  re-form the group through the generation's store and take the state of the oldest worker by
  broadcast. A scale-down switches at the next step boundary. The new worker is a cold process
  (a grow onto a node the job does not run on yet)...
- **gpuherd, standby**: ... or the warm standby the task's shim keeps on a node that runs the
  job (``gpuherd.train.standby``: torch and a first step's lazy imports done before the decision).
- **baseline** (what torchrun-style elastic agents do): stop every worker, start the new set
  at the new size, each loads the last checkpoint from disk and forms a new group. Rank 0
  checkpoints every ``--ckpt-every`` steps; the steps since then are lost and run again.

Measured for each: **decision -> first step at the new size** (the decision is the moment the
plan is written, or the workers are killed), the time training **stood still** (from the last
step that ended before the switch to the first step at the new size, less one step), and
the baseline's **lost work**. Printed as a table with the ratios; medians over ``--repeats``.

    python bench/bench_elastic.py [--repeats 3] [--ckpt-every 20] [--device cuda --backend nccl]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "libs"))

from gpuherd.jobenv import ElasticPlan  # noqa: E402

SAMPLES, GLOBAL_BATCH, MICRO = 3072, 48, 8  # world sizes that keep the batch: 1, 2, 3, 6


@dataclasses.dataclass
class Setup:
    device: str = "cpu"
    backend: str = "gloo"
    threads: int = 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_plan(path: Path, plan: ElasticPlan) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(plan.to_json())
    os.replace(tmp, path)


def worker(worker_id: str, plan_path: str, ckpt: str, ckpt_every: int, setup: Setup, out: Any, go: Any = None) -> None:
    """One worker: builds the example CNN, optionally restores the checkpoint, trains until told
    to leave (or killed). Reports every step and every rescale to ``out``. With ``go``, it is a warm
    standby (``gpuherd.train.standby``): torch is imported (this module imports it), and it waits
    to be handed its worker before it runs the training script's own part."""
    if go is not None:
        from gpuherd.train.standby import warm

        warm()
        out.put(("standby", worker_id))
        go.wait()
    from synthetic import elastic_steps, make_dataset
    from train_cnn import SmallResNet

    from gpuherd.train.elastic import ElasticSampler, ElasticState, Membership, PlanFile

    torch.set_num_threads(setup.threads)
    device = torch.device(setup.device)
    torch.manual_seed(0)
    inputs, labels = make_dataset(SAMPLES, (3, 32, 32), 10, seed=0)
    inputs, labels = inputs.to(device), labels.to(device)
    model = SmallResNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = ElasticState(model, optimizer, sampler=ElasticSampler(SAMPLES, GLOBAL_BATCH), micro_batch=MICRO)
    if ckpt and Path(ckpt).exists():
        state.restore(torch.load(ckpt, weights_only=False, map_location=device))  # the baseline's restart
    state.membership = Membership(
        worker_id,
        PlanFile(Path(plan_path)),
        backend=setup.backend,
        device=device if setup.device != "cpu" else None,
        reform_timeout_s=60.0,
        join_timeout_s=300.0,
        reporter=lambda message: out.put(("report", worker_id, message)),
    )

    def on_step(state: ElasticState, loss: float) -> None:
        out.put(("step", worker_id, state.step, time.time(), state.world))
        if ckpt and ckpt_every and state.rank == 0 and state.step % ckpt_every == 0:
            tmp = f"{ckpt}.tmp"
            torch.save(state.capture(), tmp)
            os.replace(tmp, ckpt)
            out.put(("checkpoint", worker_id, state.step, time.time(), state.world))

    elastic_steps(state, inputs, labels, 10**9, on_step=on_step)
    state.membership.close()
    out.put(("left", worker_id, state.step, time.time(), 0))


class Run:
    """Worker processes, their messages, and waits on them."""

    def __init__(self, folder: Path, setup: Setup, ckpt_every: int = 0) -> None:
        self.context = mp.get_context("spawn")
        self.out = self.context.Queue()
        self.folder = folder
        self.setup = setup
        self.ckpt_every = ckpt_every
        self.procs: dict[str, Any] = {}
        self.steps: list[tuple[str, int, float, int]] = []  # (worker, step, at, world)
        self.checkpoints: list[int] = []
        self.reports: list[dict] = []
        self.standbys: set[str] = set()

    def start(self, worker_id: str, plan: Path, ckpt: str = "", go: Any = None) -> None:
        proc = self.context.Process(
            target=worker, args=(worker_id, str(plan), ckpt, self.ckpt_every, self.setup, self.out, go), daemon=True
        )
        proc.start()
        self.procs[worker_id] = proc

    def kill_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.join()
        self.procs.clear()
        self.steps.clear()  # the next workers count from the checkpoint they restore
        self.out = self.context.Queue()  # a process killed while writing leaves the old queue's lock held

    def pump(self, until: Any, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            try:
                kind, who, *rest = self.out.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError("the workers stopped reporting") from None
            if kind == "step":
                self.steps.append((who, *rest))
            elif kind == "checkpoint":
                self.checkpoints.append(rest[0])
            elif kind == "report":
                self.reports.append(rest[0])
            elif kind == "standby":
                self.standbys.add(who)

    def step_now(self) -> int:
        return max((s for _, s, _, _ in self.steps), default=0)

    def first_step_at(self, world: int, after: float) -> float | None:
        return next((at for _, _, at, w in self.steps if w == world and at > after), None)

    def last_step_before(self, moment: float) -> float:
        return max((at for _, _, at, _ in self.steps if at <= moment), default=moment)

    def step_time(self, world: int) -> float:
        """Median time between two steps of the job at ``world`` workers (rank 0's view: any worker)."""
        ended: dict[int, float] = {}  # step -> when its last worker finished it
        for _, step, at, w in self.steps:
            if w == world:
                ended[step] = max(ended.get(step, 0.0), at)
        times = [ended[s] for s in sorted(ended)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return statistics.median(gaps) if gaps else float("nan")


@dataclasses.dataclass
class Rescale:
    way: str
    change: str
    to_first_step_s: float
    stood_still_s: float
    lost_steps: int = 0
    lost_s: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def measure_gpuherd(folder: Path, setup: Setup, repeats: int, warm_steps: int, *, standby: bool) -> list[Rescale]:
    """``standby``: the new worker is a warm standby the shim keeps (a grow within a node that
    already runs the job); else a new process starts at the decision (a grow onto another node)."""
    run = Run(folder, setup)
    way = "gpuherd, standby" if standby else "gpuherd"
    plan_path = folder / "plan.json"
    ports = iter(_free_port() for _ in range(1000))
    generation = 0
    write_plan(plan_path, ElasticPlan(0, ("a", "b"), "127.0.0.1", next(ports), "a", decided_at=time.time()))
    for w in ("a", "b"):
        run.start(w, plan_path)
    target = warm_steps
    run.pump(lambda: run.step_now() >= target)
    results = []
    for _ in range(repeats):
        for change, workers, joiners in (("2 -> 3", ("a", "b", "c"), ("c",)), ("3 -> 2", ("a", "b"), ())):
            generation += 1
            go = run.context.Event() if standby and joiners else None
            if go is not None:  # the shim's standby, started long before the decision
                run.standbys.discard("c")
                run.start("c", plan_path, go=go)
                run.pump(lambda: "c" in run.standbys)
            decided = time.time()
            if go is not None:
                go.set()  # the shim hands the standby its worker
            elif joiners:
                run.start("c", plan_path)  # the agent starts the new worker as it writes the plan
            write_plan(
                plan_path,
                ElasticPlan(generation, workers, "127.0.0.1", next(ports), "a", joiners=joiners, decided_at=decided),
            )
            world = len(workers)
            run.pump(lambda w=world, d=decided: run.first_step_at(w, d) is not None)
            first = run.first_step_at(world, decided)
            assert first is not None
            run.pump(
                lambda g=generation: any(r.get("event") == "completed" and r["generation"] == g for r in run.reports)
            )
            report = next(r for r in run.reports if r.get("event") == "completed" and r["generation"] == generation)
            t = report["times"]
            phases = {
                "wait_s": t["quiesced"] - t["noticed"],
                "reform_s": t["reformed"] - t["quiesced"],
                "restore_s": t["restored"] - t["reformed"],
                "first_step_s": t["first_step"] - t["restored"],
            }
            last = run.last_step_before(t["quiesced"])
            if not joiners:
                run.procs.pop("c").join(30)  # it left at the switch
            target = run.step_now() + 8
            run.pump(lambda t_=target: run.step_now() >= t_)
            still = first - last - run.step_time(world)  # less the one step it would have taken anyway
            results.append(Rescale(way, change, first - decided, max(0.0, still), phases=phases))
            print(f"{way} {change}: {results[-1].to_first_step_s:.2f}s to the first step", file=sys.stderr)
    run.kill_all()
    return results


def measure_baseline(folder: Path, setup: Setup, repeats: int, warm_steps: int, ckpt_every: int) -> list[Rescale]:
    run = Run(folder, setup, ckpt_every=ckpt_every)
    ckpt = str(folder / "checkpoint.pt")
    results = []

    def start(workers: tuple[str, ...]) -> None:
        plan_path = folder / f"plan-{time.monotonic_ns()}.json"  # a fresh group: generation 0, new store
        write_plan(plan_path, ElasticPlan(0, workers, "127.0.0.1", _free_port(), workers[0], decided_at=time.time()))
        for w in workers:
            run.start(w, plan_path, ckpt)

    start(("a", "b"))
    target = warm_steps
    run.pump(lambda: run.step_now() >= target and run.checkpoints)
    for _ in range(repeats):
        for change, workers in (("2 -> 3", ("a", "b", "c")), ("3 -> 2", ("a", "b"))):
            # Decide half-way between two checkpoints (on average, that is what a restart loses).
            run.pump(lambda: run.step_now() % ckpt_every == ckpt_every // 2)
            at_decision, last_ckpt = run.step_now(), max(run.checkpoints)
            old_world = len(workers) - 1 if len(workers) == 3 else 3
            step_before = run.step_time(old_world)
            decided = time.time()
            last = run.last_step_before(decided)
            run.kill_all()
            start(workers)
            world = len(workers)
            run.pump(lambda w=world, d=decided: run.first_step_at(w, d) is not None)
            first = run.first_step_at(world, decided)
            assert first is not None
            lost = at_decision - last_ckpt
            target = run.step_now() + ckpt_every
            run.pump(lambda t_=target: run.step_now() >= t_)
            still = first - last - run.step_time(world)
            results.append(
                Rescale(
                    "baseline", change, first - decided, max(0.0, still), lost_steps=lost, lost_s=lost * step_before
                )
            )
    run.kill_all()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="scale-up/scale-down cycles per way")
    parser.add_argument("--warm-steps", type=int, default=10)
    parser.add_argument("--ckpt-every", type=int, default=20, help="baseline: steps between checkpoints")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()
    setup = Setup(device=args.device, backend=args.backend, threads=args.threads)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with console.status("gpuherd: in-process rescales"):
            ours = measure_gpuherd(folder, setup, args.repeats, args.warm_steps, standby=False)
            warm = measure_gpuherd(folder, setup, args.repeats, args.warm_steps, standby=True)
        with console.status("baseline: kill, restart, restore from disk"):
            theirs = measure_baseline(folder, setup, args.repeats, args.warm_steps, args.ckpt_every)

    title = f"Rescale of the example CNN ({setup.device}/{setup.backend}, global batch {GLOBAL_BATCH}), "
    table = Table(title=title + f"median of {args.repeats}")
    columns = ("change", "way", "decision -> first step s", "stood still s", "lost work", "baseline / this")
    for name in columns:
        table.add_column(name, justify="right")
    for change in ("2 -> 3", "3 -> 2"):
        base = [r for r in theirs if r.change == change]
        base_first = statistics.median(r.to_first_step_s for r in base)
        base_still = statistics.median(r.stood_still_s for r in base)
        for results in (ours, warm):
            mine = [r for r in results if r.change == change]
            first = statistics.median(r.to_first_step_s for r in mine)
            still = statistics.median(r.stood_still_s for r in mine)
            ratio = f"{base_first / first:.1f}x / {base_still / max(still, 1e-3):.0f}x"
            table.add_row(change, mine[0].way, f"{first:.2f}", f"{still:.2f}", "0", ratio)
        lost = f"{statistics.median(r.lost_steps for r in base):.0f} steps "
        lost += f"({statistics.median(r.lost_s for r in base):.1f} s)"
        table.add_row(change, "baseline", f"{base_first:.2f}", f"{base_still:.2f}", lost, "1.0x")
    console.print(table)
    console.print("ratios: decision -> first step / stood still. 'stood still': no step at either size, less one step.")
    phases = Table(title="gpuherd rescale phases (medians, s): from RescaleCompleted's timestamps")
    for name in ("change", "way", "wait (new worker starts; training goes on)", "re-form", "restore", "first step"):
        phases.add_column(name, justify="right")
    keys = ("wait_s", "reform_s", "restore_s", "first_step_s")
    for change in ("2 -> 3", "3 -> 2"):
        for results in (ours, warm):
            mine = [r for r in results if r.change == change]
            phases.add_row(change, mine[0].way, *(f"{statistics.median(r.phases[k] for r in mine):.3f}" for k in keys))
    console.print(phases)


if __name__ == "__main__":
    main()
