"""A pre-norm transformer block (attention + MLP), for profiling: its projections and MLP are
matmuls (compute-bound on a GPU), its norms, activations and residual adds elementwise
(memory-bound).

    gpuherd profile examples/transformer.py:TransformerBlock --input 512,1024 --batch 8
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TransformerBlock(nn.Module):
    def __init__(self, width: int = 1024, heads: int = 16, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class SmallTransformerBlock(TransformerBlock):
    """A CPU-sized block."""

    def __init__(self) -> None:
        super().__init__(width=256, heads=4)
