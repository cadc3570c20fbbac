"""How faithful a reconstruction is: PSNR and SSIM against a true image (scikit-image), the
Fréchet distance in EfficientNet-Lite0 feature space, and the nearest-neighbour re-identification rate.

Images are ``[N, C, H, W]`` float arrays in ``[0, 1]`` (:func:`to_unit` maps a dataset's range there).
There are no Inception weights offline, so the Fréchet distance is computed on the pooled 1280-d features
of the offline ImageNet EfficientNet-Lite0 (``feddg.models.efficientnet``): it is **"FID (EfficientNet-Lite0
features)"**, never comparable to a published Inception FID.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from feddg.models.efficientnet import EfficientNetLite, efficientnet_lite0, imagenet_normalise

FID_NAME = "FID (EfficientNet-Lite0 features)"
#: PSNR of identical images is infinite; JSON and tables get this cap instead
PSNR_CAP = 100.0
#: the side the images are resized to before EfficientNet-Lite0 (224 is its native size; 96 keeps a CPU audit fast)
FID_SIZE = 96


def to_unit(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """``x`` from the value range ``[lo, hi]`` to ``[0, 1]`` (clipped), float64."""
    if not hi > lo:
        raise ValueError(f"need hi > lo for the image range; got [{lo}, {hi}]")
    return np.clip((np.asarray(x, np.float64) - lo) / (hi - lo), 0.0, 1.0)


def denormalise(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """Images normalised per channel (``[B, C, H, W]``, ``(x − mean) / std``) back to ``[0, 1]`` (clipped), float64."""
    shape = (1, -1, 1, 1)
    x = np.asarray(x, np.float64) * np.asarray(std, np.float64).reshape(shape) + np.asarray(mean, np.float64).reshape(shape)
    return np.clip(x, 0.0, 1.0)


def nearest(recon: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Index in ``pool`` of each reconstruction's nearest true image (mean squared error)."""
    r, p = recon.reshape(len(recon), -1), pool.reshape(len(pool), -1)
    d = (r**2).sum(1)[:, None] - 2.0 * r @ p.T + (p**2).sum(1)[None, :]
    return np.asarray(d.argmin(axis=1))


def psnr(true: np.ndarray, recon: np.ndarray) -> float:
    """PSNR in dB of one ``[C, H, W]`` pair on the range ``[0, 1]`` (``10 log10(1 / MSE)``), capped at :data:`PSNR_CAP`."""
    if np.array_equal(true, recon):
        return PSNR_CAP
    return min(PSNR_CAP, float(peak_signal_noise_ratio(true, recon, data_range=1.0)))


def ssim(true: np.ndarray, recon: np.ndarray) -> float:
    """SSIM (Wang et al. 2004, scikit-image's 7×7 window) of one ``[C, H, W]`` pair on the range ``[0, 1]``."""
    return float(structural_similarity(true, recon, channel_axis=0, data_range=1.0))


def pair_scores(true: np.ndarray, recon: np.ndarray) -> tuple[float, float]:
    """Mean PSNR and SSIM of the pairs ``(true[i], recon[i])``."""
    pairs = list(zip(true, recon, strict=True))
    return float(np.mean([psnr(t, r) for t, r in pairs])), float(np.mean([ssim(t, r) for t, r in pairs]))


def reidentification(recon: np.ndarray, victims: np.ndarray, pool: np.ndarray, owners: np.ndarray) -> float:
    """Fraction of reconstructions whose nearest image in ``pool`` (all clients' images, owner ``owners``)
    belongs to the reconstruction's victim ``victims``. Chance is the victim's share of the pool."""
    if len(recon) == 0:
        raise ValueError("no reconstructions to re-identify")
    return float(np.mean(owners[nearest(recon, pool)] == victims))


@functools.cache
def _feature_net() -> EfficientNetLite:
    return efficientnet_lite0(1000, pretrained=True).eval()


@torch.no_grad()
def effnet_features(x: np.ndarray, size: int = FID_SIZE, batch: int = 64) -> np.ndarray:
    """Pooled ``[N, 1280]`` EfficientNet-Lite0 (ImageNet) features of ``[0, 1]`` images (grey → RGB)."""
    net, out = _feature_net(), []
    for start in range(0, len(x), batch):
        t = torch.as_tensor(x[start : start + batch], dtype=torch.float32)
        t = t.expand(-1, 3, -1, -1) if t.shape[1] == 1 else t
        t = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)
        out.append(net.features(imagenet_normalise(t)).double().numpy())
    return np.concatenate(out)


def frechet_distance(f1: np.ndarray, f2: np.ndarray) -> float:
    """``‖μ₁ − μ₂‖² + Tr(Σ₁ + Σ₂ − 2 (Σ₁ Σ₂)^{1/2})`` of two feature sets (Heusel et al. 2017, eq. 6).

    With ``Σᵢ = AᵢᵀAᵢ`` (``Aᵢ`` the centred features over ``√(nᵢ − 1)``) the non-zero eigenvalues of ``Σ₁Σ₂`` are
    those of ``MMᵀ``, ``M = A₁A₂ᵀ`` (``eig(XY) = eig(YX)``), so ``Tr (Σ₁Σ₂)^{1/2}`` is the nuclear norm of ``M``:
    exact, and an ``n₁×n₂`` SVD instead of ``scipy.linalg.sqrtm`` of a ``1280×1280`` product (the tests check
    both agree)."""
    if len(f1) < 2 or len(f2) < 2:
        raise ValueError(f"the Fréchet distance needs at least 2 samples per set; got {len(f1)} and {len(f2)}")
    a1 = (f1 - f1.mean(0)) / np.sqrt(len(f1) - 1)
    a2 = (f2 - f2.mean(0)) / np.sqrt(len(f2) - 1)
    trace_root = np.linalg.svd(a1 @ a2.T, compute_uv=False).sum()
    mean_term = ((f1.mean(0) - f2.mean(0)) ** 2).sum()
    return float(max(0.0, mean_term + (a1**2).sum() + (a2**2).sum() - 2.0 * trace_root))


def fid_effnet(true: np.ndarray, recon: np.ndarray, size: int = FID_SIZE) -> float:
    """:data:`FID_NAME` between two sets of ``[0, 1]`` images."""
    return frechet_distance(effnet_features(true, size), effnet_features(recon, size))
