"""Decode image files once, in parallel, into an on-disk uint8 cache that is memory-mapped back.

The cache of a list of files at one resolution is
``<cache>/folders/<tag>_<root>_<size>px_<paths>_<stamps>.npy`` (``[N, size, size, 3]`` uint8, channels
last: the decoder's layout, and torch's fast one for resizing uint8): ``paths`` hashes which files
(relative to the root, in order), ``stamps`` their sizes and modification times. Touching, replacing,
adding or removing an image therefore selects another file name, and the stale version of the same
selection is deleted once the new one is written. Writes go to a temporary file that is renamed into place, so a crash never
leaves a half cache; a killed build's temporary file is removed by the next build of the same cache.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from feddg.data.cache import replaced_atomically

VERSION = "v1"
CHUNK = 64  # files per task sent to a decoding process
T = TypeVar("T")


def _digest(lines: Iterator[str]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()[:16]


def cache_path(cache_dir: Path, tag: str, root: Path, files: Sequence[Path], size: int) -> Path:
    """Where the cache of ``files`` (under ``root``) at ``size`` px lives; stats every file."""
    root = root.resolve()
    rel = [os.path.relpath(f.resolve(), root) for f in files]
    stamps = (f"{r}\t{st.st_size}\t{st.st_mtime_ns}" for r, st in zip(rel, (os.stat(f) for f in files), strict=True))
    name = f"{tag}_{_digest(iter([str(root)]))[:8]}_{size}px_{_digest(iter([VERSION, *rel]))}_{_digest(stamps)}.npy"
    return cache_dir / "folders" / name


def rgb8(im: Image.Image) -> np.ndarray:
    """The image as RGB uint8 ``[H, W, 3]`` (PIL's ``convert("RGB")``: grey repeated, alpha dropped); ``ValueError``
    for 16-bit, 32-bit and float images, which that conversion saturates or zeroes instead of scaling."""
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        raise ValueError(f"a {im.mode} image (16-bit, 32-bit or float): feddg reads 8-bit images, convert it first")
    return np.array(im.convert("RGB"))


def decode(path: str | Path, size: int | None) -> np.ndarray:
    """RGB uint8 ``[size, size, 3]`` (bilinear, antialiased as PIL; ``None`` keeps the file's own size)."""
    with Image.open(path) as im:
        if size is not None:
            im.draft("RGB", (size, size))  # JPEG: decode at the smallest DCT scale still >= size
        rgb = rgb8(im)
    if size is None or rgb.shape[:2] == (size, size):
        return rgb
    x = torch.from_numpy(rgb).permute(2, 0, 1).unsqueeze(0)  # channels last: torch's fast uint8 path
    out = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0).numpy()


def _reason(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


def _decode_chunk(paths: list[str], size: int) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Decoded images (zeros where unreadable) and ``(position, reason)`` of each failure."""
    out = np.zeros((len(paths), size, size, 3), dtype=np.uint8)
    errors = []
    for i, p in enumerate(paths):
        try:
            out[i] = decode(p, size)
        except Exception as err:
            errors.append((i, _reason(err)))
    return out, errors


def _check_chunk(paths: list[str]) -> list[tuple[int, str]]:
    """``(position, reason)`` of each file in ``paths`` that cannot be fully decoded to 8-bit RGB."""
    errors = []
    for i, p in enumerate(paths):
        try:
            with Image.open(p) as im:
                rgb8(im)
        except Exception as err:
            errors.append((i, _reason(err)))
    return errors


def decode_workers(count: int) -> int:
    """Processes worth starting for ``count`` files: one per usable core, none for a few files."""
    if count < 2 * CHUNK or mp.current_process().daemon:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(cores, -(-count // CHUNK)))


def _pool(workers: int) -> Executor:
    """Decoding processes (forked where possible: nothing to import), one torch thread each."""
    methods = mp.get_all_start_methods()
    context = mp.get_context("fork" if "fork" in methods else None)
    return ProcessPoolExecutor(workers, mp_context=context, initializer=torch.set_num_threads, initargs=(1,))


def progress_bar() -> Progress:
    """A transient rich bar (it disappears when done, and prints nothing when not on a terminal)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), transient=True)


def _map_chunks(
    fn: Callable[..., T], files: Sequence[Path], extra: tuple, workers: int | None, description: str
) -> Iterator[tuple[int, T]]:
    """``(start, fn(chunk, *extra))`` for every ``CHUNK`` of ``files`` in order, in parallel, with a bar."""
    starts = range(0, len(files), CHUNK)
    chunks = [[str(f) for f in files[s : s + CHUNK]] for s in starts]
    workers = decode_workers(len(files)) if workers is None else workers
    with progress_bar() as bar:
        task = bar.add_task(description, total=len(files))
        if workers <= 0:
            results: Iterator[T] = (fn(c, *extra) for c in chunks)
            for start, chunk, res in zip(starts, chunks, results, strict=True):
                yield start, res
                bar.advance(task, len(chunk))
            return
        with _pool(workers) as pool:
            for start, chunk, res in zip(starts, chunks, pool.map(fn, chunks, *([e] * len(chunks) for e in extra)),
                                         strict=True):
                yield start, res
                bar.advance(task, len(chunk))


def unreadable(files: Sequence[Path], workers: int | None = None) -> list[tuple[Path, str]]:
    """Every file of ``files`` that cannot be decoded, with the reason (parallel, with a progress bar)."""
    bad = []
    for start, errors in _map_chunks(_check_chunk, files, (), workers, f"checking {len(files)} images"):
        bad += [(files[start + i], reason) for i, reason in errors]
    return bad


class UnreadableImages(ValueError):
    """Some images could not be decoded; ``failures`` lists ``(path, reason)``."""

    def __init__(self, failures: list[tuple[Path, str]]) -> None:
        self.failures = failures
        path, reason = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(f"cannot read image {path}: {reason}{more}")


def _check_space(folder: Path, nbytes: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < nbytes + (1 << 28):
        raise OSError(f"the image cache needs {nbytes / 2**30:.1f} GiB but {folder} has {free / 2**30:.1f} GiB "
                      "free; point data.cache_dir (or $FEDDG_CACHE) at a bigger disk, or lower data.image_size")


def build(path: Path, files: Sequence[Path], size: int, workers: int | None = None) -> None:
    """Decode ``files`` at ``size`` px into ``path`` (atomically); :class:`UnreadableImages` on any failure."""
    with replaced_atomically(path) as tmp:  # first, so that a killed build's space is free again
        _check_space(path.parent, len(files) * 3 * size * size)
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(files), size, size, 3))
        failures: list[tuple[Path, str]] = []
        for start, (images, errors) in _map_chunks(_decode_chunk, files, (size,), workers,
                                                   f"caching {len(files)} images at {size}px"):
            out[start : start + len(images)] = images
            failures += [(files[start + i], reason) for i, reason in errors]
        if failures:
            raise UnreadableImages(failures)
        out.flush()
        del out
    for stale in path.parent.glob(path.name.rsplit("_", 1)[0] + "_*.npy"):
        if stale != path:
            stale.unlink(missing_ok=True)


def load(path: Path, count: int, size: int) -> np.ndarray | None:
    """The cache at ``path`` memory-mapped (copy-on-write), or ``None`` if missing or of the wrong shape."""
    try:
        images = np.load(path, mmap_mode="c")
    except (OSError, ValueError):
        return None
    return images if images.shape == (count, size, size, 3) and images.dtype == np.uint8 else None


def cached_images(
    cache_dir: Path, tag: str, root: Path, files: Sequence[Path], size: int, workers: int | None = None
) -> tuple[np.ndarray, Path]:
    """``[N, size, size, 3]`` uint8 images of ``files``, from the cache or decoded into it first."""
    path = cache_path(cache_dir, tag, root, files, size)
    images = load(path, len(files), size)
    if images is None:
        build(path, files, size, workers)
        images = load(path, len(files), size)
        if images is None:
            raise OSError(f"image cache {path} could not be read back after writing it")
    return images, path
