"""``gpuherd profile``: a model's layers by time, FLOPs, bytes and arithmetic intensity.

    gpuherd profile examples/train_cnn.py:SmallResNet --input 3,32,32 --batch 32
    gpuherd profile examples/transformer.py:TransformerBlock --input 128,256 --json p.json --plot roofline.png
    gpuherd profile examples/train_cnn.py:SmallResNet --input 3,32,32 --ddp 1,2,4,8
    gpuherd profile --from p.json                      # show a saved profile
    gpuherd profile --job JOB --steps 5                # a running job profiles its own steps

TARGET is ``path/to/file.py:Factory`` or ``package.module:Factory``; the factory is called with no
arguments and must return an ``nn.Module``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuherd.errors import GpuherdError

console = Console(width=None if sys.stdout.isatty() else 190)


class ProfileTargetError(GpuherdError, ValueError):
    """TARGET does not name a model factory that can be loaded."""


def load_factory(target: str) -> Any:
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ProfileTargetError(f"{target!r}: expected path/to/file.py:Factory or package.module:Factory")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.exists():
            raise ProfileTargetError(f"{where}: no such file")
        sys.path.insert(0, str(path.parent))  # scripts import their neighbours (examples/synthetic.py)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except (ImportError, TypeError) as exc:  # (TypeError: a relative name such as ".models")
            raise ProfileTargetError(f"cannot import {where} ({exc}): give path/to/file.py:Factory instead") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise ProfileTargetError(f"{where} has no {name}")
    if not callable(factory):
        raise ProfileTargetError(f"{where}:{name} is not a factory: it is a {type(factory).__name__}")
    return factory


def positive_ints(text: str, option: str) -> list[int]:
    """``--input`` and ``--ddp``: positive whole numbers separated by commas, or a clear error."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise GpuherdError(f"{option} takes positive whole numbers separated by commas (e.g. 3,32,32); got {text!r}")
    return values


def float_dtype(name: str) -> Any:
    """The torch dtype ``--dtype`` names, which must be a floating-point one."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise GpuherdError(f"--dtype {name!r} is not a floating-point torch dtype: float32, bfloat16, float16, float64")
    return dtype


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def profile_table(profile: Any, *, blocks: bool = False, top: int = 0) -> Table:
    peaks = profile.peaks
    rows = profile.blocks() if blocks else profile.layers
    if top:
        rows = sorted(rows, key=lambda r: -r.time_s)[:top]
    step = profile.layer_sum_s or 1.0
    title = (
        f"{profile.model} on {profile.device} ({profile.dtype}), batch {profile.batch_size}: step "
        f"{profile.step_s * 1e3:.2f} ms unhooked, {profile.profiled_step_s * 1e3:.2f} ms profiled; "
        f"median of {profile.repeats}"
    )
    if peaks is not None:
        title += (
            f"\nroofs: {peaks.matmul_flops / 1e9:,.0f} GFLOP/s matmul, {peaks.copy_bytes_per_s / 1e9:,.0f} GB/s copy,"
            f" ridge {peaks.ridge:.1f} FLOP/B ({peaks.device})"
        )
    table = Table(title=title, title_justify="left")
    header = ["block" if blocks else "layer", "kind", "fwd ms", "bwd ms", "% step", "GFLOP", "moved", "FLOP/B"]
    header += ["GFLOP/s", "GB/s", "bound", "% roof", "params", "saved act", "not counted"]
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if i in (0, 1, 10, 14) else "right")
    for r in rows:
        verdict = r.bound(peaks) if peaks is not None else ""
        roof = f"{100 * r.roof_fraction(peaks):.0f}%" if peaks is not None and r.time_s > 0 else ""
        table.add_row(
            r.name,
            r.kind,
            f"{r.forward_s * 1e3:.3f}",
            f"{r.backward_s * 1e3:.3f}",
            f"{100 * r.time_s / step:.1f}",
            f"{r.flops / 1e9:.3f}",
            _fmt_bytes(r.bytes),
            f"{r.intensity:.1f}",
            f"{r.flops_per_s / 1e9:.1f}",
            f"{r.bytes_per_s / 1e9:.1f}",
            verdict,
            roof,
            _fmt_bytes(r.param_bytes),
            _fmt_bytes(r.activation_bytes),
            ", ".join(r.uncounted_ops[:3]) + (" ..." if len(r.uncounted_ops) > 3 else ""),
        )
    return table


def plot_roofline(profile: Any, path: str | Path, *, label_top: int = 8) -> Path:
    """Each layer at (intensity, achieved FLOP/s) under the device's two roofs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    peaks = profile.peaks
    if peaks is None:
        raise ValueError("this profile has no device peaks (profiled with peaks=None): no roofline to draw")
    layers = [r for r in profile.layers if r.flops > 0 and r.time_s > 0]
    skipped = sum(1 for r in profile.layers if r.flops == 0 and r.time_s > 0)
    fig, ax = plt.subplots(figsize=(9, 6))
    lo = min([r.intensity for r in layers] + [peaks.ridge / 100]) / 2
    hi = max([r.intensity for r in layers] + [peaks.ridge * 100]) * 2
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.loglog(x, np.minimum(peaks.matmul_flops, x * peaks.copy_bytes_per_s), "k-", lw=2, label="roofline (measured)")
    ax.axvline(peaks.ridge, color="grey", ls=":", lw=1)
    sizes = np.array([r.time_s for r in layers])
    scale = 600 * sizes / sizes.max() if len(sizes) else sizes
    colors = ["tab:red" if r.bound(peaks) == "memory" else "tab:blue" for r in layers]
    ax.scatter([r.intensity for r in layers], [r.flops_per_s for r in layers], s=scale + 10, c=colors, alpha=0.6)
    for r in sorted(layers, key=lambda r: -r.time_s)[:label_top]:
        ax.annotate(r.name, (r.intensity, r.flops_per_s), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved, lower bound of bytes)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(
        f"{profile.model} on {peaks.device}: layers by time (area); red memory-bound, blue compute-bound"
        + (f"\n{skipped} layers without counted FLOPs (elementwise, norms) not drawn" if skipped else ""),
        fontsize=9,
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def scaling_tables(detail: list[Any], points: list[Any]) -> tuple[Table, Table]:
    per_layer = Table(
        title="per-layer backward and its gradients' all-reduce (largest worker count)", title_justify="left"
    )
    for column in ("layer (backward order)", "bwd ms", "grads", "bucket", "all-reduce ms", "hidden"):
        per_layer.add_column(column, justify="left" if column.startswith("layer") else "right")
    for d in detail:
        per_layer.add_row(
            d.name,
            f"{d.backward_s * 1e3:.3f}",
            _fmt_bytes(d.grad_bytes),
            str(d.bucket),
            f"{d.allreduce_s * 1e3:.3f}",
            "yes" if d.hidden else "no",
        )
    scaling = Table(title="predicted data-parallel scaling", title_justify="left")
    for column in ("workers", "compute ms", "all-reduce ms", "exposed ms", "step ms", "samples/s", "efficiency"):
        scaling.add_column(column, justify="right")
    for p in points:
        scaling.add_row(
            str(p.workers),
            f"{p.compute_s * 1e3:.2f}",
            f"{p.comm_s * 1e3:.2f}",
            f"{p.exposed_s * 1e3:.2f}",
            f"{p.step_s * 1e3:.2f}",
            f"{p.samples_per_s:,.0f}",
            f"{100 * p.efficiency:.0f}%",
        )
    return per_layer, scaling


def make_batch(args: argparse.Namespace, device: Any) -> Any:
    import torch

    shape = (args.batch, *positive_ints(args.input, "--input"))
    if args.input_dtype == "long":
        return torch.randint(0, args.vocab, shape, device=device)
    return torch.randn(shape, device=device, dtype=float_dtype(args.dtype))


async def request_job_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Ask a running job for a profile and wait for the first ``ProfileReported`` answering it."""
    import asyncio

    from apps.cli.common import nats_url_of, open_cli_log
    from gpuherd import events as ev
    from gpuherd.client import Client
    from gpuherd.errors import GpuherdError

    log_ = await open_cli_log(args)
    client = await Client.connect(nats_url_of(args), source="cli")
    try:
        start = await log_.last_seq() + 1
        request = await client.request_profile(args.job, args.steps)

        async def answer() -> dict[str, Any]:
            async for record in log_.read(start, follow=True):
                event = record.event
                if isinstance(event, ev.ProfileReported) and event.request == request:
                    return event.profile
            raise GpuherdError("the log ended")

        try:
            return await asyncio.wait_for(answer(), args.wait)
        except TimeoutError:
            raise GpuherdError(
                f"no profile from {args.job} within {args.wait:.0f}s: it must be running on agents that run "
                "processes, and its script must call ctx.maybe_profile(model, batch) each step"
            ) from None
    finally:
        await client.close()
        await log_.close()


def cmd_profile(args: argparse.Namespace) -> int:
    import asyncio

    import torch

    from gpuherd.train.dataparallel import measure_allreduce, measure_core_sharing, predict_scaling
    from gpuherd.train.profile import StepProfile, profile_layers

    workers = positive_ints(args.ddp, "--ddp") if args.ddp else []  # checked before the minutes of profiling
    for option, value, least in (("--batch", args.batch, 1), ("--threads", args.threads, 0), ("--top", args.top, 0)):
        if value < least:
            raise GpuherdError(f"{option} must be at least {least}, got {value}")
    if args.source:
        profile = StepProfile.load(args.source)
    elif args.job:
        with console.status(f"asking {args.job} for a profile of {args.steps} steps"):
            profile = StepProfile.from_dict(asyncio.run(request_job_profile(args)))
    else:
        if not args.target or not args.input:
            console.print("[red]give TARGET and --input (or --from a saved profile)[/red]")
            return 2
        if args.threads:
            torch.set_num_threads(args.threads)
        try:
            device = torch.device(
                args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            )
        except RuntimeError as exc:
            raise GpuherdError(f"--device {args.device!r} is not a device ({exc})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise GpuherdError(f"--device {args.device}: no CUDA GPU here (use cpu or auto)")
        dtype = float_dtype(args.dtype)
        batch = make_batch(args, device)
        model = load_factory(args.target)()
        if not isinstance(model, torch.nn.Module):
            raise ProfileTargetError(f"{args.target} returned a {type(model).__name__}, not an nn.Module")
        model = model.to(device=device, dtype=dtype)
        with console.status(f"profiling {args.target} on {device} ({args.warmup} warm-up + {args.repeats} steps)"):
            try:
                profile = profile_layers(
                    model, batch, warmup=args.warmup, repeats=args.repeats, block_depth=args.block_depth
                )
            except RuntimeError as exc:  # most often --input does not fit the model (torch says how)
                raise GpuherdError(
                    f"{args.target} cannot run a training step on a batch of shape {tuple(batch.shape)}: {exc}"
                ) from None
    console.print(profile_table(profile, blocks=args.blocks, top=args.top))
    if args.json:
        profile.save(args.json)
        console.print(f"profile written to {args.json}")
    if args.plot:
        console.print(f"roofline plot: {plot_roofline(profile, args.plot)}")
    if workers:
        cuda = profile.device.startswith("cuda")
        backend = "nccl" if cuda else "gloo"
        local = torch.cuda.device_count() if cuda else os.cpu_count() or 1
        measurable = [w for w in workers if 2 <= w <= max(2, local)] or [2]
        costs = {}
        with console.status(f"measuring {backend} all-reduce among {measurable} local workers"):
            for w in measurable:
                costs[w] = measure_allreduce(w, backend=backend, busy=not cuda)  # CPU workers share cores
        for w, cost in costs.items():
            console.print(
                f"{backend} all-reduce, {w} workers: {cost.latency_s * 1e6:.0f} us + bytes / "
                f"{cost.bytes_per_s / 1e9:.2f} GB/s (measured); larger counts by the ring model"
            )
        detail, points = predict_scaling(
            profile,
            costs,
            workers=workers,
            extra_s=args.extra_ms / 1e3,
            cores=None if cuda else (args.cores or os.cpu_count()),
            slowdown=None if cuda or args.cores else measure_core_sharing(workers),
            threads_per_worker=args.threads or 1,
        )
        for table in scaling_tables(detail, points):
            console.print(table)
    return 0


def add_commands(sub: Any) -> None:
    p = sub.add_parser("profile", help="per-layer time, FLOPs, bytes, intensity and roofline of a model")
    p.add_argument("target", nargs="?", help="path/to/file.py:Factory or package.module:Factory")
    p.add_argument("--from", dest="source", help="show a saved profile JSON instead of profiling")
    p.add_argument("--job", help="profile a running job's own steps (recorded as ProfileRequested/ProfileReported)")
    p.add_argument("--steps", type=int, default=5, help="--job: steps to profile")
    p.add_argument("--wait", type=float, default=120.0, help="--job: seconds to wait for the answer")
    p.add_argument("--input", help="one sample's shape, e.g. 3,32,32 (the batch dimension comes from --batch)")
    p.add_argument("--batch", type=int, default=32, help="samples per step")
    p.add_argument("--input-dtype", choices=["float", "long"], default="float", help="long: token ids")
    p.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this (--input-dtype long)")
    p.add_argument("--dtype", default="float32", help="model and float input dtype (float32, bfloat16, float16)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    p.add_argument("--repeats", type=int, default=10, help="steps measured")
    p.add_argument("--block-depth", type=int, default=2, help="rows are summed per module path of this many parts")
    p.add_argument("--blocks", action="store_true", help="show blocks instead of layers")
    p.add_argument("--top", type=int, default=0, help="only the N slowest rows")
    p.add_argument("--json", help="write the profile here")
    p.add_argument("--plot", help="write the roofline plot (PNG) here")
    p.add_argument("--ddp", help="predict data-parallel scaling at these worker counts, e.g. 1,2,4,8")
    p.add_argument(
        "--cores", type=int, default=0, help="CPU cores the workers share (default: measure how they share this one)"
    )
    p.add_argument("--extra-ms", type=float, default=0.0, help="per-step time outside forward/backward (optimizer)")
    p.set_defaults(func=cmd_profile)
