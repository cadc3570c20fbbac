"""Write a built-in dataset to DomainBed's folder layout: ``out/<domain>/<class>/<index>.png`` (lossless).

``index`` is the sample's position in the built-in dataset, zero-padded, so the folder loader's
sorted order within a class is the built-in order. ``out/feddg.json`` records the source and its
defaults (``image_size`` and normalisation statistics, no augmentation), so reading the folder
back gives the built-in batches pixel for pixel. The synthetic MRI sites are written as NIfTI volumes in the
prostate layout instead (:func:`export_volumes`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from PIL import Image

from feddg.data import synthetic_mri
from feddg.data.folders import CARD
from feddg.data.image_cache import progress_bar
from feddg.data.registry import BUILTINS, load_dataset
from feddg.data.synthetic_mri import export_nifti
from feddg.data.tensor_dataset import TensorDomainDataset


def _new_folder(out: str | os.PathLike[str]) -> Path:
    root = Path(out).expanduser()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"export folder {root} exists and is not empty")
    return root


def export_volumes(out: str | os.PathLike[str], *, seed: int = 0, image_size: int | None = None) -> int:
    """Write the synthetic MRI sites into the new or empty folder ``out`` in the prostate layout (volumes of
    ``image_size`` px, default 64); returns the number of volumes."""
    root = _new_folder(out)
    export_nifti(root, seed=seed, size=image_size or synthetic_mri.DEFAULT_IMAGE_SIZE)
    return sum(1 for _ in root.glob("*/Case??.nii.gz"))


def export_dataset(
    name: str,
    out: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    image_size: int | None = None,
    seed: int = 0,
    max_per_domain: int | None = None,
) -> int:
    """Export built-in dataset ``name`` into the new or empty folder ``out``; returns the number of images."""
    if name not in BUILTINS:
        raise ValueError(f"only built-in datasets can be exported: {', '.join(BUILTINS)} as images, "
                         f"{synthetic_mri.NAME} as volumes; got {name!r}")
    root = _new_folder(out)
    ds = load_dataset(name, cache_dir=cache_dir, image_size=image_size, seed=seed, max_per_domain=max_per_domain)
    assert isinstance(ds, TensorDomainDataset)
    images = ds.images.numpy()
    width = len(str(len(ds) - 1))
    with progress_bar() as bar:
        task = bar.add_task(f"exporting {name} to {root}", total=len(ds))
        for i in range(len(ds)):
            folder = root / ds.domains[ds.domain_ids[i]] / ds.classes[ds.labels[i]]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = images[i].transpose(1, 2, 0)  # [H, W, C]; one channel is saved as a grey PNG
            Image.fromarray(np.ascontiguousarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels)).save(
                folder / f"{i:0{width}d}.png")
            bar.advance(task)
    b = BUILTINS[name]
    channels = 3  # the folder loader reads RGB; a grey dataset's statistics are repeated per channel
    mean, std = (list(b.mean) * channels)[:channels], (list(b.std) * channels)[:channels]
    card = {"source": f"feddg export {name} (seed {seed})", "image_size": ds.image_shape[1],
            "transforms": {"preset": "none", "mean": mean, "std": std}}
    (root / CARD).write_text(json.dumps(card, indent=2) + "\n")
    return len(ds)
