"""Vector inversion: train the attacker's generator on its own ``(image, vector)`` pairs and apply it to
the vectors the victims shared — styles (PARDON Table IV), FedFA's feature moments, FPL's prototypes.

PARDON §IV-B3's two attackers differ only in whose data trains the generator: (i) a third party (or the
server) with held-out public data, (ii) a malicious client with its own data. Each victim's shared
statistic is released under client-level DP exactly as the methods do it (``aggregation/dp.py:
privatize``: all its rows clipped as one vector to ``C``, ``N(0, (z·2C)²)`` per entry), at every noise
multiplier ``z`` of the sweep, from one noise stream scaled by ``z`` (so the sweep is monotone in noise
by construction of the draw, not by luck of the seed); ε is the accountant's for ``releases`` releases.
CCST and PARDON send their σ clamped at 0 after the noise (``sigma_from``: the columns they clamp).

A reconstruction with a known source image (a sample-level share: one row per image) is scored against that image;
one that stands for many images (a client style, a class prototype) against the nearest of its victim's images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feddg.aggregation.accounting import gaussian_epsilon
from feddg.aggregation.dp import privatize
from feddg.audit.generator import invert, train_generator
from feddg.audit.metrics import FID_NAME, effnet_features, frechet_distance, nearest, pair_scores, reidentification


@dataclass
class Victims:
    """What the victims hold and share: per shared row its owner (and, for a sample-level share, its source
    image); the true images with owners (the re-identification pool: every client's images)."""

    vectors: np.ndarray  # [R, d] shared rows
    row_owner: np.ndarray  # [R] client id of each row
    pool: np.ndarray  # [N, C, H, W] in [0, 1]: every client's images
    pool_owner: np.ndarray  # [N]
    source: np.ndarray | None = None  # [R] pool index of each row's own image; None: a row stands for many
    present: np.ndarray | None = None  # [R] bool: the rows sent without DP (FPL: the classes held); None: all

    def released(self, z: float) -> np.ndarray:
        """The rows released at noise multiplier ``z`` (bool mask): every row under DP, else the present ones."""
        return np.ones(len(self.vectors), bool) if z > 0 or self.present is None else self.present

    def rows(self, keep: np.ndarray) -> Victims:
        """The victims of the rows ``keep`` (a bool mask)."""
        return Victims(self.vectors[keep], self.row_owner[keep], self.pool, self.pool_owner,
                       None if self.source is None else self.source[keep], None)


def noised(vectors: np.ndarray, owners: np.ndarray, z: float, clip: float, seed: int,
           sigma_from: int | None = None) -> np.ndarray:
    """Each owner's rows released as one statistic: clipped to ``clip`` and noised with ``σ = z·2C``, then the
    columns from ``sigma_from`` on (a style's σ half) clamped at 0 (the identity at ``z = 0``: no DP, no clipping)."""
    if z == 0:
        return vectors
    gen = torch.Generator().manual_seed(seed)  # the same draws at every z: only their scale σ changes
    out = np.empty_like(vectors, dtype=np.float32)
    for o in np.unique(owners):
        rows = owners == o
        out[rows] = privatize({"v": vectors[rows]}, clip, z * 2.0 * clip, gen)["v"]
    if sigma_from is not None:
        out[:, sigma_from:] = np.maximum(out[:, sigma_from:], 0.0)
    return out


def scores(recon: np.ndarray, victims: Victims, decoys: np.ndarray, *, fid: bool = True) -> dict[str, Any]:
    """PSNR / SSIM of each reconstruction against its own image (``victims.source``) or, without one, the nearest
    image of its victim; their chance level: the same scores of ``decoys`` (one per row: images the attacker already
    has); the Fréchet distance between the reconstructions and the victims' true images (their images used as
    victims); the re-identification rate (with its chance level)."""
    p, s = pair_scores(reference(recon, victims), recon)
    pc, sc = pair_scores(reference(decoys, victims), decoys)
    chance = float(np.mean([np.mean(victims.pool_owner == o) for o in victims.row_owner]))
    out: dict[str, Any] = {"psnr": p, "ssim": s, "psnr_chance": pc, "ssim_chance": sc,
                           "scored_against": "nearest of victim's" if victims.source is None else "own image",
                           "reid": reidentification(recon, victims.row_owner, victims.pool, victims.pool_owner),
                           "reid_chance": chance, "n": len(recon)}
    true = (victims.pool[np.isin(victims.pool_owner, victims.row_owner)] if victims.source is None
            else victims.pool[victims.source])
    out[FID_NAME] = frechet_distance(effnet_features(true), effnet_features(recon)) if fid and len(recon) >= 2 else None
    return out


def vector_inversion(
    attacker_images: np.ndarray, attacker_vectors: np.ndarray, victims: Victims, *,
    noise_multipliers: tuple[float, ...] = (0.0,), clip: float | None = None, delta: float = 1e-5,
    releases: int = 1, steps: int = 300, seed: int = 0, fid: bool = True, sigma_from: int | None = None,
) -> tuple[list[dict[str, Any]], dict[float, np.ndarray]]:
    """One attack at every noise multiplier: a row of metrics each (with ε; ``None`` without DP) and the
    reconstructions by multiplier (of the rows released at it: :meth:`Victims.released`). ``clip`` defaults to the
    median norm of a victim's whole statistic; the chance level scores a random draw of the attacker's images."""
    gen = train_generator(attacker_images, attacker_vectors, steps=steps, seed=seed)
    if clip is None:
        clip = float(np.median([np.linalg.norm(victims.vectors[victims.row_owner == o])
                                for o in np.unique(victims.row_owner)]))
    n = len(victims.vectors)
    decoys = attacker_images[np.random.default_rng(seed).choice(len(attacker_images), n, replace=len(attacker_images) < n)]
    rows, recons = [], {}
    for z in noise_multipliers:
        keep = victims.released(z)
        sent = victims.rows(keep)
        recon = invert(gen, noised(sent.vectors, sent.row_owner, z, clip, seed, sigma_from))
        eps = gaussian_epsilon(z, releases, delta) if z > 0 else None
        rows.append({"noise_multiplier": z, "epsilon": eps, "delta": delta, "clip": clip,
                     **scores(recon, sent, decoys[keep], fid=fid)})
        recons[z] = recon
    return rows, recons


def reference(recon: np.ndarray, victims: Victims) -> np.ndarray:
    """The true image each reconstruction is scored against: its own (``victims.source``), else the nearest among its
    victim's images (also the grids' top row)."""
    if victims.source is not None:
        return victims.pool[victims.source]
    out = []
    for r, o in zip(recon, victims.row_owner, strict=True):
        own = victims.pool[victims.pool_owner == o]
        out.append(own[nearest(r[None], own)[0]])
    return np.stack(out)
