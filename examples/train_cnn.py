"""Train a small ResNet-style CNN (torch only) on synthetic 32x32 images; DDP when WORLD_SIZE > 1.

python examples/train_cnn.py --steps 40          # by hand, one process
gpuherd submit examples/train_cnn_ddp.json       # 2 nodes through gpuherd
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from synthetic import arguments, run
from torch import nn

CLASSES = 10


class ResidualBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = CLASSES, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(
            ResidualBlock(width, width, 1),
            ResidualBlock(width, 2 * width, 2),
            ResidualBlock(2 * width, 4 * width, 2),
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(out, 1).flatten(1))


if __name__ == "__main__":
    run(arguments(__doc__).parse_args(), SmallResNet, (3, 32, 32), CLASSES)
