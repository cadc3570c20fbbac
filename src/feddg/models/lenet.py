"""LeNet-5 (LeCun et al., 1998) with ReLU and max-pooling, for 28 or 32 px inputs."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel


class LeNet(FedModel):
    """conv 6@5×5 → pool → conv 16@5×5 → pool → fc 120 → fc 84 (the 84-d features) → fc classes.

    The convolutions are unpadded as in the original; the flatten size (400 at 32 px, 256 at 28 px)
    is measured with a dummy forward at construction.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 28) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
        self.fc = nn.Sequential(
            nn.Linear(flat, 120),
            nn.ReLU(inplace=True),
            nn.Linear(120, 84),
            nn.ReLU(inplace=True),
        )
        self.feature_dim = 84
        self.classifier = nn.Linear(84, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.fc(self.conv(x))
