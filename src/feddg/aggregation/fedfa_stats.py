"""FedFA^l's server side (Zhou & Konukoglu, §3.2.4, Algorithm 1 lines 9–13): from every client's
momentum statistics to per-channel client-sharing variances and their Student-t modulation.

All functions work per channel: the variance of eq. 6 is a vector over C channels, never one
scalar over all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def client_sharing_variance(stats: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """Eq. 6: ``Σ² = (1/M) Σ_m (s̄_m − E_M[s̄])²`` per channel, for client statistics ``[M, C]`` → ``[C]``."""
    s = np.asarray(stats, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] == 0:
        raise ValueError(f"need client statistics of shape [M, C] with M ≥ 1, got {s.shape}")
    return s.var(axis=0)


def t_modulation(variance: np.ndarray) -> np.ndarray:
    """Eq. 7: ``γ_j = C q_j / Σ_c q_c`` with ``q_j = (1 + 1/Σ²_j)^{-1} = Σ²_j / (1 + Σ²_j)``.

    γ is non-negative, sums to C, and is monotone in Σ²: a channel with zero cross-client variance
    gets γ = 0, the smallest value. When every channel has zero variance (one client, or all
    clients at identical statistics) eq. 7 is 0/0; we return its limit for equal variances, γ = 1.
    """
    v = np.asarray(variance, dtype=np.float64)
    if v.ndim != 1 or (v < 0).any():
        raise ValueError("variance must be a non-negative vector [C]")
    q = v / (1.0 + v)
    total = q.sum()
    if total <= 0:
        return np.ones_like(v)
    return len(v) * q / total


def add_noise(stat: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """§6.2: Gaussian noise of standard deviation ``std`` on an uploaded statistic (same dtype)."""
    if std <= 0:
        return stat
    return (stat + rng.normal(0.0, std, size=stat.shape)).astype(stat.dtype)
