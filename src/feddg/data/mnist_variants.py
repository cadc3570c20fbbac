"""DomainBed's Rotated MNIST and Colored MNIST, built from the packaged MNIST 5k.

* ``rotated-mnist``: the shuffled digits are dealt into six disjoint parts; part ``k`` is
  rotated counter-clockwise by ``15·k`` degrees (domains ``"0"`` .. ``"75"``). 1×28×28.
* ``colored-mnist``: the shuffled digits are dealt into three environments; the label is
  ``digit >= 5`` flipped with probability 0.25, the colour is the label flipped with
  probability ``e`` (0.1, 0.2, 0.9 for ``"+90%"``, ``"+80%"``, ``"-90%"``), and the digit is
  drawn in the red (colour 0) or green (colour 1) channel of a 3×28×28 image.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from feddg.data.digits import Builder, Images, domain_rng, mnist5k

ROTATED = "rotated-mnist"
ANGLES = (0, 15, 30, 45, 60, 75)
ROTATED_CLASSES = [str(d) for d in range(10)]

COLORED = "colored-mnist"
COLOR_FLIP = {"+90%": 0.1, "+80%": 0.2, "-90%": 0.9}
COLORED_DOMAINS = list(COLOR_FLIP)
COLORED_CLASSES = ["0-4", "5-9"]
LABEL_FLIP = 0.25

MEAN_1, STD_1 = (0.5,), (0.5,)
MEAN_3, STD_3 = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
VERSION = "v1"


def deal(dataset: str, seed: int, parts: int) -> list[np.ndarray]:
    """Shuffle the MNIST 5k indices and deal them into ``parts`` disjoint sets (``perm[k::parts]``)."""
    perm = domain_rng(seed, dataset, "shuffle").permutation(len(mnist5k()[1]))
    return [perm[k::parts] for k in range(parts)]


def rotate(images: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate uint8 ``[N, C, H, W]`` counter-clockwise about the centre (bilinear, zero fill)."""
    t = math.radians(degrees)
    theta = torch.tensor([[math.cos(t), -math.sin(t), 0.0], [math.sin(t), math.cos(t), 0.0]])
    x = torch.tensor(images, dtype=torch.float32)
    grid = F.affine_grid(theta.expand(len(x), 2, 3), list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8).numpy()


def build_rotated(angle: int, seed: int) -> Images:
    """The part of the shuffled digits that belongs to ``angle``, rotated by it."""
    idx = deal(ROTATED, seed, len(ANGLES))[ANGLES.index(angle)]
    images, labels = mnist5k()
    return rotate(images[idx][:, None], angle), labels[idx]


def build_colored(env: str, seed: int) -> Images:
    """One Colored MNIST environment: noisy binary labels, colour correlated with them by ``1 - e``."""
    idx = deal(COLORED, seed, len(COLOR_FLIP))[COLORED_DOMAINS.index(env)]
    rng = domain_rng(seed, COLORED, env)
    images, digits = mnist5k()
    n = len(idx)
    labels = (digits[idx] >= 5).astype(np.int64) ^ (rng.random(n) < LABEL_FLIP)
    colours = labels ^ (rng.random(n) < COLOR_FLIP[env])
    out = np.zeros((n, 3, 28, 28), dtype=np.uint8)
    out[np.arange(n), colours] = images[idx]
    return out, labels


ROTATED_BUILDERS: dict[str, Builder] = {str(a): functools.partial(build_rotated, a) for a in ANGLES}
COLORED_BUILDERS: dict[str, Builder] = {e: functools.partial(build_colored, e) for e in COLOR_FLIP}
