"""IWildCam (WILDS v2.0, Beery et al. 2021; Koh et al. 2021): camera-trap photos, 182 classes, a camera location
per image.

Layout: ``root/iwildcam_v2.0/metadata.csv`` (or ``root/metadata.csv``) and every image under ``train/`` beside it
(WILDS' 448 px high JPEGs). The columns read are WILDS' ``split``, ``location_remapped``, ``y`` and ``filename``;
``split`` holds WILDS' names or codes: train 0, val 1 (ood), test 2 (ood), id_val 3, id_test 4.

Domains, as PARDON (Table III, after Bai et al.'s framework) uses them: each **training location** is a domain
(``location_<n>``: 243 of them), so the λ partition (``partition.kind: lambda``, ``num_clients: 243``) forms the
clients from locations; the ood splits are two pooled domains, ``val`` (32 locations) and ``test`` (48), so that
``split: {protocol: ltdo, val_domain: val, target: test}`` reports WILDS' pooled figures of each as ``val_*`` and
``ood_*``. The id splits (id_val, id_test) are left out: the id figures are each client's holdout. Every image's
location is its natural group (``partition.kind: natural``: one client per training location). Class names are
WILDS' ``y`` codes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from feddg.data.base import ascii_int
from feddg.data.natural import Lines, Row, Samples, Source, read_csv, wilds_rows, wilds_split
from feddg.data.transform_spec import TransformSpec

NAME = "iwildcam"
FOLDER = "iwildcam_v2.0"
NUM_CLASSES = 182
CLASSES = [str(y) for y in range(NUM_CLASSES)]
SIZE = 448  # WILDS' resolution (its transform resizes to 448 × 448); the image cache holds one size per config
COLUMNS = ("split", "location_remapped", "y", "filename")
POOLED = ("test", "val")  # the ood splits, each one domain (test first: a LODO split's default target)
LAYOUT = (f"root/{FOLDER}/metadata.csv (columns {', '.join(COLUMNS)}) and root/{FOLDER}/train/<filename> "
          "(or those in root itself)")
# ImageNet statistics and a flip, WILDS' training transform for IWildCam besides the resize.
TRANSFORMS = TransformSpec(flip=0.5, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def _integer(column: str, value: str, high: int | None = None) -> int:
    """``value`` of ``column`` as an integer >= 0 (and < ``high``), else ``ValueError``."""
    number = ascii_int(value.strip())
    if number is None or (high is not None and number >= high):
        bound = f" in 0..{high - 1}" if high is not None else " >= 0"
        raise ValueError(f"{column} {value!r} is not an integer{bound}")
    return number


def read_rows(table: Path) -> Lines:
    """The rows of ``metadata.csv`` with their lines; one line naming it when unreadable or missing a column."""
    rows, header = read_csv(table)
    if missing := [c for c in COLUMNS if c not in header]:
        raise ValueError(f"{table}: no column {', '.join(missing)}; expected WILDS' header with {', '.join(COLUMNS)}")
    if not rows:
        raise ValueError(f"{table}: no rows")
    return rows


def _row(folder: Path, row: Row) -> tuple[str, Path, tuple[int, int]]:
    """A row's split name, image file, location and label; ``ValueError`` when one is malformed or missing."""
    split = wilds_split(row["split"] or "")
    location = _integer("location_remapped", row["location_remapped"] or "")
    label = _integer("y", row["y"] or "", NUM_CLASSES)
    file = folder / "train" / (row["filename"] or "").strip()
    if not file.is_file():
        raise ValueError(f"no image {file}")
    return split, file, (location, label)


def read_iwildcam(root: Path | None, seed: int, cache_dir: Path) -> Samples:
    """IWildCam's train, val and test splits from ``metadata.csv`` (``seed`` and ``cache_dir`` are unused: the
    images are decoded later, once, into the image cache)."""
    assert root is not None
    folder = root / FOLDER if (root / FOLDER).is_dir() else root
    table = folder / "metadata.csv"
    if not table.is_file():
        raise ValueError(f"{root}: no {FOLDER}/metadata.csv; expected {LAYOUT}")
    kept = wilds_rows(table, read_rows(table), lambda row: _row(folder, row))
    files, splits = [file for _, file, _ in kept], np.array([split for split, _, _ in kept])
    locations, labels = (np.array([r[k] for _, _, r in kept], dtype=np.int64) for k in (0, 1))
    return _samples(folder, files, labels, splits, locations)


def _samples(folder: Path, files: list[Path], labels: np.ndarray, splits: np.ndarray,
             locations: np.ndarray) -> Samples:
    """Domains ``test``, ``val`` (those present), then each training location; every location a natural group."""
    train = splits == "train"
    pooled = [name for name in POOLED if np.any(splits == name)]
    train_locations = np.unique(locations[train])
    domains = pooled + [f"location_{n}" for n in train_locations]
    domain_ids = np.empty(len(labels), dtype=np.int64)
    for d, name in enumerate(pooled):
        domain_ids[splits == name] = d
    domain_ids[train] = len(pooled) + np.searchsorted(train_locations, locations[train])
    names, groups = np.unique(locations, return_inverse=True)
    return Samples(domains, CLASSES, labels, domain_ids, SIZE, 3, groups.astype(np.int64),
                   [f"location_{n}" for n in names], files=files, root=folder,
                   ood_validation="val" if "val" in pooled else None, ood_test="test" if "test" in pooled else None)


SOURCE = Source(read_iwildcam, [], CLASSES, SIZE, TRANSFORMS, layout=LAYOUT)
