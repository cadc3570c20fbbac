"""Image datasets on disk in DomainBed's layout ``root/<domain>/<class>/<image>``.

Presets fix the domain (and, where known, class) names of PACS, Office-Home, VLCS,
TerraIncognita, DomainNet and Office-Caltech10, and check the folder against them; ``folder``
takes whatever domains and classes the tree holds. :func:`scan_tree` finds every layout problem
(stray images, unknown or misspelled class folders, class folders missing from some domain, empty
classes and domains) without decoding anything; loading stops at the first one, in one line.

An optional ``root/feddg.json`` (written by ``feddg export``) gives the folder's defaults:
``{"image_size": 28, "transforms": "digits"}``.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from feddg.data.augment import BatchAugment
from feddg.data.base import first_problem
from feddg.data.image_cache import rgb8
from feddg.data.tensor_dataset import TensorDomainDataset
from feddg.data.transform_spec import TransformSpec, check_channels

LAYOUT = "expected layout root/<domain>/<class>/<image>"
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"})
DEFAULT_IMAGE_SIZE = 224
CARD = "feddg.json"
CARD_KEYS = ("image_size", "transforms", "source")

OFFICE_HOME_CLASSES = (
    "Alarm_Clock", "Backpack", "Batteries", "Bed", "Bike", "Bottle", "Bucket", "Calculator", "Calendar",
    "Candles", "Chair", "Clipboards", "Computer", "Couch", "Curtains", "Desk_Lamp", "Drill", "Eraser",
    "Exit_Sign", "Fan", "File_Cabinet", "Flipflops", "Flowers", "Folder", "Fork", "Glasses", "Hammer",
    "Helmet", "Kettle", "Keyboard", "Knives", "Lamp_Shade", "Laptop", "Marker", "Monitor", "Mop", "Mouse",
    "Mug", "Notebook", "Oven", "Pan", "Paper_Clip", "Pen", "Pencil", "Postit_Notes", "Printer", "Push_Pin",
    "Radio", "Refrigerator", "Ruler", "Scissors", "Screwdriver", "Shelf", "Sink", "Sneakers", "Soda",
    "Speaker", "Spoon", "TV", "Table", "Telephone", "ToothBrush", "Toys", "Trash_Can", "Webcam"
)


@dataclass(frozen=True)
class FolderPreset:
    """Known domain and class folder names of a dataset; empty means discovered from the tree."""

    domains: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    num_classes: int | None = None


PRESETS: dict[str, FolderPreset] = {
    "pacs": FolderPreset(
        ("art_painting", "cartoon", "photo", "sketch"),
        ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"),
    ),
    "office-home": FolderPreset(("Art", "Clipart", "Product", "Real_World"), tuple(OFFICE_HOME_CLASSES)),
    "vlcs": FolderPreset(("Caltech101", "LabelMe", "SUN09", "VOC2007"), ("bird", "car", "chair", "dog", "person")),
    "terra-incognita": FolderPreset(
        ("location_100", "location_38", "location_43", "location_46"),
        ("bird", "bobcat", "cat", "coyote", "dog", "empty", "opossum", "rabbit", "raccoon", "squirrel"),
    ),
    "domainnet": FolderPreset(("clipart", "infograph", "painting", "quickdraw", "real", "sketch"), (), 345),
    "office-caltech10": FolderPreset(
        ("amazon", "caltech", "dslr", "webcam"),
        ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor", "mouse",
         "mug", "projector"),
    ),
    "folder": FolderPreset(),
}


def _names(names: list[str] | tuple[str, ...], limit: int = 8) -> str:
    """``a, b, c`` — or the first ``limit`` names and how many there are in all."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


def _is_image(path: Path) -> bool:
    return path.is_file() and not path.name.startswith(".") and path.suffix.lower() in IMAGE_EXTENSIONS


def _images_under(folder: Path) -> tuple[list[Path], list[str]]:
    """The images anywhere under ``folder``, sorted, through symlinked sub-folders too (each real folder once), and
    the problems: an image name whose link leads nowhere. Hidden files and whatever lies in a hidden folder
    (``.ipynb_checkpoints/``) are left out."""
    images, problems, seen = [], [], set()
    for top, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:  # a link back up the tree, or two links to one folder
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = Path(top) / name
            if name.startswith(".") or path.suffix.lower() not in IMAGE_EXTENSIONS:
                continue
            if path.is_file():
                images.append(path)
            else:
                problems.append(f"image {path} is a link to nothing ({os.readlink(path)})")
    return sorted(images), problems


def _subfolders(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


def _close(name: str, candidates: list[str]) -> str | None:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def check_root(root: str | Path) -> Path:
    """``root`` as a path, if it is an existing folder."""
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"dataset root {path} does not exist or is not a folder; {LAYOUT}")
    return path


def discover_domains(root: Path) -> list[str]:
    """The domain folders under ``root`` (sorted)."""
    domains = _subfolders(root)
    if not domains:
        raise ValueError(f"no domain folders in {root}; {LAYOUT}")
    return domains


def discover_classes(root: Path, domains: list[str]) -> list[str]:
    """Sorted union of the class folders of those ``domains`` that exist under ``root``."""
    return sorted({c for d in domains if (root / d).is_dir() for c in _subfolders(root / d)})


@dataclass
class FolderScan:
    """The image files of some domains of a tree, and every layout problem found on the way."""

    files: list[Path] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    domain_ids: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: a preset's classes that no scanned domain has a folder for (a partial copy, or a broken one)
    absent: list[str] = field(default_factory=list)

    def absent_line(self, name: str, root: Path) -> str:
        return (f"{name}: class(es) {_names(self.absent)} of the preset have no folder in any domain under {root}: "
                f"the model keeps their outputs, no sample trains or tests them")

    def error(self, name: str, root: Path) -> str:
        """One line: the first problem, and how to list the others."""
        return first_problem([f"{self.problems[0]}; {LAYOUT}", *self.problems[1:]], name, root)


def _missing_classes(root: Path, domains: list[str], folders: dict[str, list[str]]) -> list[str]:
    """Problems for class folders that some of ``domains`` have and others lack (or that look misspelled)."""
    where = {c: [d for d in domains if c in folders[d]] for c in sorted({c for d in domains for c in folders[d]})}
    problems = []
    for c, have in where.items():
        if len(have) == len(domains):
            continue
        guess = _close(c, [m for m in where if len(where[m]) > len(have)])
        if guess:
            paths = ", ".join(str(root / d / c) for d in have)
            problems.append(f"class folder {paths} (only in {_names(have)}) looks like a misspelling of {guess}/")
            continue
        problems += [f"class folder {root / d / c} is missing (domains {_names(have)} have {c}/)"
                     for d in domains if d not in have]
    return problems


def _domain_problems(folder: Path, classes: list[str], fixed: bool) -> list[str]:
    problems = []
    stray = sorted(p for p in folder.iterdir() if _is_image(p))
    if stray:
        problems.append(f"image {stray[0]} lies directly in domain folder {folder} ({len(stray)} such images)")
    if fixed:
        for name in _subfolders(folder):
            if name not in classes:
                guess = _close(name, classes)
                hint = f"did you mean {guess}? " if guess else ""
                problems.append(f"unknown class folder {folder / name} ({hint}classes: {_names(classes)})")
    return problems


def scan_tree(root: Path, domains: list[str], classes: list[str], fixed: bool = True) -> FolderScan:
    """Images of ``domains`` labelled by ``classes``; ``fixed``: the class names are a preset's."""
    missing = [root / d for d in domains if not (root / d).is_dir()]
    if missing:
        raise FileNotFoundError(f"domain folder {missing[0]} is missing (domains: {_names(domains)}); {LAYOUT}")
    scan = FolderScan()
    folders = {d: _subfolders(root / d) for d in domains}
    known = {d: [c for c in folders[d] if c in classes] for d in domains}
    for d, name in enumerate(domains):
        scan.problems += _domain_problems(root / name, classes, fixed)
        count = 0
        for c in known[name]:
            images, broken = _images_under(root / name / c)
            scan.problems += broken
            if not images:
                scan.problems.append(f"class folder {root / name / c} has no images")
            scan.files += images
            scan.labels += [classes.index(c)] * len(images)
            scan.domain_ids += [d] * len(images)
            count += len(images)
        if not count:
            scan.problems.append(f"domain folder {root / name} has no images")
    scan.problems += _missing_classes(root, domains, known)
    if fixed:
        scan.absent = [c for c in classes if not any(c in known[d] for d in domains)]
    return scan


def read_card(root: Path) -> dict[str, Any]:
    """``root/feddg.json`` (the folder's default ``image_size`` and ``transforms``), or ``{}``."""
    path = root / CARD
    if not path.is_file():
        return {}
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({' '.join(str(err).split())})") from None
    if not isinstance(card, dict) or any(k not in CARD_KEYS for k in card):
        raise ValueError(f"{path}: expected an object with keys among {', '.join(CARD_KEYS)}")
    size = card.get("image_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"{path}: image_size must be an integer >= 1, got {size!r}")
    return card


def load_image(path: Path) -> Tensor:
    """RGB float ``[3, H, W]`` in ``[0, 1]``; a one-line error naming the file if it cannot be decoded."""
    try:
        with Image.open(path) as im:
            pixels = rgb8(im)
    except (OSError, ValueError, SyntaxError) as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"cannot read image {path}: {reason}; {LAYOUT}") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div_(255.0)


class FolderDomainDataset(TensorDomainDataset):
    """A folder tree's images, decoded once into a memory-mapped uint8 cache (see :mod:`feddg.data.image_cache`).

    Args:
        name: registry name.
        files: one image path per sample (the cache's order).
        images: uint8 ``[N, S, S, 3]`` (a memory map of the cache), seen as channels-last ``[N, 3, S, S]``.
        labels: int64 ``[N]`` indices into ``classes``.
        domain_ids: int64 ``[N]`` indices into ``domains``.
        domains: domain names.
        classes: class names.
        spec: training augmentation and normalisation statistics.
    """

    def __init__(
        self,
        name: str,
        files: list[Path],
        images: np.ndarray,
        labels: np.ndarray,
        domain_ids: np.ndarray,
        domains: list[str],
        classes: list[str],
        spec: TransformSpec,
    ) -> None:
        if len(files) != len(images):
            raise ValueError(f"{len(files)} files but {len(images)} images")
        mean, std = check_channels(spec, int(images.shape[3]), name)
        augment = BatchAugment(spec) if spec.augments else None
        pixels = torch.from_numpy(images).permute(0, 3, 1, 2)
        super().__init__(name, pixels, labels, domain_ids, domains, classes, mean, std, augment)
        self.files = list(files)
        self.spec = spec
