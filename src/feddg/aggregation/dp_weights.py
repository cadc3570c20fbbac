"""Client-level DP of weight replies: DP-FedAvg with fixed or adaptive clipping, server side (docs/privacy.md,
"DP on the weights").

* **Clipping** (McMahan et al. 2018, "Learning differentially private recurrent language models", Alg. 1,
  FlatClip): a client's update ``Δ_k = w_k − w_sent``, all its float ``w/`` arrays as one vector, is scaled to
  ``Δ_k · min(1, C/‖Δ_k‖)``: Flower 1.41's ``compute_clip_model_update`` / ``clip_inputs_inplace``.
* **Noise** on the aggregate: ``N(0, s²)`` per entry with ``s = z · C · max_k p_k``, ``p_k`` the clients'
  weights in the mean. With equal weights (``p_k = 1/m``) that is Flower's ``compute_stdv`` ``z·C/m``; with
  unequal example counts the largest weight bounds a client's contribution ``p_k Δ_k`` (‖·‖ ≤ ``p_k C``), so
  ``z`` stays the noise multiplier of the mechanism.
* **Adaptive clipping** (Andrew et al. 2021, "Differentially private learning with adaptive clipping", Alg. 1):
  each round the server counts the updates left unclipped, ``b = Σ_k 1[‖Δ_k‖ ≤ C]``, noises the count with
  ``N(0, σ_b²)`` and moves ``C ← C · exp(−η_C (b̃/m − γ))`` (geometric update toward the ``γ`` quantile of the
  update norms). The weights' noise multiplier is then ``z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)`` so that the two
  releases together are one Gaussian mechanism of multiplier ``z`` (Andrew et al. Thm. 1): Flower's
  ``compute_adaptive_noise_params``, default ``σ_b = m/20``.

Flower's server-side adaptive wrapper counts *clipped* updates in the same update formula, which moves ``C`` the
wrong way (it shrinks ``C`` when most updates are clipped); this module follows the paper (and Flower's older
``DPFedAvgAdaptive``, whose clients sent ``not clipped``). Noise is drawn from a numpy ``Generator`` the caller
seeds per round, not from numpy's global stream as Flower does, so runs and resumes are reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from feddg.messages import WEIGHT_PREFIX, Value


def float_weight_keys(msg: Mapping[str, Value]) -> list[str]:
    """The ``w/`` keys of ``msg`` holding float arrays (integer counters such as ``num_batches_tracked`` are
    neither clipped nor noised)."""
    return [k for k, v in msg.items() if k.startswith(WEIGHT_PREFIX) and np.asarray(v).dtype.kind == "f"]


def update_norm(reply: Mapping[str, Value], sent: Mapping[str, Value]) -> float:
    """``‖w_k − w_sent‖`` over the float ``w/`` arrays as one vector, in float64 (Flower's ``get_norm``)."""
    total = 0.0
    for k in float_weight_keys(sent):
        d = np.asarray(reply[k], dtype=np.float64).ravel() - np.asarray(sent[k], dtype=np.float64).ravel()
        total += float(d @ d)
    return math.sqrt(total)


def clip_update(reply: Mapping[str, Value], sent: Mapping[str, Value], clip: float) -> tuple[dict[str, Value], float]:
    """``reply`` with its float ``w/`` arrays replaced by ``w_sent + Δ · min(1, C/‖Δ‖)`` (float64, cast back), and
    ``‖Δ‖``. An update within the bound is returned as it came (the same bits)."""
    if clip <= 0:
        raise ValueError(f"the clipping norm must be positive, got {clip}")
    norm = update_norm(reply, sent)
    if norm <= clip:
        return dict(reply), norm
    scale = clip / norm
    out = dict(reply)
    for k in float_weight_keys(sent):
        old = np.asarray(sent[k], dtype=np.float64)
        new = old + (np.asarray(reply[k], dtype=np.float64) - old) * scale
        out[k] = new.astype(np.asarray(reply[k]).dtype)
    return out, norm


def noise_std(noise_multiplier: float, clip: float, weights: Iterable[float]) -> float:
    """``z · C · max_k p_k`` for the mean ``Σ_k p_k w_k`` (``p`` normalised here); ``z·C/m`` for equal weights."""
    p = np.asarray(list(weights), dtype=np.float64)
    if p.size == 0 or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"need non-negative weights with a positive sum, got {p.tolist()}")
    return float(noise_multiplier * clip * (p.max() / p.sum()))


def gaussian_noise(arrays: Mapping[str, Value], std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """float64 ``N(0, std²)`` of each array's shape, drawn in key order from ``rng``."""
    return {k: rng.normal(0.0, std, np.shape(v)) for k, v in arrays.items()}


def adaptive_noise(noise_multiplier: float, sampled: int, count_std: float | None) -> tuple[float, float]:
    """``(σ_b, z_Δ)``: the clipped count's noise std (default ``m/20``) and the weights' noise multiplier
    ``(z⁻² − (2σ_b)⁻²)^(−1/2)`` (Andrew et al. 2021, Thm. 1; Flower's ``compute_adaptive_noise_params``)."""
    if noise_multiplier == 0:
        return (0.0 if count_std is None else count_std), 0.0
    std = sampled / 20 if count_std is None else count_std
    if noise_multiplier >= 2 * std:
        raise ValueError(f"dp_weights.adaptive.count_std: {std:g} is too small for noise_multiplier "
                         f"{noise_multiplier:g} (need count_std > noise_multiplier / 2)")
    return std, (noise_multiplier ** -2 - (2 * std) ** -2) ** -0.5


def next_clip(clip: float, unclipped: float, sampled: int, target_quantile: float, clip_lr: float) -> float:
    """``C · exp(−η_C (b̃/m − γ))`` with ``b̃`` the (noised) count of unclipped updates of the ``m`` sampled
    clients (Andrew et al. 2021, Alg. 1, geometric update)."""
    return clip * math.exp(-clip_lr * (unclipped / sampled - target_quantile))
