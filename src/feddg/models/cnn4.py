"""The 4-conv CNN (widths 32-64-64-64, ~94k parameters) of the W1 benchmark: a cheaper sibling of ``cnn``."""

from __future__ import annotations

from feddg.models.cnn import SmallCNN

WIDTHS: tuple[int, ...] = (32, 64, 64, 64)


class CNN4(SmallCNN):
    """:class:`~feddg.models.cnn.SmallCNN`'s layout (4 × [conv 3×3, BN, ReLU], max-pool after blocks 1-3,
    global average pool, one ``nn.Linear`` head) with widths 32-64-64-64: ``feature_dim`` 64; 94,122
    parameters for 3 channels and 10 classes."""

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 28) -> None:
        super().__init__(num_classes, in_channels, image_size, block_widths=WIDTHS)
