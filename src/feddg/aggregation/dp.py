"""Differential privacy of the Gram matrices HFedATM sends (§3.4: "the client optionally clips and
adds Gaussian noise"; §5.2 "Privacy robustness", ε ∈ {∞, 10, 5, 1}).

Mechanism (the "Analyze Gauss" release of a second-moment matrix, Dwork et al. 2014): a sample's input rows
``X_i`` of a linear layer (one row, or its pixels for a 1×1 conv, or its tokens) are clipped together to
``‖X_i‖_F ≤ C`` (:func:`clip_samples`), so adding or removing one sample changes ``G = Σ_i X_iᵀ X_i`` by a
matrix of Frobenius norm ``≤ C²`` (the L2 sensitivity of the upper triangle is at most that). Noise
``N(0, σ²)`` is drawn once per upper-triangular entry and mirrored, with ``σ`` calibrated from ``(ε, δ)``:

* ``analytic`` (default): the smallest ``σ`` of the analytic Gaussian mechanism (Balle & Wang 2018,
  Thm. 8), exact for every ``ε > 0``;
* ``classic``: ``σ = Δ √(2 ln(1.25/δ)) / ε`` (Dwork & Roth 2014, Thm. A.1; proven for ``ε < 1``).

The other shared statistics (FedFA's statistics and histograms, PARDON's and CCST's styles, FPL's
prototypes) are released under client-level local DP (:class:`StatisticDP`, :func:`privatize`): a
client's whole released statistic, all its arrays as one vector, is clipped to ``‖s‖ ≤ C``, so two
datasets of the client give statistics at most ``Δ = 2C`` apart (replace-one), and ``N(0, σ²)`` is
added to every entry. ``docs/privacy.md`` gives the argument per method; the run's ε is composed by
``feddg.aggregation.accounting``.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, model_validator
from scipy.special import log_ndtr, ndtr
from torch import Tensor

from feddg.settings import Settings

Mechanism = Literal["analytic", "classic"]
Accountant = Literal["rdp", "pld"]


def clip_rows(x: Tensor, clip: float) -> Tensor:
    """Each row scaled to L2 norm at most ``clip``: ``x · min(1, C / ‖x‖)``."""
    norms = x.norm(dim=1, keepdim=True)
    return x * torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)


def clip_samples(x: Tensor, clip: float) -> Tensor:
    """``x`` ``[B, ...]`` with each sample ``x[i]`` scaled to Frobenius norm at most ``clip``: then ``X_iᵀ X_i``, the
    sample's term of a Gram, has Frobenius norm ``≤ ‖X_i‖² ≤ C²`` however many rows (pixels, tokens) it has."""
    return clip_rows(x.reshape(len(x), -1), clip).reshape(x.shape)


def classic_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """``Δ √(2 ln(1.25/δ)) / ε``."""
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def analytic_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The exact ``δ`` of the Gaussian mechanism with noise ``σ`` at ``ε`` (Balle & Wang 2018, Thm. 8):
    ``Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ)``."""
    a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
    return float(ndtr(a - b) - math.exp(epsilon + float(log_ndtr(-a - b))))


def analytic_sigma(epsilon: float, delta: float, sensitivity: float, rtol: float = 1e-10) -> float:
    """The smallest ``σ`` with ``analytic_delta(σ) ≤ δ`` (bisection; ``δ(σ)`` decreases in ``σ``)."""
    lo = hi = sensitivity
    while analytic_delta(hi, epsilon, sensitivity) > delta:
        hi *= 2.0
    while analytic_delta(lo, epsilon, sensitivity) <= delta:
        lo /= 2.0
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if analytic_delta(mid, epsilon, sensitivity) <= delta else (mid, hi)
    return hi


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float, mechanism: Mechanism = "analytic") -> float:
    if not (epsilon > 0 and 0 < delta < 1 and sensitivity > 0):
        raise ValueError(f"need epsilon > 0, 0 < delta < 1, sensitivity > 0; got {epsilon}, {delta}, {sensitivity}")
    if mechanism == "analytic":
        return analytic_sigma(epsilon, delta, sensitivity)
    if mechanism == "classic":
        return classic_sigma(epsilon, delta, sensitivity)
    raise ValueError(f"unknown DP mechanism {mechanism!r}; expected 'analytic' or 'classic'")


def gram_sensitivity(clip: float) -> float:
    """L2 sensitivity of ``Σ_i X_iᵀ X_i`` over samples clipped to Frobenius norm ``clip``: ``C²``."""
    return clip * clip


def symmetric_noise(dim: int, sigma: float, generator: torch.Generator) -> Tensor:
    """``[dim, dim]`` float64: iid ``N(0, σ²)`` on and above the diagonal, mirrored below."""
    z = torch.randn(dim, dim, generator=generator, dtype=torch.float64) * sigma
    upper = torch.triu(z)
    return upper + torch.triu(z, diagonal=1).T


def privatize_gram(gram: Tensor, sigma: float, generator: torch.Generator) -> Tensor:
    """``G + E`` with symmetric Gaussian noise ``E`` (see the module docstring)."""
    return gram.double() + symmetric_noise(gram.shape[0], sigma, generator)


def basic_composition(epsilon: float, delta: float, releases: int) -> tuple[float, float]:
    """``(k ε, k δ)`` for ``k`` releases (the simple, conservative composition theorem)."""
    return releases * epsilon, releases * delta


# ------------------------------------------------------------------ client-level DP of a statistic


class StatisticDP(Settings):
    """``method.params.dp``: clip a client's released statistic to L2 norm ``clip`` and add Gaussian noise
    ``σ = noise_multiplier · Δ`` (``Δ = 2 · clip``), or the ``σ`` that makes one release ``(epsilon, delta)``-DP
    (analytic Gaussian mechanism). ``accountant`` composes the run's releases (results.json ``privacy``)."""

    model_config = ConfigDict(frozen=True)  # and Settings's extra="forbid"

    clip: float = Field(1.0, gt=0, description="L2 bound C of a client's released statistic (all its arrays)")
    noise_multiplier: float | None = Field(None, gt=0, description="σ / Δ with Δ = 2C; or give epsilon")
    epsilon: float | None = Field(None, gt=0, description="ε of one release (sets σ); the run's ε is composed")
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of one release and of the run's ε")
    accountant: Accountant = Field("rdp", description="rdp (Mironov 2017) or pld (privacy loss distributions)")

    @model_validator(mode="after")
    def _one_noise_setting(self) -> StatisticDP:
        if (self.noise_multiplier is None) == (self.epsilon is None):
            raise ValueError("set exactly one of dp.noise_multiplier or dp.epsilon")
        return self

    @property
    def sensitivity(self) -> float:
        """``Δ = 2C``: two statistics clipped to norm ``C`` differ by at most that."""
        return statistic_sensitivity(self.clip)

    def sigma(self) -> float:
        """σ of the noise on every entry."""
        if self.noise_multiplier is not None:
            return self.noise_multiplier * self.sensitivity
        assert self.epsilon is not None
        return analytic_sigma(self.epsilon, self.delta, self.sensitivity)


def statistic_sensitivity(clip: float) -> float:
    """L2 sensitivity of a released statistic clipped to norm ``clip`` when the client's whole dataset may
    change (replace-one at the client level): ``‖s − s'‖ ≤ ‖s‖ + ‖s'‖ ≤ 2C``."""
    return 2.0 * clip


def privatize(
    arrays: dict[str, np.ndarray], clip: float, sigma: float, generator: torch.Generator
) -> dict[str, np.ndarray]:
    """``s · min(1, C/‖s‖) + N(0, σ² I)`` of the arrays taken as one vector ``s`` (their order, each raveled),
    back in their shapes as float32. The noise is one ``torch.randn`` draw (float64) of ``generator``."""
    flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays.values()])
    norm = float(np.linalg.norm(flat))
    flat = flat * min(1.0, clip / norm) if norm > 0 else flat
    flat = flat + sigma * torch.randn(flat.size, generator=generator, dtype=torch.float64).numpy()
    out, start = {}, 0
    for key, a in arrays.items():
        shape = np.shape(a)
        size = int(np.prod(shape))
        out[key] = flat[start : start + size].reshape(shape).astype(np.float32)
        start += size
    return out
