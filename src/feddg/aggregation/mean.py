"""Weighted means of messages — FedAvg's aggregation rule (McMahan et al., eq. in §2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from feddg.messages import Value

if TYPE_CHECKING:
    from feddg.models.permutation import RowGather  # the models: not needed to call its methods

#: elements per chunk of :func:`weighted_mean` (512 KiB of float64: the sums and one product stay in a 2 MiB L2; twice
#: the 256 KiB that was measured before: ResNet-18's merge means 1.2× faster on 2 threads, fewer numpy calls between the
#: threads' GIL hand-offs, docs/benchmarks.md, M1)
CHUNK = 1 << 16


def normalised_weights(weights: Sequence[float]) -> np.ndarray:
    """``weights / sum(weights)`` as float64; rejects negative or all-zero weights."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0:
        raise ValueError("need at least one weight")
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {w.tolist()}")
    return w / w.sum()


def weighted_mean(
    arrays: Sequence[np.ndarray], weights: Sequence[float], rows: Sequence[RowGather | None] | None = None
) -> np.ndarray:
    """``Σ_k w_k a_k / Σ_k w_k`` in float64, cast back to the first array's dtype, a chunk of about :data:`CHUNK`
    elements at a time (the memory beyond the result is a few chunks, never a float64 copy of it).

    ``rows[k]`` (optional, ``None`` = as is): permute ``a_k`` first (a :class:`~feddg.models.permutation.RowGather`
    from ``row_indices``, fused into the mean so the permuted copy is never written; the same float64 operations per
    element, so the bits of the mean of the permuted arrays). Integer arrays (e.g. BatchNorm's
    ``num_batches_tracked``) are rounded.
    """
    w = normalised_weights(weights)
    index = list(rows) if rows is not None else [None] * len(arrays)
    size = np.size(arrays[0])
    shapes = {g.view_shape(size) for g in index if g is not None}
    if len(shapes) > 1:
        raise ValueError(f"row gathers of different shapes: {sorted(shapes)}")
    shape = shapes.pop() if shapes else (size, 1)
    flat = [np.asarray(a).reshape(shape) for a in arrays]
    step = max(1, CHUNK // int(np.prod(shape[1:])))  # rows per chunk
    dtype = np.asarray(arrays[0]).dtype
    integer = np.issubdtype(dtype, np.integer)
    out = np.empty(shape, dtype=dtype)
    acc = np.empty((min(step, shape[0]), *shape[1:]), dtype=np.float64)  # one chunk's sums: never the whole mean
    scaled = np.empty_like(acc)
    gathered, scratch = np.empty(acc.shape, dtype=dtype), np.empty(acc.shape, dtype=dtype)
    for start in range(0, shape[0], step):  # in cache-sized chunks: the same operations, one pass over memory
        stop = min(start + step, shape[0])
        part = acc[:stop - start]
        part.fill(0.0)
        product = scaled[:len(part)]
        for wk, a, g in zip(w, flat, index, strict=True):
            src = a[start:stop] if g is None else g.take(a, start, stop, gathered, scratch)
            part += np.multiply(src, wk, out=product, dtype=np.float64)
        out[start:stop] = np.rint(part) if integer else part  # the cast of astype, chunk by chunk
    mean = out.reshape(np.shape(arrays[0]))
    return mean[()] if integer and mean.ndim == 0 else mean  # a 0-d count as a numpy scalar, as WeightedSum gives it


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


class WeightedSum:
    """FedAvg as a fold: ``Σ_k (n_k / E) a_k`` accumulated one message at a time in float64, so a round
    holds one model's worth of sums however many clients reply.

    ``E`` (``expected``) is the round's total weight as known when it starts (the sampled clients'
    example counts): the fold is then :func:`weighted_mean`'s ``Σ_k w_k a_k`` with ``w_k = n_k / Σ n``,
    operation for operation, so streaming and all-at-once aggregation give the same bits. If the
    weights that arrived sum to ``T ≠ E`` (a client failed), :meth:`mean` rescales by ``E / T``.
    ``expected=None`` folds plain sums (``w_k = n_k``). Integer arrays are rounded back.
    """

    def __init__(self, prefix: str, expected: float | None = None) -> None:
        if expected is not None and expected <= 0:
            raise ValueError(f"the expected total weight must be positive, got {expected}")
        self.prefix = prefix
        self.scale = 1.0 if expected is None else float(expected)
        self.sums: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.total = 0.0

    def add(self, msg: Mapping[str, Value], weight: float) -> None:
        if weight < 0:
            raise ValueError(f"weights must be non-negative, got {weight}")
        keys = [k for k in msg if k.startswith(self.prefix)]
        if self.sums and set(keys) != set(self.sums):
            raise KeyError(f"messages disagree on {self.prefix!r} keys: {sorted(set(keys) ^ set(self.sums))[:3]}")
        w = weight / self.scale
        for k in keys:
            a = np.asarray(msg[k])
            if k not in self.sums:
                self.sums[k], self.dtypes[k] = np.zeros(a.shape, dtype=np.float64), a.dtype
            self.sums[k] += w * a.astype(np.float64, copy=False)
        self.total += float(weight)

    def mean(self) -> dict[str, np.ndarray]:
        if self.total <= 0:
            raise ValueError("weights must have a positive sum (no examples were aggregated)")
        rescale = self.scale / self.total
        out = {}
        for k, s in self.sums.items():
            m, dtype = (s if rescale == 1.0 else s * rescale), self.dtypes[k]
            out[k] = np.rint(m).astype(dtype) if np.issubdtype(dtype, np.integer) else m.astype(dtype)
        return out
