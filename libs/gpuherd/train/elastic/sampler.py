"""The global sample order: one permutation per epoch, a cursor, and a constant global batch cut
into each rank's micro-batches whatever the world size."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gpuherd.train.elastic.errors import GlobalBatchError


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
