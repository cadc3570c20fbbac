"""Shrinkage-aware RegMean (Jin et al., 2022) as HFedATM §3.4 uses it, eqs. 8–12.

Notation: a linear layer computes ``X W`` with ``X [n, m]`` its inputs and ``W [m, out]`` (the
transpose of ``nn.Linear.weight``). A client's Gram is ``G = X^T X`` (eq. 8), a station averages
its clients' Grams (eq. 9) and shrinks the off-diagonal part (eq. 10); the server merges the
stations' layers by the minimiser of ``Σ_e ‖X_e W − X_e W_e‖²`` (eq. 11) with ``G_e`` replaced by
``Ĝ_e``: ``W = (Σ_e Ĝ_e)^{-1} Σ_e Ĝ_e W_e`` (eq. 12), computed by a Cholesky solve, never an inverse.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from feddg.aggregation.mean import weighted_mean

logger = logging.getLogger(__name__)

#: the Grams travel as float32 (``hfedatm.client_update``): each entry is known to a relative ε₃₂, so the system
#: scaled to a unit diagonal is known to ± m·ε₃₂ in the 2-norm, and an eigenvalue of it below that is rounding, not
#: data (``numpy.linalg.matrix_rank``'s tolerance, on the scaling-invariant form)
GRAM_EPS = float(np.finfo(np.float32).eps)


def station_gram(grams: Sequence[np.ndarray]) -> np.ndarray:
    """Eq. 9: the plain mean of the active clients' Grams, in float64."""
    return np.mean([np.asarray(g, dtype=np.float64) for g in grams], axis=0)


def shrink(gram: np.ndarray, alpha: float) -> np.ndarray:
    """Eq. 10: ``Ĝ = α G + (1 − α) diag(G)`` — off-diagonal entries scaled by ``α``, diagonal kept."""
    g = np.asarray(gram, dtype=np.float64)
    return alpha * g + (1.0 - alpha) * np.diag(np.diag(g))


def psd_project(gram: np.ndarray) -> np.ndarray:
    """Nearest (Frobenius) positive semi-definite matrix: negative eigenvalues set to 0.

    Used on DP-noised Grams (post-processing, so it costs no privacy)."""
    g = np.asarray(gram, dtype=np.float64)
    vals, vecs = np.linalg.eigh(0.5 * (g + g.T))
    return (vecs * np.clip(vals, 0.0, None)) @ vecs.T


@dataclass(frozen=True)
class RegMeanResult:
    weight: np.ndarray  # merged nn.Linear weight [out, in]
    cond: float  # 2-norm condition number of the solved system (inf if singular)
    fallback: bool  # True: the system was singular and the weighted mean was used
    dead_inputs: int  # input features with zero Gram diagonal at every station (solved as the mean)


def regmean(
    weights: Sequence[np.ndarray], grams: Sequence[np.ndarray], mean_weights: Sequence[float], name: str = "layer"
) -> RegMeanResult:
    """Eq. 12 for one layer: ``weights`` are the stations' ``nn.Linear.weight`` ``[out, in]``, ``grams``
    their (shrunk) Grams ``[in, in]``; ``mean_weights`` (γ_e) weight the fallback mean.

    Input features that no station ever activated (an all-zero Gram row and column, e.g. dead
    ReLUs) make the system singular but decouple from it: their weights are set to the weighted mean,
    which leaves the solution for every other feature unchanged. If the remaining system is still
    singular — its smallest eigenvalue scaled to a unit diagonal at most ``m ·`` :data:`GRAM_EPS` — the whole
    layer falls back to the weighted mean with a logged warning.
    """
    mean = weighted_mean([np.asarray(w) for w in weights], mean_weights)
    a = torch.zeros(mean.shape[1], mean.shape[1], dtype=torch.float64)
    b = torch.zeros(mean.shape[1], mean.shape[0], dtype=torch.float64)
    for g, w in zip(grams, weights, strict=True):
        g64 = torch.as_tensor(np.asarray(g), dtype=torch.float64)  # a view when already float64
        a += g64
        b.addmm_(g64, torch.as_tensor(np.asarray(w)).T.double())  # Σ_e Ĝ_e W_e^T
    a = (a + a.T).mul_(0.5)
    dead = torch.diagonal(a) <= 0
    if dead.any():
        a[dead, :] = 0.0
        a[:, dead] = 0.0
        a[dead, dead] = 1.0
        b[dead, :] = torch.from_numpy(mean.T.astype(np.float64))[dead, :]
    eig = torch.linalg.eigvalsh(a)
    cond = float(eig[-1] / eig[0]) if eig[0] > 0 else float("inf")
    root = torch.diagonal(a).rsqrt()  # every diagonal entry > 0 here (dead ones set to 1)
    least = float(torch.linalg.eigvalsh(a * root[:, None] * root[None, :])[0])
    tolerance = a.shape[0] * GRAM_EPS
    chol, info = torch.linalg.cholesky_ex(a)
    if info != 0 or not least > tolerance:
        logger.warning("RegMean: %s is singular (cond %.3g; least eigenvalue at unit diagonal %.2g <= %.2g, the "
                       "float32 Grams' rounding); falling back to the weighted mean", name, cond, least, tolerance)
        return RegMeanResult(mean, cond, True, int(dead.sum()))
    solution = torch.cholesky_solve(b, chol)  # [in, out]
    return RegMeanResult(solution.T.numpy().astype(mean.dtype), cond, False, int(dead.sum()))
