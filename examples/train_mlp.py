"""Train a small MLP on synthetic data; DistributedDataParallel when WORLD_SIZE > 1.

python examples/train_mlp.py --steps 100        # by hand, one process
gpuherd submit examples/train_mlp.json          # through gpuherd
"""

from __future__ import annotations

from synthetic import arguments, run
from torch import nn

FEATURES, CLASSES = 64, 10


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, CLASSES),
    )


if __name__ == "__main__":
    run(arguments(__doc__).parse_args(), make_model, (FEATURES,), CLASSES)
