"""``writers``: a built-in FEMNIST-like dataset of synthetic writers, offline, built in about a second.

Digits of the packaged MNIST 5k (:func:`feddg.data.digits.mnist5k`) go to ``N`` writers (``data.writers``, 3,400 by default:
FEMNIST's count in FedScale; 5 to 15 digits each, drawn with replacement over writers) and redrawn in each
writer's hand: a slant (horizontal shear ``x' = x - s·y``, ``s ~ U(-0.5, 0.5)``), a stroke width (3×3 erosion
blended half-way, none, or 3×3 dilation: grey-scale morphology as max-pooling), a scale ``~ U(0.8, 1.15)`` and an
offset ``~ U(-2.5, 2.5)`` px per axis, with a little per-digit jitter (shear σ 0.05, offset σ 0.5 px). Each
writer is one domain and one natural group: ``partition.kind: natural`` gives one client per writer, and
``split.target_fraction`` holds out unseen writers. 28 px grayscale, deterministic per ``data.seed``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from feddg.data.digits import domain_rng, mnist5k
from feddg.data.natural import Samples, Source
from feddg.data.transform_spec import TransformSpec

NAME = "writers"
WRITERS = 3400
SIZE = 28
CLASSES = [str(d) for d in range(10)]
PER_WRITER = (5, 15)  # digits a writer has, inclusive
SLANT, SCALE, OFFSET = 0.5, (0.8, 1.15), 2.5
SLANT_JITTER, OFFSET_JITTER = 0.05, 0.5


def writer_names(count: int) -> list[str]:
    return [f"w{i:04d}" for i in range(count)]


def writer_styles(seed: int, count: int = WRITERS) -> dict[str, np.ndarray]:
    """Each writer's ``slant``, ``stroke`` (-1 thin, 0, +1 bold), ``scale``, ``offset`` ``[count, 2]`` (px, x y)
    and ``digits`` (how many it wrote)."""
    rng = domain_rng(seed, NAME, "styles")
    return {"slant": rng.uniform(-SLANT, SLANT, count), "stroke": rng.integers(-1, 2, count),
            "scale": rng.uniform(*SCALE, count), "offset": rng.uniform(-OFFSET, OFFSET, (count, 2)),
            "digits": rng.integers(PER_WRITER[0], PER_WRITER[1] + 1, count)}


def _stroke(x: torch.Tensor, stroke: torch.Tensor) -> torch.Tensor:
    """Per image, dilation (+1), nothing (0) or erosion blended half-way (-1), 3×3, of ``[n, 1, H, W]`` ink."""
    bold = F.max_pool2d(x, 3, stride=1, padding=1)
    thin = (x - F.max_pool2d(-x, 3, stride=1, padding=1)) / 2  # (x + erosion) / 2
    s = stroke.view(-1, 1, 1, 1)
    return torch.where(s > 0, bold, torch.where(s < 0, thin, x))


def draw(digits: np.ndarray, slant: np.ndarray, scale: np.ndarray, offset: np.ndarray,
         stroke: np.ndarray) -> np.ndarray:
    """uint8 ``[n, 1, 28, 28]``: each 28×28 digit sheared by ``slant``, scaled about the centre, shifted by
    ``offset`` px and stroked (bilinear resampling; ``affine_grid`` maps output to input coordinates)."""
    x = torch.from_numpy(digits).float().unsqueeze(1) / 255
    s, k = torch.from_numpy(slant).float(), torch.from_numpy(scale).float()
    t = torch.from_numpy(offset).float() * (2 / SIZE)  # px -> the grid's [-1, 1] units
    theta = torch.zeros(len(x), 2, 3)
    theta[:, 0, 0] = theta[:, 1, 1] = 1 / k  # inverse of p' = k·shear(p) + t
    theta[:, 0, 1] = s / k
    theta[:, 0, 2] = -(t[:, 0] + s * t[:, 1]) / k
    theta[:, 1, 2] = -t[:, 1] / k
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = _stroke(F.grid_sample(x, grid, mode="bilinear", align_corners=False), torch.from_numpy(stroke))
    return (out * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def build_writers(seed: int, count: int = WRITERS) -> Samples:
    """``count`` writers' digits: domains and groups are the writers."""
    if count < 1:
        raise ValueError(f"writers: count must be >= 1, got {count}")
    images, labels = mnist5k()
    style = writer_styles(seed, count)
    writer = np.repeat(np.arange(count), style["digits"])
    rng = domain_rng(seed, NAME, "digits")
    pick = rng.integers(0, len(labels), len(writer))
    slant = style["slant"][writer] + rng.normal(0, SLANT_JITTER, len(writer))
    offset = style["offset"][writer] + rng.normal(0, OFFSET_JITTER, (len(writer), 2))
    x = draw(images[pick], slant, style["scale"][writer], offset, style["stroke"][writer])
    names = writer_names(count)
    return Samples(names, CLASSES, labels[pick].astype(np.int64), writer, SIZE, 1, writer, names, x)


SOURCE = Source(lambda root, seed, cache_dir: build_writers(seed), [], CLASSES, SIZE,
                TransformSpec(mean=(0.5,), std=(0.5,)), needs_root=False)
