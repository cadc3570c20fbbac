"""Vector inversion: train the attacker's generator on its own ``(image, vector)`` pairs and apply it to
the vectors the victims shared — styles (PARDON Table IV), FedFA's feature moments, FPL's prototypes.

PARDON §IV-B3's two attackers differ only in whose data trains the generator: (i) a third party (or the
server) with held-out public data, (ii) a malicious client with its own data. Each victim's shared
statistic is released under client-level DP exactly as the methods do it (``aggregation/dp.py:
privatize``: all its rows clipped as one vector to ``C``, ``N(0, (z·2C)²)`` per entry), at every noise
multiplier ``z`` of the sweep, from one noise stream scaled by ``z`` (so the sweep is monotone in noise
by construction of the draw, not by luck of the seed); ε is the accountant's for ``releases`` releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feddg.aggregation.accounting import gaussian_epsilon
from feddg.aggregation.dp import privatize
from feddg.audit.generator import invert, train_generator
from feddg.audit.metrics import FID_NAME, effnet_features, frechet_distance, nearest, nearest_scores, reidentification


@dataclass
class Victims:
    """What the victims hold and share: per shared row its owner; the true images with owners (the
    re-identification pool: every client's images)."""

    vectors: np.ndarray  # [R, d] shared rows
    row_owner: np.ndarray  # [R] client id of each row
    pool: np.ndarray  # [N, C, H, W] in [0, 1]: every client's images
    pool_owner: np.ndarray  # [N]


def noised(vectors: np.ndarray, owners: np.ndarray, z: float, clip: float, seed: int) -> np.ndarray:
    """Each owner's rows released as one statistic: clipped to ``clip`` and noised with ``σ = z·2C``
    (the identity at ``z = 0``: no DP, no clipping)."""
    if z == 0:
        return vectors
    gen = torch.Generator().manual_seed(seed)  # the same draws at every z: only their scale σ changes
    out = np.empty_like(vectors, dtype=np.float32)
    for o in np.unique(owners):
        rows = owners == o
        out[rows] = privatize({"v": vectors[rows]}, clip, z * 2.0 * clip, gen)["v"]
    return out


def scores(recon: np.ndarray, victims: Victims, *, fid: bool = True) -> dict[str, Any]:
    """PSNR / SSIM against the nearest image of each reconstruction's victim, the Fréchet distance between
    the reconstructions and those nearest images (0 for perfect reconstructions), and the re-identification
    rate (with its chance level)."""
    p, s = zip(*(nearest_scores(r[None], victims.pool[victims.pool_owner == o])
                 for r, o in zip(recon, victims.row_owner, strict=True)), strict=True)
    chance = float(np.mean([np.mean(victims.pool_owner == o) for o in victims.row_owner]))
    out: dict[str, Any] = {"psnr": float(np.mean(p)), "ssim": float(np.mean(s)),
                           "reid": reidentification(recon, victims.row_owner, victims.pool, victims.pool_owner),
                           "reid_chance": chance, "n": len(recon)}
    matched = nearest_true(recon, victims)
    out[FID_NAME] = frechet_distance(effnet_features(matched), effnet_features(recon)) if fid and len(recon) >= 2 else None
    return out


def vector_inversion(
    attacker_images: np.ndarray, attacker_vectors: np.ndarray, victims: Victims, *,
    noise_multipliers: tuple[float, ...] = (0.0,), clip: float | None = None, delta: float = 1e-5,
    releases: int = 1, steps: int = 300, seed: int = 0, fid: bool = True,
) -> tuple[list[dict[str, Any]], dict[float, np.ndarray]]:
    """One attack at every noise multiplier: a row of metrics each (with ε; ``None`` without DP) and the
    reconstructions by multiplier. ``clip`` defaults to the median norm of a victim's whole statistic."""
    gen = train_generator(attacker_images, attacker_vectors, steps=steps, seed=seed)
    if clip is None:
        clip = float(np.median([np.linalg.norm(victims.vectors[victims.row_owner == o])
                                for o in np.unique(victims.row_owner)]))
    rows, recons = [], {}
    for z in noise_multipliers:
        recon = invert(gen, noised(victims.vectors, victims.row_owner, z, clip, seed))
        eps = gaussian_epsilon(z, releases, delta) if z > 0 else None
        rows.append({"noise_multiplier": z, "epsilon": eps, "delta": delta, "clip": clip, **scores(recon, victims, fid=fid)})
        recons[z] = recon
    return rows, recons


def nearest_true(recon: np.ndarray, victims: Victims) -> np.ndarray:
    """Each reconstruction's nearest image among its victim's (the grids' top row, the Fréchet distance's true set)."""
    out = []
    for r, o in zip(recon, victims.row_owner, strict=True):
        own = victims.pool[victims.pool_owner == o]
        out.append(own[nearest(r[None], own)[0]])
    return np.stack(out)
