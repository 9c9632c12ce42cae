"""The roofs of a roofline: the peak matmul FLOP/s and copy bandwidth of the device a profile runs on.

Measured, not taken from a spec sheet: a short matmul and a large copy, best of a few runs. The
result is cached per device, dtype, thread count and torch version in
``$XDG_CACHE_HOME/gpuherd/peaks.json`` (``~/.cache`` by default), so only the first profile on a
machine pays the few seconds it takes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DevicePeaks:
    device: str  # the device's name, e.g. "NVIDIA H100 80GB HBM3" or "cpu (2 threads)"
    dtype: str
    matmul_flops: float  # FLOP/s of a large square matmul
    copy_bytes_per_s: float  # bytes read + written per second by a large device-to-device copy

    @property
    def ridge(self) -> float:
        """The arithmetic intensity (FLOP/byte) where the two roofs meet: below it a kernel is
        memory-bound, above it compute-bound."""
        return self.matmul_flops / self.copy_bytes_per_s

    def attainable(self, intensity: float) -> float:
        return min(self.matmul_flops, intensity * self.copy_bytes_per_s)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({torch.get_num_threads()} threads)"


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuherd" / "peaks.json"


def device_peaks(device: torch.device, dtype: torch.dtype, *, cache: Path | None = None) -> DevicePeaks:
    """The cached peaks for this device and dtype, measured on first use. ``cache=None``: the
    default cache file; pass a path to use another."""
    path = cache if cache is not None else default_cache()
    key = f"{device_name(device)}|{dtype}|torch {torch.__version__}"
    known = _read(path)
    try:
        return DevicePeaks(**known[key])
    except (KeyError, TypeError):  # not measured yet, or an entry of another shape: measure
        pass
    peaks = measure_peaks(device, dtype)
    known[key] = asdict(peaks)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measure again next time
    return peaks


def _read(path: Path) -> dict[str, dict]:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}  # JSON, but not the cache's table


def measure_peaks(device: torch.device, dtype: torch.dtype, *, repeats: int = 5) -> DevicePeaks:
    """Best-of-``repeats`` matmul FLOP/s and copy bandwidth (sizes large enough to leave the caches)."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    matmul = _best(lambda: torch.mm(a, b), device, repeats)
    elements = (1 << 30 if cuda else 1 << 28) // torch.tensor([], dtype=dtype).element_size()
    src = torch.empty(elements, device=device, dtype=dtype).fill_(1)
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), device, repeats)
    moved = 2 * src.numel() * src.element_size()
    return DevicePeaks(
        device=device_name(device),
        dtype=str(dtype),
        matmul_flops=2.0 * n**3 / matmul,
        copy_bytes_per_s=moved / copy,
    )


def _best(work, device: torch.device, repeats: int) -> float:
    cuda = device.type == "cuda"
    work()  # warm-up: allocation, kernel selection
    if cuda:
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best
