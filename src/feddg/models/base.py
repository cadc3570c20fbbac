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


def head_linear(net: nn.Module, purpose: str) -> tuple[str, nn.Linear]:
    """The last ``nn.Linear`` of ``net.classifier`` (its name in ``net``): the layer that makes the classes;
    ``TypeError`` naming ``purpose`` where the head has none."""
    head_root = next(n for n, m in net.named_modules() if m is net.classifier)
    inside = [(n, m) for n, m in net.named_modules()
              if isinstance(m, nn.Linear) and (n == head_root or n.startswith(f"{head_root}."))]
    if not inside:
        raise TypeError(f"{type(net).__name__}: its classifier has no nn.Linear {purpose}")
    return inside[-1]
