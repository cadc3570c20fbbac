"""FEMNIST (LEAF, Caldas et al. 2018): handwritten digits and letters, one natural group per writer.

Two on-disk formats:

* **LEAF json**: ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats in 0..1]],
  "y": [int]}}}`` in ``root/all_data_*.json`` (or ``root/all_data/*.json``: every writer is then a domain) or in
  ``root/train/*.json`` + ``root/test/*.json`` (LEAF's split: the domains are ``test`` and ``train``). Users with
  no samples are skipped.
* **WILDS-style** (FedDG_Benchmark's release) ``root/femnist_v1.0/metadata.csv`` (or ``root/metadata.csv``) with
  columns ``path, y, split, domain_remapped`` (or ``domain``), ``path`` an image file relative to the csv's folder:
  the ``split`` column holds WILDS' names or codes (train 0, val 1, test 2, id_val 3, id_test 4); ``train``, ``val``
  and ``test`` are the domains and the id splits are left out, as for IWildCam. The writer column is the natural
  group. An image listed on two lines is refused.

Labels 0-9 are the digits, 10-35 the upper-case and 36-61 the lower-case letters; images are 28 px grayscale.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np

from feddg.data import image_cache
from feddg.data.cache import cached
from feddg.data.natural import Lines, Row, Samples, Source, read_csv, split_order, wilds_rows, wilds_split
from feddg.data.transform_spec import TransformSpec

NAME = "femnist"
CLASSES = [*string.digits, *string.ascii_uppercase, *string.ascii_lowercase]
SIZE = 28
PIXELS = SIZE * SIZE
WILDS_FOLDER = "femnist_v1.0"
COLUMNS = ("path", "y", "split")
WRITER_COLUMNS = ("domain_remapped", "domain")  # FedDG_Benchmark's name first
HEADER = "path, y, split, domain_remapped (or domain)"
LAYOUT = (f"root/all_data_*.json or root/{{train,test}}/*.json (LEAF), or root/{WILDS_FOLDER}/metadata.csv "
          f"(or root/metadata.csv) with columns {HEADER} and the images")


def _label(value: object) -> int:
    """``value`` as a class index in 0..61, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"label {value!r} is not an integer")
    y = int(value)
    if not 0 <= y < len(CLASSES):
        raise ValueError(f"label {y} is outside 0..{len(CLASSES) - 1}")
    return y


def _user_arrays(path: Path, user: str, data: object) -> tuple[np.ndarray, np.ndarray]:
    """One user's ``x`` as uint8 ``[n, 1, 28, 28]`` and ``y``; one line naming the file and user if malformed."""
    try:
        if not isinstance(data, dict) or "x" not in data or "y" not in data:
            raise ValueError("expected an object with x and y")
        y = np.array([_label(v) for v in data["y"]], dtype=np.int64)
        x = np.asarray(data["x"], dtype=np.float64)
        if (x.shape != (len(y), PIXELS) and len(y)) or (not len(y) and x.size):
            raise ValueError(f"x must be {len(y)} lists of {PIXELS} numbers (one per label), got shape {x.shape}")
        if len(y) and not (x.min() >= 0 and x.max() <= 1):
            raise ValueError("x values must lie in 0..1")
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: user {user}: {' '.join(str(err).split())}") from None
    pixels = np.rint(x * 255).astype(np.uint8).reshape(len(y), 1, SIZE, SIZE)
    return pixels, y


def read_leaf_file(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each user's images and labels in one LEAF json file (users without samples left out)."""
    try:
        blob = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable JSON ({' '.join(str(err).split())})") from None
    if not isinstance(blob, dict) or not isinstance(blob.get("users"), list) or not isinstance(
            blob.get("user_data"), dict):
        raise ValueError(f"{path}: expected LEAF's object with users, num_samples and user_data")
    unlisted = sorted(set(blob["user_data"]) - {str(u) for u in blob["users"]})
    if unlisted:
        raise ValueError(f"{path}: user {unlisted[0]}: in user_data but not listed in users ({len(unlisted)} such)")
    counts = blob.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(blob["users"])):
        raise ValueError(f"{path}: num_samples must list one count per user ({len(blob['users'])})")
    out = {}
    for k, user in enumerate(blob["users"]):
        if str(user) not in blob["user_data"]:
            raise ValueError(f"{path}: user {user}: listed in users but missing from user_data")
        x, y = _user_arrays(path, str(user), blob["user_data"][str(user)])
        if counts is not None and counts[k] != len(y):
            raise ValueError(f"{path}: user {user}: num_samples says {counts[k]!r}, user_data holds {len(y)} samples")
        if len(y):
            out[str(user)] = (x, y)
    return out


def _leaf_files(root: Path) -> dict[str, list[Path]]:
    """The json files of each split (``{"all": [...]}`` for LEAF's unsplit ``all_data``)."""
    splits = {s: sorted((root / s).glob("*.json")) for s in ("test", "train") if (root / s).is_dir()}
    if splits:
        return splits
    every = sorted(root.glob("all_data_*.json")) or sorted((root / "all_data").glob("*.json"))
    return {"all": every} if every else {}


def _read_leaf(root: Path, files: dict[str, list[Path]]) -> dict[str, np.ndarray]:
    """Every sample of the LEAF files: images, labels, split index (into ``files``) and writer name."""
    xs, ys, splits, users = [], [], [], []
    for s, paths in enumerate(files.values()):
        home: dict[str, Path] = {}  # each user's file within this split: a user in two is a copied file
        for path in paths:
            for user, (x, y) in read_leaf_file(path).items():
                if user in home:
                    raise ValueError(f"{path}: user {user} is also in {home[user]} (a copy of a LEAF file? each "
                                     "writer's samples of a split live in one file)")
                home[user] = path
                xs.append(x)
                ys.append(y)
                splits.append(np.full(len(y), s, dtype=np.int64))
                users += [user] * len(y)
    if not ys:
        raise ValueError(f"{root}: the LEAF files hold no sample")
    return {"x": np.concatenate(xs), "y": np.concatenate(ys), "split": np.concatenate(splits),
            "user": np.array(users)}


def read_leaf(root: Path, cache_dir: Path) -> Samples:
    """FEMNIST from LEAF json files, parsed once into a cache keyed by the files' paths, sizes and mtimes."""
    files = _leaf_files(root)
    if not files or not all(files.values()):
        raise ValueError(f"{root}: no FEMNIST data; expected {LAYOUT}")
    every = [p for paths in files.values() for p in paths]
    # leaf2: a cache parsed before a user in two files was refused may hold such a user's samples twice
    key = image_cache.cache_path(cache_dir, f"{NAME}-leaf2", root, every, SIZE).with_suffix(".npz")
    arrays = cached(key, ("x", "y", "split", "user"), lambda: _read_leaf(root, files))
    writers, groups = np.unique(arrays["user"], return_inverse=True)
    names = [str(w) for w in writers]
    if "all" in files:  # no official split: each writer is a domain
        return Samples(names, CLASSES, arrays["y"], groups, SIZE, 1, groups, names, arrays["x"])
    return Samples(list(files), CLASSES, arrays["y"], arrays["split"], SIZE, 1, groups, names, arrays["x"])


def _metadata_rows(table: Path) -> tuple[Lines, str]:
    """The rows of ``table`` and the name of its writer column; one line naming it when unreadable or incomplete."""
    rows, header = read_csv(table)
    writer = next((c for c in WRITER_COLUMNS if c in header), None)
    if not rows or writer is None or any(c not in header for c in COLUMNS):
        raise ValueError(f"{table}: expected a header with columns {HEADER} and one row per image")
    return rows, writer


def _metadata_row(folder: Path, row: Row, writer: str) -> tuple[str, Path, tuple[int, str]]:
    """A row's split name, label, image file and writer; ``ValueError`` when one is malformed or missing."""
    if empty := [c for c in (*COLUMNS, writer) if not (row.get(c) or "").strip()]:
        raise ValueError(f"empty {', '.join(empty)}")
    split, label, file = wilds_split(row["split"]), _label(row["y"].strip()), folder / row["path"].strip()
    if not file.is_file():
        raise ValueError(f"no image {file}")
    return split, file, (label, row[writer].strip())


def read_metadata(folder: Path) -> Samples:
    """FEMNIST from ``folder/metadata.csv`` (``path, y, split, domain_remapped``) and its image files: the train,
    val and test splits (the id splits left out)."""
    table = folder / "metadata.csv"
    rows, writer = _metadata_rows(table)
    kept = wilds_rows(table, rows, lambda row: _metadata_row(folder, row, writer))
    splits, files = [split for split, _, _ in kept], [file for _, file, _ in kept]
    labels, writers = [label for _, _, (label, _) in kept], [who for _, _, (_, who) in kept]
    domains = split_order(set(splits))
    names, groups = np.unique(np.array(writers), return_inverse=True)
    domain_ids = np.array([domains.index(s) for s in splits], dtype=np.int64)
    return Samples(domains, CLASSES, np.array(labels, dtype=np.int64), domain_ids, SIZE, 1, groups,
                   [str(n) for n in names], files=files, root=folder,
                   ood_validation="val" if "val" in domains else None, ood_test="test" if "test" in domains else None)


def read_femnist(root: Path | None, seed: int, cache_dir: Path) -> Samples:
    """FEMNIST from ``root`` in either format (a ``metadata.csv`` in ``root/femnist_v1.0`` or ``root`` if there is
    one, else LEAF json); ``seed`` is unused."""
    assert root is not None
    folder = next((f for f in (root / WILDS_FOLDER, root) if (f / "metadata.csv").is_file()), None)
    return read_leaf(root, cache_dir) if folder is None else read_metadata(folder)


SOURCE = Source(read_femnist, [], CLASSES, SIZE, TransformSpec(mean=(0.5,), std=(0.5,)), layout=LAYOUT)
