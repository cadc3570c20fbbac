"""An offline stand-in for multi-site prostate MRI: drawn 3-D volumes with a gland mask, six sites named like the
real ones (:data:`feddg.data.prostate.SITES`), each with its own acquisition.

Every case is a pelvis: a body of smoothly textured soft tissue with a bright subcutaneous fat rim, a darker
"bladder" ellipsoid above and in front of the gland, and the "gland" (the mask), an ellipsoid of random size,
position and in-plane rotation with a darker central zone. Each site then images it in its own way
(:data:`ACQUISITIONS`): field of view, gland-to-tissue contrast, a smooth multiplicative bias field, an intensity
curve (gamma), in-plane resolution (down- then up-sampling) and Rician noise. These shifts are what a model trained
on five sites has to generalise over on the sixth.

Deterministic from the seed (one numpy generator per site), small enough to build in about a second at the
defaults; :func:`load_synthetic_mri` caches its slices, and :func:`export_nifti` writes the SAML layout so that
:func:`feddg.data.prostate.load_prostate` reads the sites back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from feddg.data.cache import cache_file, cached, resolve_cache_dir
from feddg.data.digits import domain_rng
from feddg.data.prostate import MASK_SUFFIX, SITES
from feddg.data.slices import KEYS, SliceDataset, Volume, slices_from_volumes

NAME = "synthetic-mri"
VERSION = "v3"  # v2: fixed normalisation (0.5, 0.5); v3: a volume's first and last slices are not samples
DEFAULT_IMAGE_SIZE = 64


@dataclass(frozen=True)
class Acquisition:
    """How a site images a pelvis.

    Attributes:
        fov: anatomy scale in the image (above 1: a tighter field of view, a bigger gland).
        contrast: the gland's brightness above the surrounding tissue, relative to it.
        bias: strength of the smooth multiplicative bias field (``exp(bias · field)``, field in ``[-1, 1]``).
        gamma: intensity curve ``x ** gamma`` of the ``[0, 1]`` signal.
        resolution: in-plane down-sampling factor before up-sampling back (1: native).
        noise: Rician noise level, relative to the signal's maximum.
    """

    fov: float
    contrast: float
    bias: float
    gamma: float
    resolution: float
    noise: float


ACQUISITIONS = {
    "BIDMC": Acquisition(fov=1.0, contrast=0.35, bias=0.6, gamma=1.5, resolution=1.0, noise=0.03),  # endorectal coil
    "HK": Acquisition(fov=1.15, contrast=0.8, bias=0.15, gamma=0.8, resolution=2.0, noise=0.02),
    "I2CVB": Acquisition(fov=0.75, contrast=0.25, bias=0.25, gamma=1.0, resolution=1.0, noise=0.05),
    "ISBI": Acquisition(fov=1.0, contrast=0.6, bias=0.2, gamma=0.45, resolution=1.5, noise=0.04),
    "ISBI_1.5": Acquisition(fov=0.95, contrast=0.45, bias=0.35, gamma=1.0, resolution=2.5, noise=0.09),  # 1.5 T
    "UCL": Acquisition(fov=1.2, contrast=1.0, bias=0.1, gamma=2.0, resolution=1.0, noise=0.015),
}


def _linear(n_out: int, n_in: int) -> np.ndarray:
    """``[n_out, n_in]`` weights of linear interpolation between end-aligned grids (``align_corners=True``; n_in >= 2)."""
    pos = np.linspace(0.0, n_in - 1.0, n_out)
    lo = np.minimum(np.floor(pos).astype(int), n_in - 2)
    w = np.zeros((n_out, n_in))
    w[np.arange(n_out), lo] = 1.0 - (pos - lo)
    w[np.arange(n_out), lo + 1] = pos - lo
    return w


def _smooth_field(rng: np.random.Generator, coarse: tuple[int, int, int], shape: tuple[int, int, int]) -> np.ndarray:
    """Gaussian noise on a ``coarse`` grid, trilinearly interpolated to ``shape``: a smooth random field."""
    grid = rng.standard_normal(coarse)
    for axis, (n_out, n_in) in enumerate(zip(shape, coarse, strict=True)):
        grid = np.moveaxis(np.tensordot(_linear(n_out, n_in), grid, axes=(1, axis)), 0, axis)
    return grid


def _down_up(n: int, factor: float) -> np.ndarray:
    """``[n, n]``: area down-sampling by ``factor`` then linear up-sampling back, a loss of resolution."""
    low = max(2, round(n / factor))
    area = np.zeros((low, n))
    for i in range(low):
        area[i, (i * n) // low : -(-(i + 1) * n // low)] = 1.0
    area /= area.sum(axis=1, keepdims=True)
    return _linear(n, low) @ area


def _soft(r: np.ndarray, sharpness: float = 12.0) -> np.ndarray:
    """Soft inside-indicator of the normalised radius ``r`` (1 inside, 0 outside, a partial-volume edge)."""
    return 1.0 / (1.0 + np.exp(-np.clip((1.0 - r) * sharpness, -30.0, 30.0)))


def _radius(z: np.ndarray, y: np.ndarray, x: np.ndarray, centre: np.ndarray, radii: np.ndarray,
            angle: float) -> np.ndarray:
    """Normalised ellipsoid radius (1 on the surface), rotated by ``angle`` in the slice plane."""
    dy, dx = y - centre[1], x - centre[2]
    c, s = np.cos(angle), np.sin(angle)
    v, u = c * dy - s * dx, s * dy + c * dx
    return np.sqrt(((z - centre[0]) / radii[0]) ** 2 + (v / radii[1]) ** 2 + (u / radii[2]) ** 2)


def _case(rng: np.random.Generator, acq: Acquisition, depth: int, size: int) -> Volume:
    """One case: float32 intensities and its uint8 gland mask, ``[depth, size, size]``."""
    shape = (depth, size, size)
    z = np.linspace(-1.0, 1.0, depth, dtype=np.float32)[:, None, None]
    y = np.linspace(-1.0, 1.0, size, dtype=np.float32)[None, :, None] / acq.fov
    x = np.linspace(-1.0, 1.0, size, dtype=np.float32)[None, None, :] / acq.fov
    body_r = np.sqrt(((y - 0.05) / rng.uniform(0.75, 0.82)) ** 2 + (x / rng.uniform(0.9, 0.97)) ** 2)
    body = _soft(body_r, 20.0)
    fat = body * (1.0 - _soft(body_r / 0.9, 20.0))
    texture = _smooth_field(rng, (depth // 4 + 2, size // 8 + 2, size // 8 + 2), shape)
    tissue = 0.45 * np.exp(0.12 * texture / max(float(texture.std()), 1e-6))
    gland_c = np.array([rng.uniform(-0.15, 0.15), rng.uniform(0.05, 0.25), rng.uniform(-0.08, 0.08)])
    gland_radii = np.array([rng.uniform(0.45, 0.7), rng.uniform(0.22, 0.32), rng.uniform(0.28, 0.4)])
    angle = rng.uniform(-0.3, 0.3)
    gland_r = _radius(z, y, x, gland_c, gland_radii, angle)
    central = _soft(_radius(z, y, x, gland_c, gland_radii * 0.6, angle))
    bladder_c = gland_c + np.array([rng.uniform(0.45, 0.7), -rng.uniform(0.4, 0.5), rng.uniform(-0.05, 0.05)])
    bladder = _soft(_radius(z, y, x, bladder_c, np.array([0.5, 0.25, 0.35]) * rng.uniform(0.8, 1.2, 3), 0.0))
    signal = 0.02 + body * tissue
    signal = signal + fat * (0.85 - signal)
    signal = signal + bladder * (0.12 - signal)
    signal = signal * (1.0 + acq.contrast * _soft(gland_r) * (1.0 - 0.6 * central))
    bias = _smooth_field(rng, (3, 3, 3), shape)
    signal = signal * np.exp(acq.bias * bias / max(float(np.abs(bias).max()), 1e-6))
    signal = (signal / signal.max()) ** acq.gamma
    if acq.resolution > 1:
        blur = _down_up(size, acq.resolution)
        signal = blur @ signal @ blur.T
    real = signal + acq.noise * rng.standard_normal(shape)
    imaginary = acq.noise * rng.standard_normal(shape)
    volume = np.sqrt(real**2 + imaginary**2) * rng.uniform(500.0, 2000.0)  # arbitrary scanner units
    return volume.astype(np.float32), (gland_r <= 1.0).astype(np.uint8)


def synthetic_volumes(seed: int = 0, cases: int = 8, depth: int = 24, size: int = 64) -> dict[str, list[Volume]]:
    """``cases`` volumes ``[depth, size, size]`` per site (float32 intensities, uint8 gland masks)."""
    out = {}
    for site in SITES:
        rng = domain_rng(seed, NAME, site)
        out[site] = [_case(rng, ACQUISITIONS[site], depth, size) for _ in range(cases)]
    return out


def load_synthetic_mri(
    seed: int = 0, image_size: int = DEFAULT_IMAGE_SIZE, drop_empty: bool = True, cache_dir: str | os.PathLike[str] | None = None
) -> SliceDataset:
    """The default synthetic sites as 2.5-D slices at ``image_size`` px, built once into the cache folder."""
    path = cache_file(resolve_cache_dir(cache_dir), NAME, VERSION, f"seed{seed}", f"{image_size}px",
                      "fg" if drop_empty else "all")
    arrays = cached(path, KEYS, lambda: slices_from_volumes(synthetic_volumes(seed), image_size, drop_empty))
    return SliceDataset.from_arrays(NAME, arrays, list(SITES))


def export_nifti(
    out_dir: str | os.PathLike[str], seed: int = 0, cases: int = 8, depth: int = 24, size: int = 64
) -> Path:
    """Write the synthetic sites in the SAML layout (``<out>/<SITE>/CaseNN.nii.gz`` and its mask; ISBI_1.5 with the
    ``_Segmentation`` spelling), NIfTI arrays ``[W, H, depth]`` (x, y, z: what ``prostate`` reads back as the
    volumes' ``[depth, H, W]``); returns the folder."""
    import nibabel

    out = Path(out_dir).expanduser()
    affine = np.eye(4)
    for site, volumes in synthetic_volumes(seed, cases, depth, size).items():
        folder = out / site
        folder.mkdir(parents=True, exist_ok=True)
        for i, (volume, mask) in enumerate(volumes):
            nibabel.save(nibabel.Nifti1Image(np.transpose(volume, (2, 1, 0)), affine), folder / f"Case{i:02d}.nii.gz")
            nibabel.save(nibabel.Nifti1Image(np.transpose(mask, (2, 1, 0)), affine),
                         folder / f"Case{i:02d}{MASK_SUFFIX[site]}.nii.gz")
    return out
