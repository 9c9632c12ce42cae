"""Elastic data parallelism, the runtime half: training state that survives a change of world size.

The contract a rescale keeps is that the job trains as if it had never been resized:

- **One global sample order.** ``ElasticSampler`` fixes, per epoch, one permutation of the
  dataset (seeded by the job's seed and the epoch) and a global cursor. Every step consumes the
  next ``global_batch`` samples of that order whatever the world size, so after any rescale no
  sample of the epoch is skipped or seen twice.
- **A constant global batch.** A step is ``global_batch`` samples at every size: each of the
  ``world`` ranks runs ``accumulation_steps(global_batch, world, micro_batch)`` micro-batches and
  scales its loss by ``1 / accumulation``; DDP's average over ranks then gives the mean over the
  global batch, as one big batch would. A global batch that does not divide is refused with the
  sizes that would work.
- **All of the state.** ``ElasticState`` captures model, optimizer, LR scheduler, AMP grad
  scaler, step, sampler position and every RNG (Python, NumPy, torch CPU and CUDA) as one
  in-memory snapshot: what is committed at a step boundary, restored on a rollback, and
  broadcast from the oldest surviving rank to the ranks that join.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import itertools
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from gpuherd.errors import GpuherdError
from gpuherd.jobenv import ElasticPlan


class ElasticError(GpuherdError):
    """A rescale could not be carried out, and no plan to recover with came in time."""


class GlobalBatchError(GpuherdError, ValueError):
    """The global batch cannot be kept constant at this world size and micro-batch."""


def accumulation_steps(global_batch: int, world: int, micro_batch: int) -> int:
    """Micro-batches each rank runs per step so that ``world`` ranks together see ``global_batch``."""
    if min(global_batch, world, micro_batch) < 1:
        raise GlobalBatchError(
            f"global batch, world size and micro-batch must be positive: {global_batch}, {world}, {micro_batch}"
        )
    per_step = world * micro_batch
    if global_batch % per_step:
        fits = [w for w in range(1, global_batch // micro_batch + 1) if global_batch % (w * micro_batch) == 0]
        raise GlobalBatchError(
            f"a global batch of {global_batch} is not a whole number of {world} ranks x {micro_batch} samples; "
            f"with micro-batch {micro_batch} it works at world sizes {fits}"
        )
    return global_batch // per_step


class ElasticSampler:
    """The global sample order of each epoch and how far the job is through it."""

    def __init__(self, dataset_size: int, global_batch: int, *, seed: int = 0, fixed_batch: bool = True) -> None:
        if not 0 < global_batch <= dataset_size:
            raise GlobalBatchError(f"a global batch of {global_batch} does not fit a dataset of {dataset_size}")
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.fixed_batch = fixed_batch  # False: the batch follows the world size (an LR-scaling rule)
        self.seed = seed
        self.epoch = 0
        self.cursor = 0  # samples of this epoch's order already consumed, by all ranks together
        self._order: torch.Tensor | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches per epoch (the remainder of the order is dropped, as drop_last)."""
        return self.dataset_size // self.global_batch

    def order(self) -> torch.Tensor:
        """This epoch's permutation of the dataset."""
        if self._order is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = torch.randperm(self.dataset_size, generator=generator)
        return self._order

    def step_indices(self) -> torch.Tensor:
        """The global batch of the current step."""
        return self.order()[self.cursor : self.cursor + self.global_batch]

    def micro_batches(self, rank: int, world: int, micro_batch: int) -> list[torch.Tensor]:
        """This rank's micro-batches of the current step: the global batch cut into
        ``world x accumulation`` micro-batches, round ``a`` giving micro-batch ``a * world + r``
        to rank ``r``."""
        rounds = accumulation_steps(self.global_batch, world, micro_batch)
        batch = self.step_indices()
        return [batch[(a * world + rank) * micro_batch : (a * world + rank + 1) * micro_batch] for a in range(rounds)]

    def advance(self) -> None:
        """The step is done (on every rank): move the cursor, and to the next epoch at its end."""
        self.cursor += self.global_batch
        if self.cursor + self.global_batch > self.dataset_size:
            self.epoch += 1
            self.cursor = 0
            self._order = None

    def resize(self, global_batch: int) -> None:
        """A batch that follows the world size: the cursor stays (no sample skipped or repeated);
        if the new batch no longer fits in what is left of the epoch, the next epoch starts."""
        if self.fixed_batch and global_batch != self.global_batch:
            raise GlobalBatchError(f"this sampler keeps its global batch of {self.global_batch}")
        if not 0 < global_batch <= self.dataset_size:
            raise GlobalBatchError(f"a global batch of {global_batch} does not fit a dataset of {self.dataset_size}")
        self.global_batch = global_batch
        if self.cursor + global_batch > self.dataset_size:
            self.epoch += 1
            self.cursor = 0
            self._order = None

    def state_dict(self) -> dict[str, int]:
        return {
            "dataset_size": self.dataset_size,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not self.fixed_batch and state["dataset_size"] == self.dataset_size:
            self.global_batch = state["global_batch"]
        if (state["dataset_size"], state["global_batch"]) != (self.dataset_size, self.global_batch):
            raise GlobalBatchError(
                f"sampler state is for {state['dataset_size']} samples in batches of {state['global_batch']}, "
                f"this sampler has {self.dataset_size} in batches of {self.global_batch}"
            )
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self._order = None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ElasticState:
    """Everything a rescale must carry across, captured and restored as one snapshot.

    With a ``membership`` (an elastic job's worker) the training loop calls ``sync()`` at every
    step boundary: it forms the first generation, carries out a pending rescale, and says whether
    this worker is still part of the job; ``guard()`` around the step turns a peer's death into a
    recovery at the step's start instead of a crash::

        state = ElasticState(model, optimizer, sampler=sampler, micro_batch=8, membership=ctx.membership())
        while state.step < total and state.sync():
            with state.guard():
                model = state.ddp()
                for micro, last in state.micro_batches():
                    ...  # forward / backward, under model.no_sync() unless last
                optimizer.step()
                state.finish_step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sampler: ElasticSampler,
        scheduler: Any | None = None,
        scaler: Any | None = None,
        micro_batch: int | None = None,
        membership: Membership | None = None,
        lr_scaling: str | None = None,
    ) -> None:
        if lr_scaling not in (None, "linear"):
            raise GlobalBatchError(f"unknown LR-scaling rule {lr_scaling!r}; known: linear")
        if lr_scaling is not None and sampler.fixed_batch:
            raise GlobalBatchError("an LR-scaling rule needs ElasticSampler(..., fixed_batch=False)")
        self.lr_scaling = lr_scaling
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.scheduler = scheduler
        self.scaler = scaler
        self.micro_batch = micro_batch or sampler.global_batch
        self.membership = membership
        self.step = 0
        self._marker: dict[str, Any] | None = None
        self._optimizer_steps = 0
        optimizer.register_step_post_hook(self._count_optimizer_step)

    def _count_optimizer_step(self, *_: Any) -> None:
        self._optimizer_steps += 1

    # -- the elastic loop ------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.membership.rank if self.membership is not None else 0

    @property
    def world(self) -> int:
        return self.membership.world if self.membership is not None else 1

    def sync(self) -> bool:
        """At a step boundary: form or join the job's group on the first call, carry out a
        pending rescale, recover from a lost peer. False: this worker has left the job."""
        if self.membership is None:
            self._mark()
            return True
        return self.membership.sync(self)

    def ddp(self) -> torch.nn.Module:
        """The model under DistributedDataParallel for the current generation (rebuilt after a rescale)."""
        if self.membership is None:
            return self.model
        return self.membership.ddp(self.model)

    def micro_batches(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """This rank's micro-batches of the step, each with whether it is the last (the one whose
        backward all-reduces the gradients: the others run under ``no_sync()``)."""
        batches = self.sampler.micro_batches(self.rank, self.world, self.micro_batch)
        for i, indices in enumerate(batches):
            yield indices, i == len(batches) - 1

    def adapt(self, world: int, before: int) -> None:
        """After a switch from ``before`` to ``world`` workers, under an LR-scaling rule: a step is
        ``world x micro_batch`` samples and every learning rate scales by ``world / before``
        (linear scaling; the LR scheduler's base rates too, so a chainable schedule keeps it)."""
        if self.lr_scaling is None:
            return
        self.sampler.resize(world * self.micro_batch)
        if before <= 0 or before == world:
            return
        factor = world / before
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per step; scale each micro-batch's loss by ``1 / accumulation``."""
        if self.lr_scaling is not None:
            return 1  # the batch follows the world: one micro-batch per worker
        return accumulation_steps(self.sampler.global_batch, self.world, self.micro_batch)

    def finish_step(self) -> None:
        """After ``optimizer.step()``: advance the LR schedule, the sampler and the step count."""
        if self.scheduler is not None:
            self.scheduler.step()
        self.sampler.advance()
        self.step += 1

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run one training step; if a peer dies during it (a collective fails before the optimizer
        stepped), put back what the step changed (buffers, RNG, sampler) and let the next ``sync()``
        re-form the group with the survivors. Keep communication after ``optimizer.step()`` out of it."""
        stepped = self._optimizer_steps
        try:
            yield
        except Exception as exc:
            if self.membership is None or not is_collective_failure(exc) or self._optimizer_steps != stepped:
                raise
            self._rewind()
            self.membership.broken(f"a collective failed during step {self.step}: {_first_line(exc)}")

    def _mark(self) -> None:
        """What a step changes before its optimizer step, taken at the step's start (cheap: no parameters)."""
        self._marker = {
            "step": self.step,
            "buffers": {k: v.detach().clone() for k, v in self._module().named_buffers()},
            "sampler": self.sampler.state_dict(),
            "rng": _rng_state(),
        }

    def _rewind(self) -> None:
        marker = self._marker
        if marker is None:
            return
        self.step = marker["step"]
        buffers = dict(self._module().named_buffers())
        with torch.no_grad():
            for name, value in marker["buffers"].items():
                buffers[name].copy_(value)
        self.sampler.load_state_dict(marker["sampler"])
        _set_rng_state(marker["rng"])
        self.optimizer.zero_grad(set_to_none=True)

    def _module(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)  # the model under DDP

    def capture(self) -> dict[str, Any]:
        """A deep, in-memory snapshot (tensors cloned: later training does not change it)."""
        snapshot = {
            "step": self.step,
            "world": self.world if self.membership is not None and self.membership.current is not None else 0,
            "model": {k: v.detach().clone() for k, v in self._module().state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "sampler": self.sampler.state_dict(),
            "rng": _rng_state(),
        }
        if self.scheduler is not None:
            snapshot["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        if self.scaler is not None:
            snapshot["scaler"] = copy.deepcopy(self.scaler.state_dict())
        return snapshot

    def restore(self, snapshot: dict[str, Any]) -> None:
        self.step = int(snapshot["step"])
        self._module().load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        self.sampler.load_state_dict(snapshot["sampler"])
        _set_rng_state(snapshot["rng"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snapshot["scheduler"]))
        if self.scaler is not None:
            self.scaler.load_state_dict(copy.deepcopy(snapshot["scaler"]))

    def broadcast(self, snapshot: dict[str, Any] | None, src: int, group: Any = None) -> dict[str, Any]:
        """Send ``snapshot`` from rank ``src`` to every rank of ``group`` and restore it there;
        every rank returns the snapshot it now holds. Serialized with ``torch.save`` into one
        byte tensor (one broadcast of the size, one of the bytes)."""
        rank = dist.get_rank(group)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        if rank == src:
            if snapshot is None:
                raise ValueError("the source rank must hold the snapshot it broadcasts")
            buffer = io.BytesIO()
            torch.save(snapshot, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(size, src, group=group)
        if rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src, group=group)
        if rank != src:
            snapshot = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False)
        assert snapshot is not None
        self.restore(snapshot)
        return snapshot


def ledger(sampler: ElasticSampler, worlds: Iterator[int], micro_batch: int) -> dict[int, list[int]]:
    """Sample indices consumed per epoch when the steps run at the given world sizes (for
    checking that a sequence of rescales uses every sample of an epoch exactly once)."""
    used: dict[int, list[int]] = {}
    for world in worlds:
        epoch = sampler.epoch
        for rank in range(world):
            for micro in sampler.micro_batches(rank, world, micro_batch):
                used.setdefault(epoch, []).extend(int(i) for i in micro)
        sampler.advance()
    return used


# -- membership: one worker's view of the job's generations -------------------------------------------


class PlanSource(Protocol):
    def latest(self) -> ElasticPlan | None:
        """The newest plan this worker can see (None before the first)."""


class PlanFile:
    """Plans as the node agent writes them into the task folder (a stat per call; read on change)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None
        self._plan: ElasticPlan | None = None

    def latest(self) -> ElasticPlan | None:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return self._plan
        if (info.st_ino, info.st_mtime_ns, info.st_size) != self._seen:  # the agent replaces the file: a new inode
            try:
                plan = ElasticPlan.from_json(self.path.read_text())
            except (OSError, ValueError, KeyError):
                return self._plan  # being replaced: the next call reads the whole new file
            self._seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            if self._plan is None or plan.generation >= self._plan.generation:
                self._plan = plan
        return self._plan


@dataclass
class RescalePhases:
    """Wall-clock times (``time.time()``, comparable with the log's event times) of one rescale as
    its new rank 0 saw them."""

    generation: int
    world: int
    decided_at: float  # the scheduler committed it (JobResized)
    noticed_at: float  # this worker first saw the plan
    quiesced_at: float = 0.0  # state committed in memory at the step boundary; training stops
    reformed_at: float = 0.0  # the new process group is up
    restored_at: float = 0.0  # the source's state is in place on every rank
    first_step_at: float = 0.0  # the first step at the new size is done
    world_before: int = 0
    samples_per_s_before: float | None = None  # throughput at the old size (for the elastic policy)

    def durations(self) -> dict[str, float]:
        return {
            "notice_s": self.noticed_at - self.decided_at,
            "wait_s": self.quiesced_at - self.noticed_at,  # new workers starting while the old ones train
            "reform_s": self.reformed_at - self.quiesced_at,
            "restore_s": self.restored_at - self.reformed_at,
            "first_step_s": self.first_step_at - self.restored_at,
            "pause_s": self.first_step_at - self.quiesced_at,  # no training at either size
            "total_s": self.first_step_at - self.decided_at,
        }


Reporter = Callable[[dict[str, Any]], None]


def _report_to_agent(message: dict[str, Any]) -> None:
    from gpuherd import control
    from gpuherd.train.report import send

    send(control.RescaleReport, **message)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the process group broke (a peer died or hung), not a bug in the step."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out")
    )


def _wait_for_port(
    addr: str, port: int, timeout_s: float, poll_s: float, superseded: Callable[[], bool] = lambda: False
) -> None:
    """Until the generation's store listens (or a newer plan replaced this one, or time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError as exc:
            if superseded():
                raise ElasticError(f"a newer plan replaced the one served at {addr}:{port}") from exc
            if time.monotonic() > deadline:
                raise ElasticError(f"no rendezvous store at {addr}:{port} after {timeout_s:.0f}s: {exc}") from exc
            time.sleep(poll_s)


STORE_GENERATION_KEY = "gpuherd/generation"
STORE_TRY_S = 5.0  # one try at connecting to a generation's store
STORE_RETRY_EVERY_S = 0.5  # between tries at opening a store whose port is busy


def _store_client(addr: str, port: int, try_s: float, timeout: datetime.timedelta) -> dist.TCPStore:
    """Connect to the store at ``addr:port`` within ``try_s`` (TimeoutError otherwise). The client
    connects in a thread of its own: against a listener that is not a store, the handshake never
    ends, whatever its timeout says; such a thread is left behind, blocked, and costs one socket."""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(addr, port, None, False, timeout=timeout)
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=connect, name=f"store-client-{port}", daemon=True)
    thread.start()
    thread.join(try_s)
    if "error" in box:
        raise box["error"]
    if "store" not in box:
        raise TimeoutError(f"{addr}:{port} did not answer as a store within {try_s:.0f}s")
    return box["store"]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


class Membership:
    """One worker of an elastic job: which generation it is in, and how it moves to the next.

    A switch happens at a step boundary that every rank of the current generation agrees on, with
    one small all-reduce per step: the newest generation each has seen (max and min must agree) and,
    for a grow, whether every new worker is ready (new workers start, import and connect to the new
    generation's store, hosted by its rank 0, while the old ones keep training). Then every rank
    commits its state in memory, leaves the old group, joins the new one through that generation's
    own store, and takes the source's state. A switch that fails rolls back to the committed state
    and waits for the scheduler's next plan; so does a group broken by a dead peer."""

    def __init__(
        self,
        worker: str,
        plans: PlanSource,
        *,
        backend: str = "gloo",
        device: torch.device | None = None,
        reform_timeout_s: float = 30.0,
        join_timeout_s: float = 300.0,
        recover_timeout_s: float = 120.0,
        poll_s: float = 0.02,
        store_retry_s: float | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        self.worker = worker
        self.plans = plans
        self.backend = backend
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None)
        self.reform_timeout_s = reform_timeout_s
        self.join_timeout_s = join_timeout_s
        self.recover_timeout_s = recover_timeout_s
        self.poll_s = poll_s
        # How long opening or reaching a generation's store is retried before the switch is given up
        # (a port still held by a process that is ending, a host that is late): bounded, so that the
        # scheduler's rollback (a new port) still comes.
        self.store_retry_s = reform_timeout_s if store_retry_s is None else store_retry_s
        self.report = reporter or _report_to_agent
        self.current: ElasticPlan | None = None
        self.left = False
        self.history: list[RescalePhases] = []  # this worker's rescales (as new rank 0 or not)
        self._broken: str | None = None
        self._store: tuple[int, dist.TCPStore] | None = None  # (generation, store) this worker hosts
        self._ddp: tuple[int, torch.nn.Module] | None = None
        self._noticed: dict[int, float] = {}
        self._pending: RescalePhases | None = None
        self._step_times: list[float] = []
        self._unhostable: set[int] = set()  # generations whose store this worker gave up opening
        self._host_failing: dict[int, tuple[float, float]] = {}  # generation -> (first failure, next try)
        self._batch: int | None = None  # the global batch (for the throughput reported at a rescale)

    # -- what the training loop sees ---------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.current.rank_of(self.worker) if self.current is not None else -1

    @property
    def world(self) -> int:
        return self.current.world if self.current is not None else 0

    def ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.current is None:
            raise ElasticError("call sync() first: this worker has not joined a generation yet")
        if self._ddp is None or self._ddp[0] != self.current.generation:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device is not None and self.device.type == "cuda" else None
            self._ddp = (self.current.generation, DistributedDataParallel(model, device_ids=device_ids))
        return self._ddp[1]

    def broken(self, reason: str) -> None:
        """The group failed during a step (``ElasticState.guard``): recover at the next sync."""
        self._broken = reason

    def sync(self, state: ElasticState) -> bool:
        now = time.time()
        self._step_times = [*self._step_times[-20:], now]
        if self._pending is not None:
            self._pending.first_step_at = now
            self._complete(self._pending)
            self._pending = None
        if self.left:
            return False
        if self.current is None:
            ok = self._start(state)
        elif self._broken is not None:
            ok = self._recover(state)
        else:
            ok = self._at_boundary(state)
        if ok:
            state._mark()
        return ok

    # -- the steps of a rescale -----------------------------------------------------------------------

    def _newer(self) -> ElasticPlan | None:
        plan = self.plans.latest()
        if plan is None or self.current is None or plan.generation <= self.current.generation:
            return None
        self._noticed.setdefault(plan.generation, time.time())
        return plan

    def _at_boundary(self, state: ElasticState) -> bool:
        assert self.current is not None
        plan = self._newer()
        seen = plan.generation if plan is not None else self.current.generation
        ready = self._ready(plan)
        agreed = torch.tensor([seen, -seen, ready], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            self._broken = f"the step-boundary agreement failed: {_first_line(exc)}"
            return self._recover(state)
        newest, oldest, all_ready = (int(v) for v in agreed.cpu())
        if plan is None or newest != -oldest or newest != plan.generation or not all_ready:
            return True  # nothing to do, or not every rank has seen the plan yet, or new workers still start
        return self._switch(state, plan)

    def _ready(self, plan: ElasticPlan | None) -> int:
        """This rank's word on whether the plan's new workers are ready: only the plan's rank 0 (who
        hosts its store) can tell, the others say 0; the all-reduce takes the max."""
        if plan is None:
            return 0
        if not plan.joiners or plan.workers[0] in plan.joiners:
            return 1
        if plan.rank_of(self.worker) != 0:
            return 0
        if plan.generation in self._unhostable:
            return 0
        first, next_try = self._host_failing.get(plan.generation, (0.0, 0.0))
        now = time.monotonic()
        if now < next_try:
            return 0  # training goes on; the store is tried again at a later step boundary
        try:
            store = self._host(plan)
            return int(store.check([f"ready/{j}" for j in plan.joiners]))
        except Exception as exc:
            # The port may still be held (a process that is ending, a connection in TIME_WAIT):
            # try again, at most every half second, for store_retry_s. Then no store, no switch:
            # say so once, and the scheduler commits a rollback generation (a new port) that
            # replaces this plan. Training goes on meanwhile.
            first = first or now
            self._host_failing[plan.generation] = (first, now + STORE_RETRY_EVERY_S)
            if now - first >= self.store_retry_s:
                self._unhostable.add(plan.generation)
                reason = (
                    f"cannot open the store at {plan.addr}:{plan.port} (tried for {now - first:.0f}s): "
                    f"{_first_line(exc)}"
                )
                self.report({"event": "failed", "generation": plan.generation, "reason": reason})
            return 0

    def _host(self, plan: ElasticPlan) -> dist.TCPStore:
        """The generation's rendezvous store, hosted by its rank 0 (opened early for a grow, so new
        workers connect while the old ones train)."""
        if self._store is None or self._store[0] != plan.generation:
            self._store = None
            store = dist.TCPStore(
                plan.addr,
                plan.port,
                None,
                True,
                timeout=datetime.timedelta(seconds=self.reform_timeout_s),
                wait_for_workers=False,
            )
            store.set(STORE_GENERATION_KEY, str(plan.generation))
            self._store = (plan.generation, store)
        return self._store[1]

    def _switch(self, state: ElasticState, plan: ElasticPlan) -> bool:
        assert self.current is not None
        phases = self._phases(plan)
        snapshot = state.capture()  # every rank is at the same step boundary: the all-reduce said so
        phases.quiesced_at = time.time()
        self._teardown(keep_store=plan)
        if plan.rank_of(self.worker) < 0:
            self._leave(plan)
            return False
        return self._enter(state, plan, snapshot, phases)

    def _phases(self, plan: ElasticPlan) -> RescalePhases:
        before = self.current.world if self.current is not None else 0
        return RescalePhases(
            generation=plan.generation,
            world=plan.world,
            decided_at=plan.decided_at,
            noticed_at=self._noticed.get(plan.generation, time.time()),
            world_before=before,
            samples_per_s_before=self._throughput(self.current),
        )

    def _throughput(self, plan: ElasticPlan | None) -> float | None:
        """Samples per second over the recent steps of the current generation (global batch / median step)."""
        times = self._step_times
        if plan is None or len(times) < 4 or self._batch is None:
            return None
        gaps = sorted(b - a for a, b in itertools.pairwise(times[-11:]))
        median = gaps[len(gaps) // 2]
        return self._batch / median if median > 0 else None

    def _enter(
        self, state: ElasticState, plan: ElasticPlan, snapshot: dict[str, Any] | None, phases: RescalePhases
    ) -> bool:
        """Join ``plan``'s group and take its source's state; on failure roll back and wait for the next plan."""
        self._batch = state.sampler.global_batch
        joining = self.current is None or snapshot is None
        try:
            self._form(plan, joining=joining)
            phases.reformed_at = time.time()
            source = plan.rank_of(plan.source)
            if source < 0:
                raise ElasticError(f"generation {plan.generation}: its source {plan.source} is not one of its workers")
            held = state.broadcast(snapshot if plan.source == self.worker else None, src=source)
            state.adapt(plan.world, int(held.get("world", 0)))
            phases.restored_at = time.time()
        except Exception as exc:
            return self._failed(state, plan, snapshot, phases, f"{type(exc).__name__}: {_first_line(exc)}")
        self.current = plan
        self._step_times = []  # throughput is measured per generation
        self._store = None if self._store is not None and self._store[0] != plan.generation else self._store
        self.history.append(phases)
        if plan.rank_of(self.worker) == 0 and plan.generation > 0:
            self._pending = phases  # reported once the first step at the new size is done
        return True

    def _form(self, plan: ElasticPlan, *, joining: bool) -> None:
        rank = plan.rank_of(self.worker)
        timeout = datetime.timedelta(seconds=self.join_timeout_s if joining else self.reform_timeout_s)
        store = self._host_patiently(plan) if rank == 0 else self._connect(plan, timeout)
        if self.worker in plan.joiners:
            store.set(f"ready/{self.worker}", "1")
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"g{plan.generation}", store),
            rank=rank,
            world_size=plan.world,
            timeout=timeout,
        )

    def _host_patiently(self, plan: ElasticPlan) -> dist.TCPStore:
        """Open the generation's store, trying again for ``store_retry_s`` while its port is busy."""
        deadline = time.monotonic() + self.store_retry_s
        while True:
            try:
                return self._host(plan)
            except dist.DistError as exc:
                if self._superseded(plan):
                    raise ElasticError(f"a newer plan replaced generation {plan.generation}") from exc
                if time.monotonic() > deadline:
                    raise ElasticError(
                        f"cannot open the store at {plan.addr}:{plan.port} (tried for {self.store_retry_s:.0f}s): "
                        f"{_first_line(exc)}"
                    ) from exc
                time.sleep(STORE_RETRY_EVERY_S)

    def _connect(self, plan: ElasticPlan, timeout: datetime.timedelta) -> dist.TCPStore:
        """A client of the generation's store, once its host serves this generation. The host may be
        late (still starting, or retrying a busy port), and until it listens another process may
        hold the port: each try is bounded (a client of something that is not a store would wait
        forever), and tries go on until ``timeout`` or a newer plan."""
        deadline = time.monotonic() + timeout.total_seconds()
        superseded = lambda: self._superseded(plan)  # noqa: E731
        problem = "no answer"
        while True:
            left = deadline - time.monotonic()
            # Poll for the host's port ourselves: the store client backs off for long between tries,
            # and a new worker must be ready the moment the host opens the store.
            _wait_for_port(plan.addr, plan.port, max(left, 0.0), self.poll_s, superseded)
            try:
                store = _store_client(plan.addr, plan.port, min(max(left, 1.0), STORE_TRY_S), timeout)
                found = store.get(STORE_GENERATION_KEY).decode() if store.check([STORE_GENERATION_KEY]) else None
                if found == str(plan.generation):
                    return store
                problem = "it serves no generation yet" if found is None else f"it serves generation {found}"
            except (dist.DistError, TimeoutError) as exc:
                problem = _first_line(exc)
            if superseded():
                raise ElasticError(f"a newer plan replaced generation {plan.generation}")
            if time.monotonic() > deadline:
                raise ElasticError(
                    f"no store for generation {plan.generation} at {plan.addr}:{plan.port} within "
                    f"{timeout.total_seconds():.0f}s: {problem}"
                )
            time.sleep(max(self.poll_s, 0.05))

    def _superseded(self, plan: ElasticPlan) -> bool:
        newest = self.plans.latest()
        return newest is not None and newest.generation > plan.generation

    def _failed(
        self,
        state: ElasticState,
        plan: ElasticPlan,
        snapshot: dict[str, Any] | None,
        phases: RescalePhases,
        reason: str,
    ) -> bool:
        if snapshot is not None:
            state.restore(snapshot)  # back to what was committed at the old size: no progress lost
        self._teardown()
        self.report({"event": "failed", "generation": plan.generation, "reason": reason, "step": state.step})
        following = self._wait(lambda p: p.generation > plan.generation, self.recover_timeout_s)
        if following is None:
            raise ElasticError(
                f"the switch to generation {plan.generation} failed ({reason}) and no new plan came within "
                f"{self.recover_timeout_s:.0f}s"
            )
        if following.rank_of(self.worker) < 0:
            self._leave(following)
            return False
        retry = self._phases(following)
        retry.quiesced_at = phases.quiesced_at or time.time()  # training has stood still since then
        return self._enter(state, following, snapshot, retry)

    def _recover(self, state: ElasticState) -> bool:
        """A peer died: the state is back at the step's start (``guard``); wait for the scheduler's
        plan without the dead worker and re-form with it."""
        assert self.current is not None
        reason, self._broken = self._broken or "the group broke", None
        self._teardown()
        self.report({"event": "peer-lost", "generation": self.current.generation, "reason": reason, "step": state.step})
        following = self._wait(lambda p: p.generation > self.current.generation, self.recover_timeout_s)
        if following is None:
            raise ElasticError(f"{reason}; no plan without the lost worker came within {self.recover_timeout_s:.0f}s")
        if following.rank_of(self.worker) < 0:
            self._leave(following)
            return False
        phases = self._phases(following)
        phases.quiesced_at = time.time()
        return self._enter(state, following, state.capture(), phases)

    def _start(self, state: ElasticState) -> bool:
        """The first sync: the job's first generation (every worker starts together) or joining a
        running job (a grow): connect, say ready, and take the source's state."""
        plan = self._wait(lambda p: p.rank_of(self.worker) >= 0, self.join_timeout_s)
        if plan is None:
            raise ElasticError(f"worker {self.worker} found no plan naming it within {self.join_timeout_s:.0f}s")
        phases = self._phases(plan)
        # Nothing trained at an older size here (the job grew before its first generation formed,
        # or this worker joins): from now on it stands still until its first step at the new size.
        phases.quiesced_at = time.time()
        if self.worker not in plan.joiners:
            return self._enter(state, plan, state.capture(), phases)
        return self._enter(state, plan, None, phases)

    def _leave(self, plan: ElasticPlan) -> None:
        self.left = True
        self.current = plan
        self.report({"event": "left", "generation": plan.generation})

    def _wait(self, wanted: Callable[[ElasticPlan], bool], timeout_s: float) -> ElasticPlan | None:
        deadline = time.monotonic() + timeout_s
        while True:
            plan = self.plans.latest()
            if plan is not None and wanted(plan):
                self._noticed.setdefault(plan.generation, time.time())
                return plan
            if time.monotonic() > deadline:
                return None
            time.sleep(self.poll_s)

    def _teardown(self, keep_store: ElasticPlan | None = None) -> None:
        self._release_ddp()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._store is not None and (keep_store is None or self._store[0] != keep_store.generation):
            self._store = None

    def _release_ddp(self) -> None:
        """Let the DDP wrapper's reducer go while its process group is still registered. The training
        loop may still hold the wrapper; if the reducer were the group's last owner, the group's
        destructor would run under the GIL and wait for gloo's threads, which may need the GIL to
        free the last collective's tensors: a deadlock (pytorch/pytorch#56297)."""
        if self._ddp is not None:
            ddp = self._ddp[1]
            for attribute in ("logger", "reducer"):
                if hasattr(ddp, attribute):
                    setattr(ddp, attribute, None)
        self._ddp = None

    def _complete(self, phases: RescalePhases) -> None:
        self.report(
            {
                "event": "completed",
                "generation": phases.generation,
                "world": phases.world,
                "world_before": phases.world_before,
                "samples_per_s_before": phases.samples_per_s_before,
                "times": {
                    "decided": phases.decided_at,
                    "noticed": phases.noticed_at,
                    "quiesced": phases.quiesced_at,
                    "reformed": phases.reformed_at,
                    "restored": phases.restored_at,
                    "first_step": phases.first_step_at,
                },
            }
        )

    def close(self) -> None:
        self._teardown()
