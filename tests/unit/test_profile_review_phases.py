"""Review of the layer profiler: the step outside the model split into forward and backward, views
that move no data, and the model's hook state after profiling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from gpuherd.train import peaks as peaks_module
from gpuherd.train.peaks import DevicePeaks, device_peaks
from gpuherd.train.profile import OUTSIDE, profile_layers


def _outside(profile):
    return next(layer for layer in profile.layers if layer.name == OUTSIDE)


def test_the_loss_forward_counts_as_forward_and_its_backward_as_backward() -> None:
    batch, fan_in, fan_out = 8, 16, 4
    model = nn.Sequential(nn.Linear(fan_in, fan_out))
    target = torch.randn(fan_out, 32, requires_grad=True)  # its gradient: a second matmul in backward

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return (output @ target).sum()  # a matmul in the loss: (B x out) @ (out x 32)

    profile = profile_layers(model, torch.randn(batch, fan_in), loss_fn=loss_fn, warmup=0, repeats=1, peaks=None)
    outside = _outside(profile)
    matmul = 2 * batch * fan_out * 32
    assert outside.forward_flops == matmul  # the loss's own matmul, run in the forward
    assert outside.backward_flops == 2 * matmul  # its backward: the gradients of output and target
    assert outside.forward_bytes > 0 and outside.backward_bytes > 0


def test_a_linear_on_a_4d_input_counts_the_bytes_of_its_matmul_only() -> None:
    shape, fan_in, fan_out = (2, 3, 5), 8, 6
    model = nn.Sequential(nn.Linear(fan_in, fan_out, bias=False))
    profile = profile_layers(model, torch.randn(*shape, fan_in), warmup=0, repeats=1, peaks=None)
    linear = next(layer for layer in profile.layers if layer.name == "0")
    rows = 2 * 3 * 5
    # one mm: reads x and W, writes y; folding the leading dimensions back is a view (_unsafe_view)
    assert linear.forward_bytes == 4 * (rows * fan_in + fan_in * fan_out + rows * fan_out)
    assert "_unsafe_view" not in linear.uncounted_ops


def test_after_profiling_the_model_still_takes_a_regular_backward_hook() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    profile_layers(model, torch.randn(2, 4), warmup=0, repeats=1, peaks=None)
    for module in model.modules():
        assert not module._backward_hooks and not module._backward_pre_hooks
        assert not module._forward_hooks and not module._forward_pre_hooks
        module.register_backward_hook(lambda *_: None)  # raised "Cannot use both ..." after profiling


def test_a_peaks_cache_that_is_not_a_table_of_peaks_is_measured_again(tmp_path: Path, monkeypatch) -> None:
    measured = DevicePeaks(device="cpu", dtype="torch.float32", matmul_flops=1e9, copy_bytes_per_s=1e9)
    monkeypatch.setattr(peaks_module, "measure_peaks", lambda device, dtype: measured)
    cache = tmp_path / "peaks.json"
    key = f"{peaks_module.device_name(torch.device('cpu'))}|torch.float32|torch {torch.__version__}"
    for content in ("[]", json.dumps({key: {"device": "cpu", "flops": 1.0}}), json.dumps({key: "x"})):
        cache.write_text(content)
        assert device_peaks(torch.device("cpu"), torch.float32, cache=cache) == measured
        assert json.loads(cache.read_text())[key]["matmul_flops"] == 1e9


# (The model's own old-style hook is the point: torch warns about it when the model runs.)
@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")
def test_a_hook_that_cannot_be_registered_leaves_none_of_the_others_on_the_model() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model[2].register_backward_hook(lambda *_: None)  # a regular hook: full backward hooks are refused
    with pytest.raises(RuntimeError, match="Cannot use both"):
        profile_layers(model, torch.randn(2, 4), warmup=0, repeats=1, peaks=None)
    for module in (model, model[0], model[1]):
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._backward_hooks and not module._backward_pre_hooks
    assert model[2]._is_full_backward_hook is False and len(model[2]._backward_hooks) == 1
