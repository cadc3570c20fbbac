"""AlexNet with BatchNorm, the variant FedBN (Li et al., 2021) and FedFA (Zhou et al.) use.

The layer and state_dict names follow FedFA's released code (``layer1.conv1``, ``pool1``, ...,
``classifier.fc1``, ``classifier.bn6``, ...), so its checkpoints load. ``layer1``..``layer5`` are the
five convolutional stages after which FedFA inserts its feature-augmentation layers.

Hidden width of the head: FedBN's code uses 4096; FedFA's paper reports 49.5 MB of AlexNet
parameters (§ "Communication cost"), which is exactly this network with a 1024-wide head
(12.97 M float32 parameters for 10 classes; the 4096-wide head would be ~228 MB), and FedFA's code
uses 1024. The default follows FedFA; pass ``hidden_dim=4096`` for FedBN's head.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel

FEATURE_DIM = 256 * 6 * 6


def _stage(index: int, in_channels: int, out_channels: int, kernel: int, stride: int, padding: int) -> nn.Sequential:
    """One convolutional stage, named as in FedFA's code: ``conv{i}``, ``bn{i}``, ``relu{i}``."""
    return nn.Sequential(
        OrderedDict(
            [
                (f"conv{index}", nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding)),
                (f"bn{index}", nn.BatchNorm2d(out_channels)),
                (f"relu{index}", nn.ReLU(inplace=True)),
            ]
        )
    )


class AlexNet(FedModel):
    """conv1 64@11×11/4 → conv2 192@5×5 → conv3 384@3×3 → conv4 256@3×3 → conv5 256@3×3 (each + BN + ReLU,
    max-pool 3/2 after 1, 2 and 5) → adaptive avg-pool 6×6 → ``features`` (9216-d).

    ``classifier`` is fc1 9216→hidden + BN1d + ReLU, fc2 hidden→hidden + BN1d + ReLU, fc3 hidden→classes.

    ``small_input`` (default: ``image_size <= 64``) runs conv1 at stride 1 with padding 5, so 28/32 px
    inputs survive the three max-pools (the stride-4 original needs at least 63 px). Parameter names
    and shapes are unchanged.
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 28,
        hidden_dim: int = 1024,
        small_input: bool | None = None,
    ) -> None:
        super().__init__()
        small = image_size <= 64 if small_input is None else small_input
        self.layer1 = _stage(1, in_channels, 64, 11, stride=1 if small else 4, padding=5 if small else 2)
        self.pool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.layer2 = _stage(2, 64, 192, 5, stride=1, padding=2)
        self.pool2 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.layer3 = _stage(3, 192, 384, 3, stride=1, padding=1)
        self.layer4 = _stage(4, 384, 256, 3, stride=1, padding=1)
        self.layer5 = _stage(5, 256, 256, 3, stride=1, padding=1)
        self.pool5 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.feature_dim = FEATURE_DIM
        self.classifier = nn.Sequential(
            OrderedDict(
                [
                    ("fc1", nn.Linear(FEATURE_DIM, hidden_dim)),
                    ("bn6", nn.BatchNorm1d(hidden_dim)),
                    ("relu6", nn.ReLU(inplace=True)),
                    ("fc2", nn.Linear(hidden_dim, hidden_dim)),
                    ("bn7", nn.BatchNorm1d(hidden_dim)),
                    ("relu7", nn.ReLU(inplace=True)),
                    ("fc3", nn.Linear(hidden_dim, num_classes)),
                ]
            )
        )

    def features(self, x: Tensor) -> Tensor:
        x = self.pool1(self.layer1(x))
        x = self.pool2(self.layer2(x))
        x = self.pool5(self.layer5(self.layer4(self.layer3(x))))
        return torch.flatten(self.avgpool(x), 1)
