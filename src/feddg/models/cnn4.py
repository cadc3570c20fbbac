"""The 4-conv CNN (widths 32-64-64-64, ~94k parameters) of the W1 benchmark: a cheaper sibling of ``cnn``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel
from feddg.models.cnn import _block

WIDTHS: tuple[int, ...] = (32, 64, 64, 64)


class CNN4(FedModel):
    """4 × [conv 3×3, BN, ReLU] with widths 32-64-64-64, max-pool after blocks 1-3, global average pool.

    The same layout as :class:`~feddg.models.cnn.SmallCNN` with narrower last blocks: ``feature_dim``
    64, one ``nn.Linear`` head; 94,122 parameters for 3 channels and 10 classes.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 28) -> None:
        super().__init__()
        del image_size  # global average pooling makes the network size-agnostic
        widths = (in_channels, *WIDTHS)
        self.blocks = nn.Sequential(
            *(_block(widths[i], widths[i + 1], pool=i < len(WIDTHS) - 1) for i in range(len(WIDTHS)))
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = WIDTHS[-1]
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return torch.flatten(self.pool(self.blocks(x)), 1)
