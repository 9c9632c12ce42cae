"""The elastic runtime's state on a real GPU. Skipped where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gpuherd.train.elastic import ElasticSampler, ElasticState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(120),
]


def test_a_checkpoint_loaded_onto_the_gpu_restores_every_generator(tmp_path: Path) -> None:
    """``torch.load(path, map_location="cuda")`` moves the generators' states to the GPU too (a
    restart baseline on an H200 died of it: "RNG state must be a torch.ByteTensor")."""
    model = nn.Linear(16, 16).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model, optimizer, sampler=ElasticSampler(64, 8), micro_batch=8)
    torch.save(state.capture(), tmp_path / "checkpoint.pt")
    expected = (torch.rand(4, device="cuda"), torch.rand(4))
    state.restore(torch.load(tmp_path / "checkpoint.pt", weights_only=False, map_location="cuda"))
    assert torch.equal(torch.rand(4, device="cuda"), expected[0])
    assert torch.equal(torch.rand(4), expected[1])
