"""The auto-encoder of hFedF Table 6, and a client's fixed embedding from it (hFedF Appendix C.2).

Table 6 (3×32×32 input, latent size ``e``)::

    Conv 16, k3 s1 p1, ReLU -> MaxPool k2 s2 -> Conv 32, k3 s1 p1, ReLU -> MaxPool k2 s2
    -> Flatten (2048) -> Linear e                                          (encoder: the latent)
    -> Linear 2048 -> ConvTranspose 16, k2 s2, ReLU -> ConvTranspose C, k2 s2, Sigmoid  (decoder)

Other input sizes: the pools use ``ceil_mode`` and the reconstruction is cropped to the input
size (28 px: 28 -> 14 -> 7 -> 14 -> 28, exactly as the table for 32 px).

C.2: "Each client trained a shared autoencoder locally on 100 training images [...]. The final
embedding was derived by averaging the latent vectors", which is then the client's only upload.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddg.numerics import adam


class EmbeddingAutoencoder(nn.Module):
    """Table 6 for ``in_channels × image_size²`` inputs."""

    def __init__(self, in_channels: int, image_size: int, latent_dim: int) -> None:
        super().__init__()
        side = math.ceil(math.ceil(image_size / 2) / 2)  # two ceil-mode halvings
        self.side = side
        self.encoder_conv = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2, ceil_mode=True),
            nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2, ceil_mode=True),
        )
        self.to_latent = nn.Linear(32 * side * side, latent_dim)
        self.from_latent = nn.Linear(latent_dim, 32 * side * side)
        self.decoder_conv = nn.Sequential(
            nn.ConvTranspose2d(32, 16, 2, 2), nn.ReLU(), nn.ConvTranspose2d(16, in_channels, 2, 2), nn.Sigmoid(),
        )

    def encode(self, x: Tensor) -> Tensor:
        return self.to_latent(self.encoder_conv(x).flatten(1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.from_latent(self.encode(x)).view(-1, 32, self.side, self.side)
        return self.decoder_conv(h)[..., : x.shape[-2], : x.shape[-1]]


def unit_range(x: Tensor) -> Tensor:
    """Each image min-max scaled to ``[0, 1]``: the Sigmoid decoder's target ("valid pixel values";
    the datasets hand out normalised tensors, whose normalisation the method does not know)."""
    flat = x.flatten(1)
    lo, hi = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
    return ((flat - lo) / (hi - lo).clamp_min(1e-8)).view_as(x)


def train_and_embed(
    ae: EmbeddingAutoencoder, images: Tensor, *, epochs: int, lr: float, batch_size: int, generator: torch.Generator
) -> np.ndarray:
    """Train ``ae`` (MSE reconstruction, Adam) on ``images`` and return their mean latent ``[e]``."""
    target = unit_range(images)
    opt = adam(ae.parameters(), lr=lr)
    ae.train()
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), batch_size):
            b = order[start : start + batch_size]
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ae(images[b]), target[b]).backward()
            opt.step()
    ae.eval()
    with torch.no_grad():
        return ae.encode(images).mean(0).numpy().astype(np.float32)
