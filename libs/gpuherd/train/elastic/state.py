"""``ElasticState``: everything a rescale carries across (model, optimizer, LR schedule, scaler,
step, sampler position, RNG), and the worker loop's steps around it (sync, guard, finish_step)."""

from __future__ import annotations

import contextlib
import copy
import io
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from gpuherd.train.elastic.errors import GlobalBatchError, first_line, is_collective_failure
from gpuherd.train.elastic.sampler import ElasticSampler, accumulation_steps

if TYPE_CHECKING:
    from gpuherd.train.elastic.membership import Membership


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        # Only the generator of the device this rank trains on: the ranks that take this state may
        # see fewer devices (a job that leases neighbour memory sees its node's other GPUs).
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what ``rng_state`` took. The generators' states are CPU byte tensors whatever device
    a checkpoint was loaded onto: ``torch.load(path, map_location="cuda")`` moves them too, and
    torch refuses a CUDA tensor as a generator's state. The CUDA generator taken is that of the
    device the source trained on; it goes to the device this rank trains on."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"].cpu(), torch.cuda.current_device())
    elif "cuda" in state:
        # Taken by an older gpuherd, one per device its process saw: by device index, those this
        # process has too (a node with fewer GPUs has no generator for the others).
        for index, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state.cpu(), index)


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
            self.membership.broken(f"a collective failed during step {self.step}: {first_line(exc)}")

    def _mark(self) -> None:
        """What a step changes before its optimizer step, taken at the step's start (cheap: no parameters)."""
        self._marker = {
            "step": self.step,
            "buffers": {k: v.detach().clone() for k, v in self._module().named_buffers()},
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
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
        set_rng_state(marker["rng"])
        self.optimizer.zero_grad(set_to_none=True)

    def _module(self) -> torch.nn.Module:
        return getattr(self.model, "module", self.model)  # the model under DDP

    def adopt_buffers_of(self, src: int, group: Any = None) -> None:
        """Give every rank of ``group`` rank ``src``'s buffers (BatchNorm running statistics, ...), as
        DDP (``broadcast_buffers``, its default) does from its rank 0 at every forward. One broadcast
        per dtype and device: a model has many small buffers."""
        kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in self._module().buffers():
            kinds.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        with torch.no_grad():
            for buffers in kinds.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                dist.broadcast(flat, src, group=group)
                offset = 0
                for buffer in buffers:
                    buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()

    def capture(self) -> dict[str, Any]:
        """A deep, in-memory snapshot (tensors cloned: later training does not change it)."""
        snapshot = {
            "step": self.step,
            "world": self.world if self.membership is not None and self.membership.current is not None else 0,
            "model": {k: v.detach().clone() for k, v in self._module().state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
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
        set_rng_state(snapshot["rng"])
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
