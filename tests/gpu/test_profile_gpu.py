"""The layer profiler on a real GPU: CUDA-event times, measured roofs, and the roofline verdicts
of a transformer block (matmuls compute-bound, norms and activations memory-bound).

Skipped where CUDA is absent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gpuherd.train.profile import OUTSIDE, profile_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def test_transformer_block_sits_on_both_roofs(tmp_path: Path) -> None:
    from transformer import TransformerBlock

    device = torch.device("cuda")
    model = TransformerBlock().to(device, torch.bfloat16)
    # 64k tokens: enough work that the GPU sets the step's pace, not the launches. On an H200 the
    # rows came to 2.1x the plain step at 4k tokens (launch-bound: the hooks' CPU time shows) and
    # 1.09-1.13x at 32k, where the backward hooks' Python still left the GPU short gaps.
    x = torch.randn(128, 512, 1024, device=device, dtype=torch.bfloat16)
    profile = profile_layers(model, x, warmup=3, repeats=10, peaks_cache=tmp_path / "peaks.json")
    peaks = profile.peaks
    assert peaks is not None and peaks.matmul_flops > 1e13  # any datacenter GPU does 10+ TFLOP/s in bf16
    rows = {layer.name: layer for layer in profile.layers}
    for name in ("qkv", "fc1", "fc2"):
        assert rows[name].bound(peaks) == "compute", rows[name]
        assert rows[name].roof_fraction(peaks) > 0.2
    for name in ("norm1", "norm2", "act"):
        assert rows[name].bound(peaks) == "memory", rows[name]
    model_rows = [layer for layer in profile.layers if layer.name != OUTSIDE]
    assert all(layer.time_s > 0 for layer in model_rows if layer.kind == "Linear")
    assert profile.layer_sum_s == pytest.approx(profile.profiled_step_s, rel=0.1)  # the rows add up
    assert profile.layer_sum_s == pytest.approx(profile.step_s, rel=0.1)  # and to the step unhooked
    assert (tmp_path / "peaks.json").exists()
