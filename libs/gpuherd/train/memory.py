"""Memory tiers: keep saved activations and optimizer state in leased memory off the GPU.

A job whose working set does not fit its GPU offloads what backward needs later, and what the
optimizer only touches once a step, to memory the broker leased it (``services/memory``):

- **neighbor GPU** (``nvlink`` or ``pcie`` tier): a buffer of exactly the leased size, allocated
  once on the lender (a CUDA device visible to the process: the agent makes the node's GPUs
  visible to jobs that lease memory), filled by device-to-device copies. A peer is trusted only
  after a sentinel pattern copied there and back comes back intact.
- **pinned host memory** (``host`` tier): a pre-allocated page-locked buffer, so copies are
  asynchronous DMA; the slower fallback.

Use::

    tiers = MemoryTiers.from_job(device)          # the leases the agent wrote (none: no pools)
    tiers.offload_optimizer(optimizer)           # optional
    for batch in data:
        tiers.poll()                             # answer revocations, take top-ups
        with tiers.saved_tensors(model):
            loss = model(batch).sum()
        loss.backward()
        optimizer.step()

Saved tensors go to the fastest pool with room (neighbors first, then host; none: they stay);
tensors smaller than ``min_bytes`` and parameters stay. Copies run on a side stream, at most
``copies_in_flight`` behind the compute (more would keep their sources on the device); in backward,
reaching layer *L* starts bringing back the layers below it, ``prefetch_layers`` average layers' bytes
ahead (at least one layer, at most an eighth of what the step offloaded), so the copies overlap the
compute of the layers before them, and the optimizer's state comes back beside those reloads, ready
for ``step()``
(``state_in_backward=False``: at ``step()``, where backward's peak has no room for it, or where
gradients accumulate over several backwards before one ``step()``: each would bring it back again).
With ``keep_mb``, the newest saved tensors of a step, at least that many MiB, stay on the device:
backward needs them first, so they would come back at once, and a device with the room spare
moves fewer bytes over the link. What stays is worked out from the previous step's saved bytes
(the first step offloads everything), so it suits steps of one size. Each pool hands out
activation blocks from its front (all given back when the step's saved tensors die) and
persistent blocks (optimizer state) from its back.

On a revocation the runtime moves every block off the revoked neighbor into host memory (the
host pool, else plain RAM) and reports ``lease-released`` to its agent, which records
``MemoryLeaseReleased``. On CPU (the ``cpu`` executor's virtual GPUs) every pool is host memory:
the same bookkeeping, tested bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuherd import control, jobenv
from gpuherd.errors import GpuherdError
from gpuherd.train.report import send

ALIGN = 512  # bytes: block offsets stay aligned for any dtype and for fast DMA
MiB = 1 << 20
TIER_ORDER = {"nvlink": 0, "pcie": 1, "host": 2, "spill": 3}


class PeerCheckFailed(GpuherdError):
    """A copy to a neighbor GPU and back did not return the data sent: the peer is not used."""


class Pool:
    """A buffer of ``nbytes`` on one device, allocated once: the most this runtime will ever use
    there. Activation blocks come off the front (reset when none is alive), persistent ones off
    the back (freed one by one: first fit)."""

    def __init__(self, name: str, tier: str, device: torch.device, nbytes: int, *, pin: bool = False) -> None:
        self.name = name
        self.tier = tier
        self.device = device
        self.nbytes = nbytes - nbytes % ALIGN
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.front = 0
        self.back = self.nbytes  # persistent blocks live in [back, nbytes)
        self.live_front = 0
        self.persistent: dict[int, int] = {}  # offset -> size
        self.blocks: weakref.WeakSet[Block] = weakref.WeakSet()
        self.revoked = False

    def take(self, nbytes: int, *, persistent: bool) -> int | None:
        size = -(-nbytes // ALIGN) * ALIGN
        if self.revoked:
            return None
        if not persistent:
            if self.front + size > self.back:
                return None
            offset, self.front = self.front, self.front + size
            self.live_front += 1
            return offset
        # first fit in the gaps between persistent blocks, else grow the back region down
        edge = self.back
        for offset in sorted(self.persistent):
            if offset - edge >= size:
                break
            edge = offset + self.persistent[offset]
        else:
            if self.nbytes - edge < size:
                if self.back - size < self.front:
                    return None
                self.back -= size
                self.persistent[self.back] = size
                return self.back
        self.persistent[edge] = size
        return edge

    def give_back(self, offset: int, *, persistent: bool) -> None:
        if persistent:
            self.persistent.pop(offset, None)
            self.back = min(self.persistent, default=self.nbytes)
            return
        self.live_front -= 1
        if self.live_front == 0:
            self.front = 0  # the step's saved tensors are all gone: the front is free again

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]

    @property
    def used(self) -> int:
        return self.front + (self.nbytes - self.back)


class Block:
    """One tensor's bytes in a pool (or in plain RAM once spilled)."""

    def __init__(self, pool: Pool, offset: int, like: torch.Tensor, persistent: bool) -> None:
        self.pool: Pool | None = pool
        self.offset = offset
        self.dtype = like.dtype
        self.shape = like.shape
        self.nbytes = like.numel() * like.element_size()
        self.channels_last = (
            like.dim() == 4 and not like.is_contiguous() and like.is_contiguous(memory_format=torch.channels_last)
        )
        self.persistent = persistent
        self.spilled: torch.Tensor | None = None  # plain RAM after its pool was revoked
        pool.blocks.add(self)

    def raw(self) -> torch.Tensor:
        if self.spilled is not None:
            return self.spilled
        assert self.pool is not None
        return self.pool.view(self.offset, self.nbytes)

    def typed(self) -> torch.Tensor:
        """The stored values as a tensor in its original shape (and memory format)."""
        flat = self.raw().view(self.dtype)
        if self.channels_last:
            n, c, h, w = self.shape
            return flat.view(n, h, w, c).permute(0, 3, 1, 2)
        return flat.view(self.shape)

    def release(self) -> None:
        if self.pool is not None:
            self.pool.give_back(self.offset, persistent=self.persistent)
            self.pool.blocks.discard(self)
            self.pool = None
        self.spilled = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


@dataclass
class _Saved:
    """What autograd keeps for one offloaded saved tensor."""

    block: Block
    layer: int
    device: torch.device
    requires_grad: bool
    reloaded: torch.Tensor | None = None
    ready: Any = None  # a CUDA event: the reload copy is done
    ahead: bool = False  # reloaded ahead of its use (counted in the prefetch window)


@dataclass
class TierStats:
    offloaded_bytes: int = 0  # saved-tensor bytes moved off the device, this step
    kept_bytes: int = 0  # saved-tensor bytes that stayed (small, parameters, no room, keep_mb)
    offloadable_bytes: int = 0  # saved-tensor bytes that could have gone, this step
    kept_from_layer: int | None = None  # keep_mb: the layer from which this step's saved tensors stayed
    prefetched: int = 0
    reloaded_on_demand: int = 0
    ahead_peak_bytes: int = 0  # the most bytes backward had reloaded ahead of their use, this step
    state_early_bytes: int = 0  # optimizer state brought back during backward, this step
    by_tier: dict[str, int] = field(default_factory=dict)


def peer_round_trips(local: torch.device, peer: torch.device, nbytes: int = MiB) -> bool:
    """Copy a sentinel pattern to ``peer`` and back: True if it returns unchanged."""
    pattern = (torch.arange(nbytes, device=local, dtype=torch.int64) * 2654435761 % 251).to(torch.uint8)
    there = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    there.copy_(pattern)
    back = torch.empty_like(pattern)
    back.copy_(there)
    if local.type == "cuda":
        torch.cuda.synchronize(local)
        torch.cuda.synchronize(peer)
    return bool(torch.equal(back, pattern))


class MemoryTiers:
    """Pools of leased memory and the hooks that use them (see the module doc)."""

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        min_bytes: int = MiB,
        copies_in_flight: int = 2,
        keep_mb: float = 0.0,
        state_in_backward: bool = True,
        prefetch_layers: float = 4.0,
    ) -> None:
        if copies_in_flight < 1:
            raise ValueError(f"copies_in_flight must be at least 1, got {copies_in_flight}")
        if keep_mb < 0:
            raise ValueError(f"keep_mb must not be negative, got {keep_mb}")
        if not prefetch_layers >= 1:
            raise ValueError(f"prefetch_layers must be at least 1, got {prefetch_layers}")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_bytes = min_bytes
        self.copies_in_flight = copies_in_flight
        self.keep_bytes = int(keep_mb * MiB)
        # Backward's reloads run this far ahead. One layer ahead was not enough: a thin layer (an
        # activation, a norm) computes in a fraction of its reload's time, so the next layer's
        # reload, started only when the thin one began, stalled the compute (an MLP of Linear,
        # GELU, LayerNorm blocks on an H100: backward 774 ms against 526 ms of compute).
        self.prefetch_layers = prefetch_layers
        # Optimizer state back during backward (its size on the device from then on), else at step()
        self.state_in_backward = state_in_backward
        self._offload_limit: int | None = None  # this step's most offloaded bytes (None: no limit)
        self.pools: list[Pool] = []
        self.stats = TierStats()
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._layer = 0
        self._by_layer: dict[int, list[weakref.ref[_Saved]]] = {}
        self._prefetch_window = 0  # bytes backward keeps reloaded ahead (0: not worked out yet this step)
        self._ahead = 0  # bytes reloaded ahead and not yet taken by autograd
        self._prefetched_down_to: int | None = None  # the lowest layer brought back so far this backward
        self._optimizer_state: list[tuple[dict, str, Block]] = []
        self._lease_file: Path | None = None
        self._lease_mtime = 0.0
        self._lease: str | None = None
        self._gpu: int | None = None
        self._released: set[tuple[str, int | None]] = set()
        # the node GPU behind each CUDA ordinal of this process (the agent's GPU_ORDER)
        self._order = [int(g) for g in os.environ.get(jobenv.GPU_ORDER, "").split(",") if g.strip()]
        self._pending_src: list[tuple[torch.Tensor, Any]] = []  # (source, its copy's event), oldest first
        # Optimizer state brought back during backward, beside the reloads (``_bring_state_back``)
        self._state_due: list[tuple[dict, str, Block]] = []
        self._state_back: dict[tuple[int, str], tuple[torch.Tensor, Any]] = {}  # -> (tensor, its copy's event)
        self._state_credit = 0.0  # state bytes that may come back now
        self._state_per_byte = 0.0  # state bytes to bring back per offloaded byte reloaded

    # -- pools ---------------------------------------------------------------------------------

    def add_host(self, mb: float, *, name: str = "host") -> Pool:
        """A pinned host pool of ``mb`` MiB (pageable on a machine without CUDA)."""
        pool = Pool(name, "host", torch.device("cpu"), int(mb * MiB), pin=torch.cuda.is_available())
        return self._add(pool)

    def add_peer(self, device: torch.device | str | int, mb: float, *, tier: str = "nvlink", name: str = "") -> Pool:
        """A pool of ``mb`` MiB on neighbor GPU ``device``, after checking that a copy there round-trips."""
        peer = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.cuda and peer.type == "cuda" and not peer_round_trips(self.device, peer):
            raise PeerCheckFailed(f"a copy from {self.device} to {peer} and back came back corrupted")
        return self._add(Pool(name or f"{tier}:{peer}", tier, peer, int(mb * MiB)))

    def _add(self, pool: Pool) -> Pool:
        self.pools.append(pool)
        self.pools.sort(key=lambda p: TIER_ORDER[p.tier])
        return pool

    def _store(self, t: torch.Tensor, *, persistent: bool) -> Block | None:
        nbytes = t.numel() * t.element_size()
        for pool in self.pools:
            offset = pool.take(nbytes, persistent=persistent)
            if offset is not None:
                block = Block(pool, offset, t, persistent)
                self._copy_into(block, t)
                self.stats.by_tier[pool.tier] = self.stats.by_tier.get(pool.tier, 0) + nbytes
                return block
        return None

    def _copy_into(self, block: Block, t: torch.Tensor) -> None:
        dst = block.typed()
        if self.side is None:
            dst.copy_(t)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            dst.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        # The source must live until its copy has read it. A device makes activations faster than a
        # host link takes them (an H200 fills 8 MiB in tens of microseconds; PCIe moves it in 160),
        # so sources left to the copies' pace pile up and the peak does not fall at all. Past
        # ``copies_in_flight`` copies, the compute stream waits for the oldest one: from then on the
        # device is freed at the link's pace, and the newest copies still overlap the compute.
        self._pending_src.append((t, done))
        self._pending_src = [(s, e) for s, e in self._pending_src if not e.query()]
        current = torch.cuda.current_stream(self.device)
        while len(self._pending_src) > self.copies_in_flight:
            _, oldest = self._pending_src.pop(0)
            current.wait_event(oldest)  # what the stream does next, the freed source's reuse too, comes after

    # -- saved activations -----------------------------------------------------------------------

    @contextlib.contextmanager
    def saved_tensors(self, model: torch.nn.Module | None = None) -> Iterator[None]:
        """Offload the tensors autograd saves inside this block; ``model``'s leaf modules number
        the layers so backward brings back one layer ahead."""
        handles = []
        if model is not None:
            for module in model.modules():
                if next(module.children(), None) is None:
                    handles.append(module.register_forward_pre_hook(self._next_layer))
        self._layer = 0
        self._by_layer.clear()
        self._prefetch_window = self._ahead = 0
        self._prefetched_down_to = None
        if self.keep_bytes:
            # the tail of the last step's saved bytes stays: the same tail, if this step is alike
            # (a step that saved nothing gives nothing to go by: everything may go)
            last = self.stats.offloadable_bytes
            self._offload_limit = max(0, last - self.keep_bytes) if last else None
        self.stats.offloaded_bytes = self.stats.kept_bytes = self.stats.offloadable_bytes = 0
        self.stats.kept_from_layer = None
        self.stats.state_early_bytes = self.stats.ahead_peak_bytes = 0
        self._drop_state_back()
        self._state_due = list(self._optimizer_state) if self.state_in_backward else []
        self._state_credit = self._state_per_byte = 0.0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            for h in handles:
                h.remove()

    def _next_layer(self, module: torch.nn.Module, args: Any) -> None:
        self._layer += 1

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        dense = t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
        if nbytes < self.min_bytes or (t.is_leaf and t.requires_grad) or t.device != self.device or not dense:
            self.stats.kept_bytes += nbytes
            return t
        self.stats.offloadable_bytes += nbytes
        if self._offload_limit is not None and self.stats.offloaded_bytes + nbytes > self._offload_limit:
            if self.stats.kept_from_layer is None:
                self.stats.kept_from_layer = self._layer
            self._offload_limit = 0  # the rest of the step stays, so what stays is the step's tail
            self.stats.kept_bytes += nbytes
            return t
        block = self._store(t, persistent=False)
        if block is None:
            self.stats.kept_bytes += nbytes
            return t
        self.stats.offloaded_bytes += nbytes
        saved = _Saved(block=block, layer=self._layer, device=t.device, requires_grad=t.requires_grad)
        self._by_layer.setdefault(self._layer, []).append(weakref.ref(saved))
        return saved

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        if packed.reloaded is None:
            self._reload(packed)
            self.stats.reloaded_on_demand += 1
        elif packed.ahead:
            self._ahead -= packed.block.nbytes
            packed.ahead = False
        self._prefetch_below(packed.layer)
        if self._state_due:
            self._bring_state_back(packed.block.nbytes)
        out, ready = packed.reloaded, packed.ready
        packed.reloaded = packed.ready = None  # autograd holds it now; a second unpack reloads
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        assert out is not None
        return out

    def _reload(self, saved: _Saved) -> None:
        src = saved.block.typed()
        memory_format = torch.channels_last if saved.block.channels_last else torch.contiguous_format
        out = torch.empty(saved.block.shape, dtype=saved.block.dtype, device=saved.device, memory_format=memory_format)
        if self.side is None:
            out.copy_(src)
        else:
            current = torch.cuda.current_stream(self.device)
            self.side.wait_stream(current)
            with torch.cuda.stream(self.side):
                out.copy_(src, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(self.side)
            # ``out`` belongs to the compute stream, which waits for ``ready`` before it reads it
            # (``_unpack``), so its memory is never reused while the copy may still write it. Not
            # ``record_stream``: the allocator would keep every freed reload counted as allocated
            # until it next looked at the side stream's events, and the CPU, far ahead of the GPU,
            # would pile up a whole backward's reloads. A reload autograd never takes (the graph
            # dropped) makes the compute stream wait for its copy as it goes.
            waits = weakref.finalize(saved, current.wait_event, saved.ready)
            waits.atexit = False  # nothing runs on the stream after the interpreter ends
        saved.reloaded = out

    def _prefetch_below(self, layer: int) -> None:
        """Bring back the layer below ``layer`` if it is not on its way yet, then the layers below
        that, highest first, while less than the window's bytes are reloaded ahead of their use."""
        if not self._prefetch_window:  # worked out at backward's first unpack, when forward is done
            offloaded = self.stats.offloaded_bytes
            per_layer = offloaded / max(1, len(self._by_layer))
            self._prefetch_window = max(1, int(min(self.prefetch_layers * per_layer, offloaded / 8)))
        if self._prefetched_down_to is None or self._prefetched_down_to >= layer:
            self._prefetch_layer(layer - 1)
        while self._ahead < self._prefetch_window and (self._prefetched_down_to or 0) > 1:
            self._prefetch_layer(self._prefetched_down_to - 1)

    def _prefetch_layer(self, layer: int) -> None:
        if layer <= 0:
            return
        for ref in self._by_layer.pop(layer, ()):
            saved = ref()
            if saved is not None and saved.reloaded is None:
                self._reload(saved)
                saved.ahead = True
                self._ahead += saved.block.nbytes
                self.stats.prefetched += 1
        self.stats.ahead_peak_bytes = max(self.stats.ahead_peak_bytes, self._ahead)
        self._prefetched_down_to = layer

    def _bring_state_back(self, reloaded: int) -> None:
        """Backward is reloading what forward offloaded (the step's kept tail, if any, is gone by
        then): bring the optimizer's state back beside the reloads, in proportion to them and a
        little ahead, so that it is on the device when ``step()`` begins. Backward's compute outlasts
        its reloads, so the link has room; brought back at ``step()`` instead, the state's copies
        would run alone, with the GPU idle."""
        if not self._state_per_byte:
            total = sum(block.nbytes for _, _, block in self._state_due)
            self._state_per_byte = 1.25 * total / max(1, self.stats.offloaded_bytes)  # done by 80% of the reloads
        self._state_credit += reloaded * self._state_per_byte
        while self._state_due and self._state_credit > 0:
            state, key, block = self._state_due.pop(0)
            self._state_credit -= block.nbytes
            out = torch.empty(block.shape, dtype=block.dtype, device=self.device)
            ready = None
            if self.side is None:
                out.copy_(block.typed())
            else:
                # As a reload: ``out`` is the compute stream's, which waits for ``ready`` before
                # ``step()`` reads it (``_optimizer_in``), or before it is dropped unused.
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    out.copy_(block.typed(), non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(self.side)
            self._state_back[(id(state), key)] = (out, ready)
            self.stats.state_early_bytes += block.nbytes

    def _drop_state_back(self) -> None:
        """Forget state brought back for a ``step()`` that did not come: its memory may be reused
        only after its copy."""
        if self.side is not None:
            current = torch.cuda.current_stream(self.device)
            for _, ready in self._state_back.values():
                current.wait_event(ready)
        self._state_back.clear()

    # -- optimizer state ---------------------------------------------------------------------------

    def offload_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s state tensors in the tiers between steps: brought to the device
        for ``step()``, written back after (persistent blocks)."""
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._optimizer_in(opt))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._optimizer_out(opt))

    def _optimizer_in(self, optimizer: torch.optim.Optimizer) -> None:
        current = torch.cuda.current_stream(self.device) if self.side is not None else None
        for state, key, block in self._optimizer_state:
            early = self._state_back.pop((id(state), key), None)
            if early is None:
                state[key] = block.typed().to(self.device, non_blocking=True)  # ordered before step() on this stream
                continue
            tensor, ready = early
            if current is not None:
                current.wait_event(ready)
            state[key] = tensor
        self._state_due.clear()  # (what had not come back early came back now)

    def _optimizer_out(self, optimizer: torch.optim.Optimizer) -> None:
        known = {(id(s), k): b for s, k, b in self._optimizer_state}
        kept: list[tuple[dict, str, Block]] = []
        for state in optimizer.state.values():
            for key, value in list(state.items()):
                if not torch.is_tensor(value) or value.device != self.device:
                    continue
                block = known.get((id(state), key))
                if block is None:
                    if value.numel() * value.element_size() < self.min_bytes:
                        continue
                    block = self._store(value, persistent=True)
                    if block is None:
                        continue
                else:
                    self._copy_into(block, value)
                kept.append((state, key, block))
        if self.side is not None:
            self.side.synchronize()  # the device copies may go once the tier holds them
            self._pending_src.clear()
        for state, key, block in kept:
            state[key] = block.typed()
        self._optimizer_state = kept

    # -- leases --------------------------------------------------------------------------------------

    @classmethod
    def from_job(
        cls,
        device: torch.device | str | None = None,
        *,
        min_bytes: int = MiB,
        copies_in_flight: int = 2,
        keep_mb: float = 0.0,
        state_in_backward: bool = True,
    ) -> MemoryTiers:
        """Tiers for this process's leases (the agent's lease file in the task folder): the pools
        open at the first ``poll()``. With no agent or no lease, no pools (nothing is offloaded)
        until a grant arrives."""
        tiers = cls(
            device,
            min_bytes=min_bytes,
            copies_in_flight=copies_in_flight,
            keep_mb=keep_mb,
            state_in_backward=state_in_backward,
        )
        task_dir = os.environ.get(jobenv.TASK_DIR)
        gpu = os.environ.get(jobenv.GPU_INDEX)
        if task_dir and gpu is not None:
            tiers._lease_file = Path(task_dir) / jobenv.MEMORY_LEASES_FILE
            tiers._gpu = int(gpu)
        return tiers

    def follow_leases(self, path: Path | str, gpu: int) -> None:
        """Read leases from ``path`` (the agent's lease file) for the borrower GPU ``gpu``."""
        self._lease_file, self._gpu = Path(path), gpu
        self.poll()

    def poll(self) -> list[str]:
        """At a step boundary: open pools for new shares, answer revocations (move the blocks to
        host, free the neighbor's buffer, report ``lease-released``). Returns what it did."""
        if self._lease_file is None:
            return []
        try:
            mtime = self._lease_file.stat().st_mtime
        except FileNotFoundError:
            return []
        if mtime == self._lease_mtime:
            return []
        self._lease_mtime = mtime
        try:
            leases = json.loads(self._lease_file.read_text()).get("leases", {})
        except (OSError, ValueError):
            self._lease_mtime = 0.0  # caught mid-write: read again next time
            return []
        done: list[str] = []
        for lease_id, lease in leases.items():
            if lease.get("gpu") != self._gpu:
                continue
            self._lease = lease_id
            done += self._apply_lease(lease_id, lease)
        return done

    def _apply_lease(self, lease_id: str, lease: dict) -> list[str]:
        done = []
        ending = lease.get("ending_by") is not None
        have = {p.name for p in self.pools}
        released: list[int | None] = []
        seen: dict[tuple[str, int | None], int] = {}
        for share in lease.get("shares", []):
            gpu, tier, mb = share.get("gpu"), share["tier"], share["mb"]
            k = seen[(tier, gpu)] = seen.get((tier, gpu), -1) + 1  # the k-th share of this lender
            name = f"lease:{tier}:{gpu}:{k}"
            if ending or share.get("revoke_by") is not None:
                if (lease_id, gpu) not in self._released:
                    for pool in [p for p in self.pools if p.name.startswith(f"lease:{tier}:{gpu}:")]:
                        self._evacuate(pool.name)
                        done.append(f"released {pool.name}")
                    self._released.add((lease_id, gpu))
                    released.append(gpu)
                continue
            self._released.discard((lease_id, gpu))
            if name in have:
                continue
            try:
                if tier == "host" or gpu not in self._order or not self.cuda:
                    self._add(Pool(name, tier, torch.device("cpu"), int(mb * MiB), pin=torch.cuda.is_available()))
                else:
                    self.add_peer(self._order.index(gpu), mb, tier=tier, name=name)
                done.append(f"opened {name} ({mb} MiB)")
            except (PeerCheckFailed, RuntimeError) as exc:
                done.append(f"refused {name}: {exc}")
        if released:
            gpus = [] if ending else [g for g in released if g is not None]
            send(control.LeaseReleased, lease=lease_id, gpus=tuple(gpus), reason="revoked")
        send(control.LeaseHeld, lease=lease_id, held_mb=self.held_on_lenders_mb())
        return done

    def held_on_lenders_mb(self) -> dict[int, int]:
        """MiB this runtime holds of its lease on each lender GPU: the device buffers of the shares it
        opened there (the agent reports them as the borrowers' part of the lender's use)."""
        held: dict[int, int] = {}
        for pool in self.pools:
            kind, _, gpu, *_ = [*pool.name.split(":"), "", ""]  # lease:<tier>:<lender GPU>:<k>
            if kind == "lease" and gpu.isdigit() and pool.device.type == "cuda":
                held[int(gpu)] = held.get(int(gpu), 0) + -(-pool.nbytes // MiB)
        return held

    def _evacuate(self, name: str) -> None:
        """Move every block out of pool ``name`` (to a host pool with room, else plain RAM) and free it."""
        pool = next((p for p in self.pools if p.name == name), None)
        if pool is None:
            return
        pool.revoked = True
        self.pools.remove(pool)
        if self.side is not None:
            self.side.synchronize()
        for block in list(pool.blocks):
            data = block.raw()
            target = next((p for p in self.pools if p.tier == "host" and not p.revoked), None)
            offset = target.take(block.nbytes, persistent=block.persistent) if target is not None else None
            if target is not None and offset is not None:
                target.view(offset, block.nbytes).copy_(data)
                pool.blocks.discard(block)
                block.pool, block.offset = target, offset
                target.blocks.add(block)
            else:
                block.spilled = data.to("cpu", copy=True)
                pool.blocks.discard(block)
                block.pool = None
        for state, key, block in self._optimizer_state:
            state[key] = block.typed()  # the moved blocks' new homes
        pool.buffer = torch.empty(0, dtype=torch.uint8, device=pool.device)
        if pool.device.type == "cuda":
            with torch.cuda.device(pool.device):
                torch.cuda.empty_cache()  # give the lender its memory back, not to our cache
