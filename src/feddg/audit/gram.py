"""Gram inversion for HFedATM: what ``G = AᵀA`` (``A``: the ``n×d`` inputs of the merged linear layer, one
row per sample and position) reveals of ``A``.

``G = V Λ Vᵀ`` (eigendecomposition) gives ``R = Λ^{1/2} Vᵀ`` with ``RᵀR = G``: every ``A`` with this Gram is
``A = Q R`` for some ``Q`` with orthonormal columns (``n×d``; ``A = U Σ Vᵀ``, ``Q = U``). So the features are
recovered exactly **up to an unknown rotation** (the best rotation, orthogonal Procrustes, aligns ``R`` with
``A`` to float precision), but the rotation is all that identifies individual rows: any ``n×n`` orthogonal
``P`` gives ``PA`` the same Gram and different activations. Only when ``n = 1`` (a single sample) is the
activation recovered, up to its sign.
"""

from __future__ import annotations

import numpy as np


def gram_root(gram: np.ndarray) -> np.ndarray:
    """``R = Λ^{1/2} Vᵀ`` (``d×d``, negative eigenvalues of a noised Gram floored at 0): ``RᵀR = G``."""
    lam, vec = np.linalg.eigh((gram + gram.T) / 2.0)
    return np.sqrt(np.clip(lam, 0.0, None))[:, None] * vec.T


def procrustes_error(a: np.ndarray, r: np.ndarray) -> float:
    """``min_Q ‖A − Q R‖_F / ‖A‖_F`` over ``Q`` with orthonormal columns (SVD of ``A Rᵀ``)."""
    u, _, vt = np.linalg.svd(a @ r.T, full_matrices=False)
    return float(np.linalg.norm(a - u @ vt @ r) / np.linalg.norm(a))


def random_rotation(n: int, seed: int) -> np.ndarray:
    """A Haar-random ``n×n`` orthogonal matrix (QR of a Gaussian matrix, signs fixed)."""
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def best_row_cosine(a: np.ndarray, candidates: np.ndarray) -> float:
    """Mean over the rows of ``a`` of the largest ``|cos|`` with any candidate row: 1 when every activation is
    among the candidates (up to sign)."""
    an = a / np.linalg.norm(a, axis=1, keepdims=True).clip(1e-12)
    cn = candidates / np.linalg.norm(candidates, axis=1, keepdims=True).clip(1e-12)
    return float(np.abs(an @ cn.T).max(axis=1).mean())


def gram_audit(a: np.ndarray, gram: np.ndarray | None = None, seed: int = 0) -> dict[str, float]:
    """What the Gram (``AᵀA`` unless a noised ``gram`` is given) reveals of the activations ``a``:

    * ``procrustes_rel_err``: feature recovery up to the best rotation (≈ 0: recovered up to rotation);
    * ``rotated_gram_rel_err`` / ``rotated_rows_rel_err``: another activation set ``PA`` (random ``P``) has the
      same Gram to float precision while its rows differ (the rotation ambiguity, numerically);
    * ``row_cosine`` vs ``row_cosine_top`` and ``row_cosine_random``: how well the attacker's recovered rows match
      individual activations, against the Gram's top eigenvector alone (the activations' common direction, e.g.
      their mean after a ReLU) and random directions of the same count.
    """
    a = np.asarray(a, np.float64)
    g = a.T @ a if gram is None else np.asarray(gram, np.float64)
    r = gram_root(g)
    p = random_rotation(len(a), seed)
    pa = p @ a
    rand = np.random.default_rng(seed + 1).standard_normal(r.shape)
    return {
        "n": float(len(a)), "d": float(a.shape[1]),
        "procrustes_rel_err": procrustes_error(a, r),
        "rotated_gram_rel_err": float(np.linalg.norm(pa.T @ pa - a.T @ a) / np.linalg.norm(a.T @ a)),
        "rotated_rows_rel_err": float(np.linalg.norm(pa - a) / np.linalg.norm(a)),
        "row_cosine": best_row_cosine(a, r),
        "row_cosine_top": best_row_cosine(a, r[-1:]),
        "row_cosine_random": best_row_cosine(a, rand),
    }
