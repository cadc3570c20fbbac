"""Update inversion of a weights reply: DLG (Zhu et al. 2019, "Deep Leakage from Gradients", Alg. 1) with
iDLG's label (Zhao et al. 2020, §3: the true class is the only negative entry of the cross-entropy gradient
of the last layer's bias).

The victim takes one local SGD step of learning rate ``η`` at batch 1 from the weights ``w`` the server
sent and replies ``w − η ∇L(x, y)``; the server knows ``w`` and ``η``, so it sees the gradient
``g = (w − w')/η``. The attack optimises a dummy input ``x̂`` (L-BFGS) so that ``∇L(x̂, ŷ)`` matches ``g``.
With DP the client noises its own reply (local DP): the update ``Δ = w' − w`` is clipped to ``C`` and
``N(0, (z·C)²)`` is added per entry, one noise stream scaled by ``z``. ``dp_weights`` is central (the server clips
the clean reply and noises only the aggregate), so its server sees the noiseless update (``docs/privacy.md``).

The model is a tiny sigmoid CNN (the DLG paper's choice: twice differentiable, no BatchNorm), not the
run's network: the attack is the standard FL baseline that puts the statistics' leakage in context.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TinyNet(nn.Module):
    """Two stride-2 5×5 sigmoid convolutions (12 channels) and a linear head (DLG's LeNet variant)."""

    def __init__(self, channels: int, height: int, width: int, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, 12, 5, 2, 2), nn.Sigmoid(), nn.Conv2d(12, 12, 5, 2, 2), nn.Sigmoid())
        self.head = nn.Linear(12 * math.ceil(height / 4) * math.ceil(width / 4), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).flatten(1))


def gradient(model: nn.Module, x: Tensor, y: Tensor, *, create_graph: bool = False) -> list[Tensor]:
    """``∇_w CE(model(x), y)`` per parameter."""
    loss = F.cross_entropy(model(x), y)
    return list(torch.autograd.grad(loss, list(model.parameters()), create_graph=create_graph))


def one_step_update(model: nn.Module, x: Tensor, y: Tensor, lr: float) -> list[Tensor]:
    """The reply's update ``Δ = w' − w = −η ∇L(x, y)`` of one local SGD step."""
    return [-lr * g for g in gradient(model, x, y)]


def update_norm(update: list[Tensor]) -> float:
    """``‖Δ‖``: all arrays of the update as one vector."""
    return float(torch.cat([u.double().flatten() for u in update]).norm())


def dp_update(update: list[Tensor], z: float, clip: float, seed: int) -> list[Tensor]:
    """One client's update under local DP: ``Δ·min(1, C/‖Δ‖) + N(0, (zC)²)`` (identity at ``z = 0``)."""
    if z == 0:
        return update
    scale = min(1.0, clip / max(update_norm(update), 1e-12))
    gen = torch.Generator().manual_seed(seed)
    return [u * scale + z * clip * torch.randn(u.shape, generator=gen) for u in update]


def idlg_label(update: list[Tensor], model: nn.Module) -> int:
    """iDLG: the class whose last-layer bias gradient ``p − onehot(y)`` is negative (the update's is positive)."""
    names = [n for n, _ in model.named_parameters()]
    bias = update[names.index("head.bias")]
    return int(torch.argmax(bias))


def dlg(model: nn.Module, update: list[Tensor], lr: float, shape: tuple[int, ...], *,
        iterations: int = 30, seed: int = 0) -> tuple[Tensor, int]:
    """The dummy input ``x̂`` (``[1, *shape]``) and label that best explain ``update`` (L-BFGS on the squared
    distance of gradients, ``iterations`` outer steps of at most 20 evaluations)."""
    target = [-u / lr for u in update]
    label = torch.tensor([idlg_label(update, model)])
    gen = torch.Generator().manual_seed(seed)
    dummy = torch.randn((1, *shape), generator=gen).requires_grad_(True)
    opt = torch.optim.LBFGS([dummy], lr=1.0, max_iter=20, history_size=50, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        g = gradient(model, dummy, label, create_graph=True)
        loss = sum(((a - b) ** 2).sum() for a, b in zip(g, target, strict=True))
        assert isinstance(loss, Tensor)
        loss.backward()
        return loss

    for _ in range(iterations):
        opt.step(closure)
    return dummy.detach(), int(label)
