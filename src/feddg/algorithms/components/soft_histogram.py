"""FedFA^h: differentiable soft histograms of features and their symmetric-KL alignment.

Equations are those of Zhou & Konukoglu, "FedFA+" (§3.3): the soft binning function Φ (eq. 12),
a client's histogram over its data (eq. 11), all channels stacked (eq. 13) and the symmetric KL
divergence between a mini-batch histogram and the server's average (eq. 14).

Shapes: features ``z`` are ``[N, C]`` (N samples of C channels); a histogram is ``[C, L]``, one
row of L bin probabilities per channel (the paper's ``π ∈ [0,1]^{LC}``, eq. 13).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

CutPoints = Literal["paper", "interior"]
KLReduction = Literal["mean", "sum"]

#: below this range a channel is treated as constant (ẑ = 0) instead of dividing by zero
RANGE_EPS = 1e-8
#: probabilities are clamped here inside the logarithms of eq. 14 (empty bins)
KL_EPS = 1e-8


def cut_points(num_bins: int, kind: CutPoints = "paper") -> Tensor:
    """The ``L − 1`` increasing cut points ρ over the normalised range [0, 1].

    ``"paper"`` (§3.3.1): ``ρ = [0, 1, …, L−2] / (L−2)``, so the first and last cut points sit at
    0 and 1 and the two outer bins only receive the channel's min and max. ``"interior"``:
    ``ρ_l = l / L`` for ``l = 1..L−1``, L equal-width bins over [0, 1].
    """
    if kind == "paper":
        if num_bins < 3:
            raise ValueError("the paper's cut points need at least 3 bins (they divide by L − 2)")
        return torch.arange(num_bins - 1, dtype=torch.float32) / (num_bins - 2)
    if kind == "interior":
        if num_bins < 2:
            raise ValueError("need at least 2 bins")
        return torch.arange(1, num_bins, dtype=torch.float32) / num_bins
    raise ValueError(f"unknown cut points {kind!r}; expected 'paper' or 'interior'")


def binning_weights(num_bins: int, kind: CutPoints = "paper") -> tuple[Tensor, Tensor]:
    """Eq. 12's constants: ``w = [1, …, L]``, ``b = [0, −ρ₁, −ρ₁−ρ₂, …, −Σ_{l<L} ρ_l]``."""
    rho = cut_points(num_bins, kind)
    w = torch.arange(1, num_bins + 1, dtype=torch.float32)
    b = torch.cat([torch.zeros(1), -torch.cumsum(rho, 0)])
    return w, b


def minmax_normalise(z: Tensor) -> Tensor:
    """``ẑ = (z − min) / (max − min)`` per channel over the N samples (eq. 12); a constant channel → 0."""
    lo = z.amin(dim=0, keepdim=True)
    hi = z.amax(dim=0, keepdim=True)
    return (z - lo) / (hi - lo).clamp_min(RANGE_EPS)


def soft_bin(z_hat: Tensor, num_bins: int = 8, tau: float = 0.01, kind: CutPoints = "paper") -> Tensor:
    """Φ(ẑ) = softmax((w ẑ + b) / τ) (eq. 12): ``[N, C]`` → ``[N, C, L]`` bin memberships summing to 1."""
    w, b = binning_weights(num_bins, kind)
    w, b = w.to(z_hat), b.to(z_hat)
    logits = (z_hat.unsqueeze(-1) * w + b) / tau
    return torch.softmax(logits, dim=-1)


def soft_histogram(z: Tensor, num_bins: int = 8, tau: float = 0.01, kind: CutPoints = "paper") -> Tensor:
    """π = (1/N) Σ_i Φ(ẑ_i) per channel (eqs. 11–13): features ``[N, C]`` → histogram ``[C, L]``.

    Min–max normalisation uses the min and max of these N samples (the mini-batch for π_m^(b),
    the client's whole local data for π_m).
    """
    if z.dim() != 2:
        raise ValueError(f"features must be [N, C], got shape {tuple(z.shape)}")
    return soft_bin(minmax_normalise(z), num_bins, tau, kind).mean(dim=0)


def kl_divergence(p: Tensor, q: Tensor, reduction: KLReduction = "mean") -> Tensor:
    """``D_KL(p‖q) = Σ_l p_l log(p_l / q_l)`` per channel of ``[C, L]`` histograms, then mean or sum over C."""
    per_channel = (p * (p.clamp_min(KL_EPS).log() - q.clamp_min(KL_EPS).log())).sum(dim=-1)
    return per_channel.mean() if reduction == "mean" else per_channel.sum()


def symmetric_kl(p: Tensor, q: Tensor, reduction: KLReduction = "mean") -> Tensor:
    """½ (D_KL(p‖q) + D_KL(q‖p)) (eq. 14)."""
    return 0.5 * (kl_divergence(p, q, reduction) + kl_divergence(q, p, reduction))
