"""A small 4-block CNN for 28/32 px inputs (the zoo's default model), with BatchNorm or GroupNorm."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel

WIDTHS: tuple[int, ...] = (32, 64, 128, 256)
GROUPS = 8  # GroupNorm's groups (Wu & He 2018 use 32 at widths >= 64; 8 keeps 4 channels a group at width 32)
Norm = Literal["batch", "group"]


def _block(in_channels: int, out_channels: int, pool: bool, norm: Norm) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels) if norm == "batch" else nn.GroupNorm(GROUPS, out_channels),
        nn.ReLU(inplace=True),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class SmallCNN(FedModel):
    """4 × [conv 3×3, BN, ReLU] with widths 32-64-128-256, max-pool after blocks 1-3, global average pool.
    ``norm="group"`` (model ``cnn_gn``) puts GroupNorm where BN was: no running statistics, so nothing in the
    weights is a batch statistic of the client's data (what DP-FedAvg needs: docs/privacy.md).

    28 px: 28 → 14 → 7 → 3 → GAP; 32 px: 32 → 16 → 8 → 4 → GAP. ``feature_dim`` is 256 and the
    classifier one ``nn.Linear``. About 1.3k-1.8k img/s training at batch 32 on two idle CPU cores
    (``benchmarks/bench_models.py``).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 28,
                 block_widths: tuple[int, ...] = WIDTHS, norm: Norm = "batch") -> None:
        if norm not in ("batch", "group"):
            raise ValueError(f"cnn norm must be 'batch' or 'group', got {norm!r}")
        super().__init__()
        del image_size  # global average pooling makes the network size-agnostic
        widths = (in_channels, *block_widths)
        self.blocks = nn.Sequential(
            *(_block(widths[i], widths[i + 1], i < len(block_widths) - 1, norm) for i in range(len(block_widths)))
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = block_widths[-1]
        self.classifier = nn.Linear(self.feature_dim, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return torch.flatten(self.pool(self.blocks(x)), 1)


def cnn(num_classes: int, in_channels: int = 3, image_size: int = 28, block_widths: tuple[int, ...] = WIDTHS) -> SmallCNN:
    """:class:`SmallCNN` with BatchNorm (model ``cnn``; its norm is not an option, so its capabilities hold)."""
    return SmallCNN(num_classes, in_channels, image_size, block_widths)


def cnn_gn(num_classes: int, in_channels: int = 3, image_size: int = 28) -> SmallCNN:
    """:class:`SmallCNN` with GroupNorm (model ``cnn_gn``)."""
    return SmallCNN(num_classes, in_channels, image_size, norm="group")
