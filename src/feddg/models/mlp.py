"""A bag-of-words classifier for dense ``[B, V]`` feature inputs (``inputs = "features"``)."""

from __future__ import annotations

from torch import Tensor, nn

from feddg.models.base import FedModel


class BagOfWordsMLP(FedModel):
    """fc ``in_features`` → ``hidden`` → ReLU (the ``hidden``-d features) → fc classes."""

    def __init__(self, num_classes: int, in_features: int, hidden: int = 256) -> None:
        super().__init__()
        if in_features < 1 or hidden < 1:
            raise ValueError(f"mlp needs in_features and hidden >= 1, got {in_features} and {hidden}")
        self.hidden = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.feature_dim = hidden
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.hidden(x)
