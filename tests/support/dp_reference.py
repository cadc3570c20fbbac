"""An independent reference for the tests of feddg's DP calibration: the Gaussian mechanism's exact ε, written from
Balle and Wang (2018), Thm. 8, with nothing from feddg."""

from __future__ import annotations

import math


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def analytic_gaussian_epsilon(ratio: float, delta: float) -> float:
    """The exact ε at ``delta`` of the Gaussian mechanism with ``σ/Δ = ratio``, by bisection on
    δ(ε) = Φ(Δ/2σ − εσ/Δ) − e^ε Φ(−Δ/2σ − εσ/Δ) (decreasing in ε)."""
    def delta_of(eps: float) -> float:
        return _phi(0.5 / ratio - eps * ratio) - math.exp(eps) * _phi(-0.5 / ratio - eps * ratio)

    lo, hi = 0.0, 500.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def accounted_gaussian(accountant: type, z: float, releases: int, delta: float) -> float:
    """ε at ``delta`` of ``releases`` Gaussian releases of noise multiplier ``z``, from a dp-accounting accountant
    class (``RdpAccountant``, ``PLDAccountant``) called directly."""
    from dp_accounting import GaussianDpEvent

    acc = accountant()
    acc.compose(GaussianDpEvent(z), releases)
    return acc.get_epsilon(delta)
