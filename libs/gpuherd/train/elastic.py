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

import copy
import io
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gpuherd.errors import GpuherdError


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

    def __init__(self, dataset_size: int, global_batch: int, *, seed: int = 0) -> None:
        if not 0 < global_batch <= dataset_size:
            raise GlobalBatchError(f"a global batch of {global_batch} does not fit a dataset of {dataset_size}")
        self.dataset_size = dataset_size
        self.global_batch = global_batch
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

    def state_dict(self) -> dict[str, int]:
        return {
            "dataset_size": self.dataset_size,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
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
    """Everything a rescale must carry across, captured and restored as one snapshot."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sampler: ElasticSampler,
        scheduler: Any | None = None,
        scaler: Any | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.scheduler = scheduler
        self.scaler = scaler
        self.step = 0

    def _module(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)  # the model under DDP

    def capture(self) -> dict[str, Any]:
        """A deep, in-memory snapshot (tensors cloned: later training does not change it)."""
        snapshot = {
            "step": self.step,
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
