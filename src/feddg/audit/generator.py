"""The attacker's decoder from a shared vector to an image (PARDON §IV-B3: "a generator trained to
reconstruct images from style vectors").

A small conv generator: the vector, standardised by the attacker's own statistics, goes through a linear
layer to a ``[32, ⌈H/4⌉, ⌈W/4⌉]`` map, two stride-2 transposed convolutions and a sigmoid, resized to ``H×W``.
It is trained with MSE on the attacker's own ``(image, vector)`` pairs; the inversion applies it to the
victims' shared vectors. Images are in ``[0, 1]``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddg.numerics import adam


class VectorGenerator(nn.Module):
    """``g(v)``: a ``dim``-vector to a ``[channels, height, width]`` image in ``[0, 1]``."""

    def __init__(self, dim: int, channels: int, height: int, width: int, width_mult: int = 32) -> None:
        super().__init__()
        self.shape = (channels, height, width)
        self.h0, self.w0, self.c0 = math.ceil(height / 4), math.ceil(width / 4), width_mult
        self.v_mean: Tensor
        self.v_std: Tensor
        self.register_buffer("v_mean", torch.zeros(dim))  # the attacker's standardisation of the vectors
        self.register_buffer("v_std", torch.ones(dim))
        self.fc = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, self.c0 * self.h0 * self.w0), nn.ReLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(self.c0, 16, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(16, channels, 4, 2, 1))

    def forward(self, v: Tensor) -> Tensor:
        z = (v - self.v_mean) / self.v_std
        x = self.up(self.fc(z).view(-1, self.c0, self.h0, self.w0))
        return torch.sigmoid(F.interpolate(x, size=self.shape[1:], mode="bilinear", align_corners=False))


def train_generator(
    images: np.ndarray, vectors: np.ndarray, *, steps: int = 300, batch: int = 32, lr: float = 2e-3, seed: int = 0
) -> VectorGenerator:
    """A :class:`VectorGenerator` fitted by Adam on MSE to the pairs ``(vectors[i], images[i])``."""
    if len(images) != len(vectors) or len(images) == 0:
        raise ValueError(f"need as many vectors as images (> 0); got {len(vectors)} and {len(images)}")
    torch.manual_seed(seed)
    x = torch.as_tensor(images, dtype=torch.float32)
    v = torch.as_tensor(vectors, dtype=torch.float32).reshape(len(vectors), -1)
    gen = VectorGenerator(v.shape[1], *x.shape[1:])
    gen.v_mean.copy_(v.mean(0))
    gen.v_std.copy_(v.std(0, unbiased=False).clamp_min(1e-6) if len(v) > 1 else torch.ones(v.shape[1]))
    opt = adam(gen.parameters(), lr=lr)
    rng = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randint(len(x), (min(batch, len(x)),), generator=rng)
        loss = F.mse_loss(gen(v[pick]), x[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return gen.eval()


@torch.no_grad()
def invert(gen: VectorGenerator, vectors: np.ndarray) -> np.ndarray:
    """The generator's images of the victims' shared ``vectors``: ``[N, C, H, W]`` in ``[0, 1]``."""
    v = torch.as_tensor(vectors, dtype=torch.float32).reshape(len(vectors), -1)
    return gen(v).double().numpy()
