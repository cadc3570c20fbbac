"""What each method shares, recomputed from a rebuilt federation: per-sample vectors of a batch of images
(the attacker's training pairs) and a client's released rows (what the victim sends).

* ``sample-style`` — CCST's single image styles: each image's ``[μ ‖ σ]`` of ``E(x)`` (the run's style path);
* ``client-style`` — PARDON's client style: the mean over the client's FINCH clusters' styles (eq. 1–2);
* ``fedfa-moments`` — FedFA's feature statistics: the client's channel ``[μ ‖ σ]`` at the end of conv stage 1
  of the trained model (recomputed over the client's images, not the run's momentum averages);
* ``fpl-prototypes`` — FPL's class prototypes: the mean ``features(x)`` of the trained model per class held (under
  ``dp`` all ``K`` rows, an absent class's zero plus noise, as ``fpl.py`` sends them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from feddg.algorithms.components.style import (
    StyleCodec,
    StyleParams,
    channel_moments,
    make_codec,
    pooled_style,
    std_from_moments,
    style_vectors,
)
from feddg.algorithms.pardon import PardonParams, client_style, local_labels
from feddg.models.base import FedModel

#: per-sample vectors of a batch, and a client's released rows from its images and labels
Share = tuple[Callable[[Tensor], np.ndarray], Callable[[Tensor, np.ndarray], np.ndarray]]


def _moments(codec: StyleCodec, x: Tensor) -> tuple[Tensor, Tensor]:
    with torch.no_grad():
        return codec.moments(x)


def style_share(codec: StyleCodec, level: Literal["sample", "client"], pardon: PardonParams | None = None) -> Share:
    """Per-image styles; the released rows per image (``sample``) or PARDON's one client style (``client``: eqs. 1–2
    with the run's ``pardon`` parameters, ``local_style``, ``cluster_on`` and ``client_average``; default: PARDON's)."""
    client = pardon if pardon is not None else PardonParams()

    def per_sample(x: Tensor) -> np.ndarray:
        m, s = _moments(codec, x)
        return style_vectors(m.numpy(), std_from_moments(m, s).numpy())

    def release(x: Tensor, y: np.ndarray) -> np.ndarray:
        if level == "sample":
            return per_sample(x)
        m, s = _moments(codec, x)

        def features() -> Tensor:
            with torch.no_grad():
                return codec.encode(x).flatten(1)

        mu, sigma = client_style(m, s, local_labels(client, m, s, features), client.client_average)
        return style_vectors(mu.numpy(), sigma.numpy())[None]

    return per_sample, release


def moments_share(encoder: Callable[[Tensor], Tensor]) -> Share:
    """FedFA: per-image channel ``[μ ‖ σ]`` of ``encoder(x)``; released: the client's pooled ones (one row)."""

    def moments(x: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            return channel_moments(encoder(x))

    def per_sample(x: Tensor) -> np.ndarray:
        m, s = moments(x)
        return style_vectors(m.numpy(), std_from_moments(m, s).numpy())

    def release(x: Tensor, y: np.ndarray) -> np.ndarray:
        mu, sigma = pooled_style(*moments(x))
        return style_vectors(mu.numpy(), sigma.numpy())[None]

    return per_sample, release


def prototype_share(model: FedModel, num_classes: int) -> Share:
    """FPL: per-image ``features(x)``; released: the client's ``[num_classes, D]`` class means, zero rows for the
    classes it does not hold (without DP only the held rows are sent; under ``dp`` every row, noised)."""

    def per_sample(x: Tensor) -> np.ndarray:
        with torch.no_grad():
            return model.features(x).double().numpy()

    def release(x: Tensor, y: np.ndarray) -> np.ndarray:
        f = per_sample(x)
        return np.stack([f[y == c].mean(0) if (y == c).any() else np.zeros(f.shape[1]) for c in range(num_classes)])

    return per_sample, release


def stage_encoder(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """The trained model up to the end of its first conv stage (FedFA's first FFA layer)."""
    codec = make_codec(StyleParams(style_path="feature", style_stage=1), model)
    return codec.encode
