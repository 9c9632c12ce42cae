"""Per-layer profile of a training step: time, FLOPs, bytes, arithmetic intensity, memory, and
where each layer sits on the device's roofline.

    from gpuherd.train import profile_layers
    profile = profile_layers(model, batch)          # forward + loss + backward, as training runs it
    print(profile.table()); profile.save("p.json"); profile.plot_roofline("roofline.png")

How each number is obtained, and what it does not see:

- **Time**: hooks on every module mark the start and end of its forward and of its backward
  (``register_full_backward_pre_hook`` / ``register_full_backward_hook``); on a GPU the marks are
  CUDA events, on the CPU ``time.perf_counter`` (CPU kernels return when done, so no extra
  synchronization is needed). After ``warmup`` steps, ``repeats`` steps are timed and each number
  is the median. A leaf module's row is its own time; a module with children also gets an
  "own ops" row: its time minus its children's (the functional calls in its ``forward``, e.g.
  ``F.relu`` or a residual add). "(loss, autograd, glue)" is what the step spends outside the
  model, plus the Python of containers between their children. The rows add up to the
  hooked step; ``step_s`` is the same step without hooks, so the difference is the
  profiler's own overhead.
- **FLOPs**: every aten op is counted with ``torch.utils.flop_counter``'s formulas, attributed
  to the innermost module running it (forward or backward; grouped convolution backward with a
  corrected formula). Those formulas know matmuls,
  convolutions and attention only; every other op that ran (normalization, activations,
  elementwise, pooling, reductions) is listed in ``uncounted_ops`` and contributes 0 FLOPs:
  such layers are memory-bound by any measure.
- **Bytes**: for every op that is not a view, the bytes of its tensor inputs (weights included)
  plus its outputs. It is a lower bound of the memory traffic of eager execution: it assumes
  each tensor crosses the memory bus once per op and ignores what caches keep or kernels re-read.
- **Memory**: ``param_bytes`` are the layer's own parameters; ``activation_bytes`` are the
  tensors autograd saves for backward during its forward (parameters excluded), counted with
  ``saved_tensors_hooks``.

The first module's backward needs a gradient with respect to the batch to be bracketed by its
hooks, so floating-point inputs are profiled with ``requires_grad``: that layer's backward
includes the input gradient training would skip. Modules are switched to ``inplace=False``
while profiled (in-place outputs cannot carry backward hooks), which changes no value.

Profiling leaves no trace: gradients, buffers (batch-norm statistics) and the RNG state are put
back as they were, so the job's next step is the one it would have taken.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from gpuherd.errors import GpuherdError
from gpuherd.train.peaks import DevicePeaks, device_peaks

Phase = Literal["forward", "backward"]
LossFn = Callable[[Any], torch.Tensor]

OUTSIDE = "(loss, autograd, glue)"
# Ops that move no data worth counting (metadata, an alias torch does not flag as a view, or a fresh
# tensor the next op writes anyway). ``_unsafe_view`` is how matmul and linear fold the leading
# dimensions of a >2-D input back: a view in all but name.
_FREE_OPS = {
    "aten::detach",
    "aten::_unsafe_view",
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::lift_fresh",
}


def _conv_backward_flops(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    """``convolution_backward``: the input gradient and the weight gradient each cost what the
    forward did. (torch's own formula multiplies the weight gradient by the group count.)"""
    transposed, mask = args[4], args[7]
    per_output = weight[0].numel()  # (c_in / groups) * kernel for a conv; (c_out / groups) * kernel transposed
    forward = 2 * (x.numel() if transposed else grad_out.numel()) * per_output
    return forward * (int(mask[0]) + int(mask[1]))


_aten = torch.ops.aten
_FLOP_FORMULAS = {
    **flop_registry,
    _aten.convolution_backward: _conv_backward_flops,
    # torch has formulas for the GPU kernels of scaled_dot_product_attention only; the CPU kernel
    # takes the same arguments and does the same matmuls.
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        _aten._scaled_dot_product_flash_attention_backward
    ],
}


class ProfileError(GpuherdError, ValueError):
    """The model or batch cannot be profiled as given."""


@dataclass
class LayerProfile:
    name: str  # module path ("layers.0.conv1"), "<path> (own ops)", or OUTSIDE
    kind: str  # module class, "own ops", or "outside"
    block: str  # the group it is aggregated into
    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_flops: int = 0
    backward_flops: int = 0
    forward_bytes: int = 0
    backward_bytes: int = 0
    params: int = 0
    param_bytes: int = 0
    grad_bytes: int = 0  # gradients of its parameters: what data parallelism all-reduces
    activation_bytes: int = 0  # saved for backward by its forward
    uncounted_ops: tuple[str, ...] = ()

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.time_s if self.time_s > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.time_s if self.time_s > 0 else 0.0

    def bound(self, peaks: DevicePeaks) -> Literal["compute", "memory"]:
        """Which roof limits it: compute at or above the ridge point, memory below it."""
        return "compute" if self.intensity >= peaks.ridge else "memory"

    def roof_fraction(self, peaks: DevicePeaks) -> float:
        """Achieved performance over what the roofline allows at its intensity (for a layer with
        no counted FLOPs: achieved bandwidth over the copy bandwidth)."""
        if self.flops == 0:
            return self.bytes_per_s / peaks.copy_bytes_per_s
        return self.flops_per_s / peaks.attainable(self.intensity)


@dataclass
class StepProfile:
    device: str
    dtype: str
    batch_size: int
    warmup: int
    repeats: int
    step_s: float  # median forward + loss + backward without hooks
    profiled_step_s: float  # the same with the profiler's hooks
    layers: list[LayerProfile]
    peaks: DevicePeaks | None = None
    model: str = ""
    buffer_bytes: int = 0  # the model's buffers (batch-norm statistics): DDP broadcasts them every step

    @property
    def layer_sum_s(self) -> float:
        return sum(layer.time_s for layer in self.layers)

    def blocks(self) -> list[LayerProfile]:
        """The rows summed per block (in the order blocks first appear)."""
        grouped: dict[str, LayerProfile] = {}
        ops: dict[str, set[str]] = defaultdict(set)
        for layer in self.layers:
            total = grouped.setdefault(layer.block, LayerProfile(name=layer.block, kind="block", block=layer.block))
            for attr in (
                "forward_s",
                "backward_s",
                "forward_flops",
                "backward_flops",
                "forward_bytes",
                "backward_bytes",
                "params",
                "param_bytes",
                "grad_bytes",
                "activation_bytes",
            ):
                setattr(total, attr, getattr(total, attr) + getattr(layer, attr))
            ops[layer.block].update(layer.uncounted_ops)
        return [replace(total, uncounted_ops=tuple(sorted(ops[name]))) for name, total in grouped.items()]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        layers = [LayerProfile(**{**row, "uncounted_ops": tuple(row["uncounted_ops"])}) for row in data["layers"]]
        peaks = DevicePeaks(**data["peaks"]) if data.get("peaks") else None
        return cls(**{**data, "layers": layers, "peaks": peaks})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # missing, not JSON, or not a profile's fields
            raise ProfileError(f"{path}: not a saved profile ({type(exc).__name__}: {exc})") from None


# -- profiling -------------------------------------------------------------------------------------


def profile_layers(
    model: nn.Module,
    batch: torch.Tensor | Sequence[torch.Tensor],
    *,
    loss_fn: LossFn | None = None,
    warmup: int = 3,
    repeats: int = 10,
    block_depth: int = 2,
    peaks: DevicePeaks | Literal["measure"] | None = "measure",
    peaks_cache: Path | None = None,
) -> StepProfile:
    """Profile one training step of ``model`` on ``batch`` (a tensor, or a tuple of positional
    inputs). ``loss_fn(output)`` gives the scalar to differentiate (default: the mean square of
    the output, whose backward costs what any loss's does). ``block_depth``: rows are summed per
    module path of this many parts ("layers.0"). ``peaks``: the device's roofs ("measure": cached
    measurement, see ``gpuherd.train.peaks``; None: no roofline verdicts)."""
    if warmup < 0 or repeats < 1:
        raise ProfileError("warmup must be >= 0 and repeats >= 1")
    inputs = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    if not inputs:
        raise ProfileError("the batch has no tensors")
    if not any(p.requires_grad for p in model.parameters()) and not any(t.is_floating_point() for t in inputs):
        raise ProfileError("nothing in the step needs a gradient: no trainable parameter, no float input")
    device = _device_of(model, inputs)
    dtype = _dtype_of(model, inputs)
    loss_fn = loss_fn or _mean_square
    modules = list(model.named_modules())
    with _no_trace(model, device), _profiling_mode(model):
        step = _Step(model, inputs, loss_fn, device)
        for _ in range(warmup):
            step.run()
        plain = [step.run(timed=True) for _ in range(repeats)]
        timer = _Timer(modules, device)
        with timer.hooks():
            for _ in range(max(1, warmup // 2)):
                step.run()
                timer.reset()
            hooked = []
            for _ in range(repeats):
                hooked.append(step.run(timed=True))
                timer.collect(hooked[-1])
        counter = _Counter(modules)
        with counter.hooks():
            step.run()
    rows = _rows(modules, timer, counter, block_depth)
    roofs = device_peaks(device, dtype, cache=peaks_cache) if peaks == "measure" else peaks
    return StepProfile(
        device=str(device),
        dtype=str(dtype),
        batch_size=int(inputs[0].shape[0]) if inputs[0].dim() else 1,
        warmup=warmup,
        repeats=repeats,
        step_s=statistics.median(plain),
        profiled_step_s=statistics.median(hooked),
        layers=rows,
        peaks=roofs,
        model=type(model).__name__,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
    )


def _mean_square(output: Any) -> torch.Tensor:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ProfileError("the model's output has no floating-point tensor to differentiate; pass loss_fn")
    return sum(t.float().square().mean() for t in tensors)  # type: ignore[return-value]


def _device_of(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.device:
    for p in model.parameters():
        return p.device
    return inputs[0].device


def _dtype_of(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return next((t.dtype for t in inputs if t.is_floating_point()), torch.float32)


class _Step:
    """Forward, loss and backward on the batch; float inputs require grad (see the module doc)."""

    def __init__(self, model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn: LossFn, device: torch.device):
        self.model = model
        self.inputs = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in inputs)
        self.loss_fn = loss_fn
        self.cuda = device.type == "cuda"
        self.device = device

    def run(self, *, timed: bool = False) -> float:
        for t in self.inputs:
            t.grad = None
        self.model.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        loss = self.loss_fn(self.model(*self.inputs))
        loss.backward()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started if timed else 0.0


@contextlib.contextmanager
def _no_trace(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Put gradients, buffers and RNG state back as they were."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for p, grad in grads.items():
            p.grad = grad
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


@contextlib.contextmanager
def _profiling_mode(model: nn.Module) -> Iterator[None]:
    inplace = [m for m in model.modules() if getattr(m, "inplace", False) is True]
    for m in inplace:
        m.inplace = False
    # Registering a full backward hook marks the module for good (``_is_full_backward_hook``), and
    # a marked module refuses ``register_backward_hook`` ever after: the mark is put back too.
    backward_kind = [(m, m._is_full_backward_hook) for m in model.modules()]
    try:
        with warnings.catch_warnings():
            # A module none of whose inputs needs a gradient fires its backward hook early: its
            # time is then what is left of it, and at least its children's (``_Timer.collect``).
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
    finally:
        for m in inplace:
            m.inplace = True
        for m, kind in backward_kind:
            m._is_full_backward_hook = kind


# -- timing ----------------------------------------------------------------------------------------


class _Timer:
    """Marks at each module's forward/backward start and end; per-step totals, then medians."""

    def __init__(self, modules: list[tuple[str, nn.Module]], device: torch.device) -> None:
        self.modules = modules
        index_of = {id(m): i for i, (_, m) in enumerate(modules)}
        self.children = [[index_of[id(c)] for c in m.children() if id(c) in index_of] for _, m in modules]
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[int, str, Any]] = []  # (module index, "f0"/"f1"/"b0"/"b1", time or event)
        self.samples: dict[tuple[int, Phase], list[float]] = defaultdict(list)
        self.steps: list[float] = []

    def _mark(self, index: int, what: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((index, what, event))
        else:
            self.marks.append((index, what, time.perf_counter()))

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return _edge_hooks(self.modules, self._mark)

    def reset(self) -> None:
        self.marks.clear()

    def collect(self, step_s: float) -> None:
        """Turn one step's marks into per-module totals (a module called twice adds up)."""
        totals: dict[tuple[int, Phase], float] = defaultdict(float)
        open_at: dict[tuple[int, str], list[Any]] = defaultdict(list)
        for index, what, stamp in self.marks:
            phase: Phase = "forward" if what[0] == "f" else "backward"
            if what[1] == "0":
                open_at[(index, phase)].append(stamp)
            elif open_at[(index, phase)]:
                start = open_at[(index, phase)].pop()
                totals[(index, phase)] += (
                    start.elapsed_time(stamp) / 1000.0 if self.cuda else stamp - start  # type: ignore[union-attr]
                )
        # A module's backward hooks bracket nothing when none of its inputs needs a gradient (token
        # ids) or its output is not a tensor (a dict): it then looks shorter than its children. It
        # took at least their time, else the step outside the model would count their backward again.
        for index in reversed(range(len(self.modules))):  # (named_modules lists parents first)
            inner = sum(totals.get((child, "backward"), 0.0) for child in self.children[index])
            if inner > totals.get((index, "backward"), 0.0):
                totals[(index, "backward")] = inner
        for index in range(len(self.modules)):
            for phase in ("forward", "backward"):
                self.samples[(index, phase)].append(totals.get((index, phase), 0.0))
        # The step outside the model, from the same step's marks (medians of parts need not add up).
        self.samples[(-1, "backward")].append(max(0.0, step_s - totals[(0, "forward")] - totals[(0, "backward")]))
        self.steps.append(step_s)
        self.marks.clear()

    def median(self, index: int, phase: Phase) -> float:
        values = self.samples.get((index, phase))
        return statistics.median(values) if values else 0.0


# -- counting --------------------------------------------------------------------------------------


@dataclass
class _Counts:
    flops: dict[Phase, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    bytes: dict[Phase, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    uncounted: set[str] = field(default_factory=set)
    saved: dict[tuple, int] = field(default_factory=dict)  # (ptr, offset, shape) -> bytes


class _Counter(TorchDispatchMode):
    """FLOPs and bytes of every aten op, and tensors saved for backward, by innermost module."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.modules = modules
        self.stack: list[tuple[int, Phase]] = []
        self.counts: dict[int, _Counts] = defaultdict(_Counts)  # module index (-1: outside) -> counts
        self.param_ptrs: set[int] = set()

    def _top(self) -> tuple[int, Phase]:
        # Outside every module: backward while the autograd engine runs a graph task (grad mode
        # says nothing here: it is on in the forward and off in the backward).
        in_backward = torch._C._current_graph_task_id() >= 0
        return self.stack[-1] if self.stack else (-1, "backward" if in_backward else "forward")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        index, phase = self._top()
        packet = func.overloadpacket
        counts = self.counts[index]
        formula = _FLOP_FORMULAS.get(packet)
        if formula is not None:
            counts.flops[phase] += int(formula(*args, **kwargs, out_val=out))
        name = func.name().split(".")[0]  # "aten::addmm"
        if func.is_view or name in _FREE_OPS:
            return out
        if formula is None:
            counts.uncounted.add(name.removeprefix("aten::"))
        moved = 0
        for value in (*tree_flatten((args, kwargs))[0], *tree_flatten(out)[0]):
            if isinstance(value, torch.Tensor):
                moved += value.numel() * value.element_size()
        counts.bytes[phase] += moved
        return out

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        index, phase = self._top()
        if phase == "forward" and tensor.untyped_storage().data_ptr() not in self.param_ptrs:
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            self.counts[index].saved[key] = tensor.numel() * tensor.element_size()
        return tensor

    def _enter(self, index: int, phase: Phase) -> None:
        self.stack.append((index, phase))

    def _leave(self, index: int, phase: Phase) -> None:
        for depth in range(len(self.stack) - 1, -1, -1):
            if self.stack[depth] == (index, phase):
                del self.stack[depth]
                return

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        self.param_ptrs = {p.untyped_storage().data_ptr() for _, m in self.modules for p in m.parameters()}
        with (
            _edge_hooks(self.modules, self._edge),
            self,
            torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t),
        ):
            yield

    def _edge(self, index: int, edge: str) -> None:
        phase: Phase = "forward" if edge[0] == "f" else "backward"
        if edge[1] == "0":
            self._enter(index, phase)
        else:
            self._leave(index, phase)


@contextlib.contextmanager
def _edge_hooks(modules: list[tuple[str, nn.Module]], on_edge: Callable[[int, str], None]) -> Iterator[None]:
    """Call ``on_edge(module index, edge)`` at each module's edges ("f0"/"f1": its forward begins/
    ends, "b0"/"b1": its backward) while inside; every hook is removed on leaving, also when a
    registration fails part way (none may stay on the model)."""
    handles: list[Any] = []
    try:
        for index, (_, module) in enumerate(modules):
            handles += [
                module.register_forward_pre_hook(lambda *_, i=index: on_edge(i, "f0")),
                module.register_forward_hook(lambda *_, i=index: on_edge(i, "f1")),
                module.register_full_backward_pre_hook(lambda *_, i=index: on_edge(i, "b0")),
                module.register_full_backward_hook(lambda *_, i=index: on_edge(i, "b1")),
            ]
        yield
    finally:
        for handle in handles:
            handle.remove()


# -- rows ------------------------------------------------------------------------------------------


def _block_of(name: str, depth: int, leaf: bool) -> str:
    parts = name.split(".") if name else []
    if len(parts) > depth:
        return ".".join(parts[:depth])
    if leaf and len(parts) > 1:
        return ".".join(parts[:-1])
    return name or "(model)"


def _rows(modules: list[tuple[str, nn.Module]], timer: _Timer, counter: _Counter, depth: int) -> list[LayerProfile]:
    index_of = {id(m): i for i, (_, m) in enumerate(modules)}
    rows: list[LayerProfile] = []
    glue_s = 0.0
    counted: set[int] = set()  # a parameter layers share (tied embeddings) is counted with the first
    for index, (name, module) in enumerate(modules):
        children = [index_of[id(c)] for c in module.children() if id(c) in index_of]
        leaf = not children
        times = {}
        for phase in ("forward", "backward"):
            total = timer.median(index, phase)
            own = total - sum(timer.median(c, phase) for c in children)
            times[phase] = max(0.0, own)
        counts = counter.counts.get(index, _Counts())
        params = [p for p in module.parameters(recurse=False) if id(p) not in counted]
        counted.update(id(p) for p in params)
        row = LayerProfile(
            name=name if leaf else f"{name or '(model)'} (own ops)",
            kind=type(module).__name__ if leaf else "own ops",
            block=_block_of(name, depth, leaf),
            forward_s=times["forward"],
            backward_s=times["backward"],
            forward_flops=counts.flops["forward"],
            backward_flops=counts.flops["backward"],
            forward_bytes=counts.bytes["forward"],
            backward_bytes=counts.bytes["backward"],
            params=sum(p.numel() for p in params),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
            activation_bytes=sum(counts.saved.values()),
            uncounted_ops=tuple(sorted(counts.uncounted)),
        )
        if leaf or row.bytes:
            rows.append(row)
        else:
            glue_s += row.time_s  # a container's own time: Python between its children
    outside = counter.counts.get(-1, _Counts())
    rows.append(
        LayerProfile(
            name=OUTSIDE,
            kind="outside",
            block=OUTSIDE,
            backward_s=timer.median(-1, "backward") + glue_s,
            forward_flops=outside.flops["forward"],
            backward_flops=outside.flops["backward"],
            forward_bytes=outside.bytes["forward"],
            backward_bytes=outside.bytes["backward"],
            uncounted_ops=tuple(sorted(outside.uncounted)),
        )
    )
    return rows
