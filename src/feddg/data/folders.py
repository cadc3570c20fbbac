"""Image datasets on disk in DomainBed's layout ``root/<domain>/<class>/<image>``.

Presets fix the domain (and, where known, class) names of PACS, Office-Home, VLCS,
TerraIncognita, DomainNet and Office-Caltech10, and check the folder against them; ``folder``
takes whatever domains and classes the tree holds. Every layout problem is reported in one
line that names the offending path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from feddg.data.base import DomainDataset
from feddg.data.transforms import eval_transform, train_transform

LAYOUT = "expected layout root/<domain>/<class>/<image>"
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"})
DEFAULT_IMAGE_SIZE = 224

OFFICE_HOME_CLASSES = (
    "Alarm_Clock Backpack Batteries Bed Bike Bottle Bucket Calculator Calendar Candles Chair Clipboards "
    "Computer Couch Curtains Desk_Lamp Drill Eraser Exit_Sign Fan File_Cabinet Flipflops Flowers Folder "
    "Fork Glasses Hammer Helmet Kettle Keyboard Knives Lamp_Shade Laptop Marker Monitor Mop Mouse Mug "
    "Notebook Oven Pan Paper_Clip Pen Pencil Postit_Notes Printer Push_Pin Radio Refrigerator Ruler "
    "Scissors Screwdriver Shelf Sink Sneakers Soda Speaker Spoon TV Table Telephone ToothBrush Toys "
    "Trash_Can Webcam"
).split()


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


def _subfolders(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


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


def _domain_files(folder: Path, classes: list[str]) -> tuple[list[Path], list[int]]:
    """Image paths under ``folder/<class>/`` (sorted) and their class indices; checks the layout."""
    stray = sorted(p for p in folder.iterdir() if _is_image(p))
    if stray:
        raise ValueError(f"image {stray[0]} lies directly in domain folder {folder}; {LAYOUT}")
    files: list[Path] = []
    labels: list[int] = []
    for name in _subfolders(folder):
        if name not in classes:
            raise ValueError(f"unknown class folder {folder / name} (classes: {_names(classes)}); {LAYOUT}")
        images = sorted(p for p in (folder / name).rglob("*") if _is_image(p))
        files += images
        labels += [classes.index(name)] * len(images)
    if not files:
        raise ValueError(f"domain folder {folder} has no images; {LAYOUT}")
    return files, labels


def scan_tree(root: Path, domains: list[str], classes: list[str]) -> tuple[list[Path], np.ndarray, np.ndarray]:
    """All image files of ``domains``, with int64 labels and domain ids (indices into the given lists)."""
    files: list[Path] = []
    labels: list[int] = []
    domain_ids: list[int] = []
    missing = [root / d for d in domains if not (root / d).is_dir()]
    if missing:
        raise FileNotFoundError(f"domain folder {missing[0]} is missing (domains: {_names(domains)}); {LAYOUT}")
    for d, name in enumerate(domains):
        f, y = _domain_files(root / name, classes)
        files += f
        labels += y
        domain_ids += [d] * len(f)
    return files, np.array(labels, dtype=np.int64), np.array(domain_ids, dtype=np.int64)


def load_image(path: Path) -> Tensor:
    """RGB float ``[3, H, W]`` in ``[0, 1]``; a one-line error naming the file if it cannot be decoded."""
    try:
        with Image.open(path) as im:
            pixels = np.asarray(im.convert("RGB"))
    except (OSError, ValueError, SyntaxError) as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"cannot read image {path}: {reason}; {LAYOUT}") from None
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div_(255.0)


class FolderDomainDataset(DomainDataset):
    """Images decoded from disk on demand, with DomainBed's augmentation for training batches.

    Args:
        name: registry name.
        files: one image path per sample.
        labels: int64 ``[N]`` indices into ``classes``.
        domain_ids: int64 ``[N]`` indices into ``domains``.
        domains: domain names.
        classes: class names.
        image_size: side of the square images :meth:`get_batch` returns.
    """

    def __init__(
        self,
        name: str,
        files: list[Path],
        labels: np.ndarray,
        domain_ids: np.ndarray,
        domains: list[str],
        classes: list[str],
        image_size: int = DEFAULT_IMAGE_SIZE,
    ) -> None:
        if not len(files) == len(labels) == len(domain_ids):
            raise ValueError(f"{len(files)} files but {len(labels)} labels and {len(domain_ids)} domain ids")
        self.name = name
        self.files = list(files)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.domain_ids = np.asarray(domain_ids, dtype=np.int64)
        self.domains = list(domains)
        self.classes = list(classes)
        self.image_shape = (3, image_size, image_size)
        self._train = train_transform(image_size)
        self._eval = eval_transform(image_size)

    def get_batch(
        self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        transform = self._train if train else self._eval
        images = torch.stack([transform(load_image(self.files[i]), generator) for i in idx])
        return images, torch.from_numpy(self.labels[idx])
