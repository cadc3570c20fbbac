"""Weighted means of messages — FedAvg's aggregation rule (McMahan et al., eq. in §2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from feddg.messages import Value


def normalised_weights(weights: Sequence[float]) -> np.ndarray:
    """``weights / sum(weights)`` as float64; rejects negative or all-zero weights."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0:
        raise ValueError("need at least one weight")
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {w.tolist()}")
    return w / w.sum()


def weighted_mean(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``Σ_k w_k a_k / Σ_k w_k`` in float64, cast back to the first array's dtype.

    Integer arrays (e.g. BatchNorm's ``num_batches_tracked``) are rounded.
    """
    w = normalised_weights(weights)
    acc = np.zeros_like(arrays[0], dtype=np.float64)
    for wk, a in zip(w, arrays, strict=True):
        acc += wk * np.asarray(a, dtype=np.float64)
    dtype = np.asarray(arrays[0]).dtype
    return np.rint(acc).astype(dtype) if np.issubdtype(dtype, np.integer) else acc.astype(dtype)


def weighted_mean_messages(
    messages: Sequence[Mapping[str, Value]], weights: Sequence[float], prefix: str
) -> dict[str, np.ndarray]:
    """Key-wise weighted mean of the ``prefix`` arrays of several messages (keys kept)."""
    keys = [k for k in messages[0] if k.startswith(prefix)]
    for m in messages[1:]:
        other = {k for k in m if k.startswith(prefix)}
        if other != set(keys):
            raise KeyError(f"messages disagree on {prefix!r} keys: {sorted(other ^ set(keys))[:3]}")
    return {k: weighted_mean([np.asarray(m[k]) for m in messages], weights) for k in keys}
