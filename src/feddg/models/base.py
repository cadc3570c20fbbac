"""The interface every model of the zoo implements.

A model is ``classifier(features(x))``: ``features`` maps images to a flat ``[B, feature_dim]``
representation, ``classifier`` is the head (an ``nn.Linear`` or a small ``nn.Sequential``).
Methods that act on the representation (FedSR, FedIIR, PARDON, FPL, FedFA^h) rely on this split.
"""

from __future__ import annotations

from torch import Tensor, nn


class FedModel(nn.Module):
    """Base class: subclasses set ``feature_dim`` and ``classifier`` and implement ``features``."""

    feature_dim: int
    classifier: nn.Module

    def features(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))
