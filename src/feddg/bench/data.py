"""``feddg bench data``: folder datasets through the image cache vs decoding every epoch, and
Digits-DG exported to folders vs the built-in path, per round.

The photo folder is generated (4 domains × 7 classes of JPEG crops of scikit-learn's two sample
photos, each domain with its own style), so the benchmark needs no download. Variants run
interleaved (A B A B) in one process and report min and median.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageOps
from rich.table import Table

from feddg.data import iterate_batches, load_dataset
from feddg.data.folders import load_image
from feddg.data.transforms import train_transform
from feddg.engines.workers import compute_threads

DOMAINS = ("photo", "sketch", "cartoon", "art")
CLASSES = 7
BATCH = 32


def _style(img: Image.Image, domain: str, rng: np.random.Generator) -> Image.Image:
    if domain == "sketch":
        return ImageOps.invert(img.convert("L").filter(ImageFilter.FIND_EDGES)).convert("RGB")
    if domain == "cartoon":
        return ImageOps.posterize(img.filter(ImageFilter.SMOOTH_MORE), 3)
    if domain == "art":
        shift = rng.integers(-40, 41, size=3)
        return Image.fromarray(np.clip(np.asarray(img, np.int16) + shift, 0, 255).astype(np.uint8)).filter(
            ImageFilter.GaussianBlur(1.5))
    return img


def make_photo_folder(root: Path, images: int, seed: int = 0) -> int:
    """``root/<domain>/<class>/<i>.jpg``: random crops (280-480 × 240-400 px) of the two sample photos."""
    from sklearn.datasets import load_sample_image

    photos = [Image.fromarray(load_sample_image(n)) for n in ("china.jpg", "flower.jpg")]
    rng = np.random.default_rng(seed)
    per_class = -(-images // (len(DOMAINS) * CLASSES))
    for domain in DOMAINS:
        for k in range(CLASSES):
            folder = root / domain / f"class{k}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                photo = photos[rng.integers(len(photos))]
                w, h = int(rng.integers(280, 481)), int(rng.integers(240, 401))
                left, top = int(rng.integers(0, photo.width - w + 1)), int(rng.integers(0, photo.height - h + 1))
                crop = photo.crop((left, top, left + w, top + h))
                _style(crop, domain, rng).save(folder / f"{i:04d}.jpg", quality=90)
    return per_class * len(DOMAINS) * CLASSES


def _decode_every_epoch(root: Path, size: int) -> Callable[[], float]:
    """The old folder path as a yardstick: per image, decode, DomainBed's transform on tensors, stack."""
    files = sorted(root.rglob("*.jpg"))
    transform = train_transform(size)

    def epoch() -> float:
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(len(files), generator=g).tolist()
        start = time.perf_counter()
        for s in range(0, len(order), BATCH):
            torch.stack([transform(load_image(files[i]), g) for i in order[s : s + BATCH]])
        return time.perf_counter() - start

    return epoch


def _cached_epoch(ds: Any) -> float:
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in iterate_batches(ds, np.arange(len(ds)), BATCH, shuffle=True, train=True, generator=g):
        pass
    return time.perf_counter() - start


def folder_throughput(
    images: int = 2100, size: int = 224, repeats: int = 3, loader_workers: int = 0
) -> dict[str, list[float]]:
    """Seconds per epoch of each variant over ``repeats`` interleaved rounds; ``images`` is the count used.

    ``decode every epoch``: the old path. ``cache: epoch 1``: scan, decode into a fresh cache, one
    epoch. ``cache: epoch 2+``: one epoch from the existing cache (batched augmentation).
    """
    times: dict[str, list[float]] = {"decode every epoch": [], "cache: epoch 1": [], "cache: epoch 2+": []}
    if loader_workers:
        times[f"cache: epoch 2+, {loader_workers} loader workers"] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "photos"
        count = make_photo_folder(root, images)
        old = _decode_every_epoch(root, size)
        for r in range(repeats):
            times["decode every epoch"].append(old())
            start = time.perf_counter()
            ds = load_dataset("folder", root=str(root), cache_dir=Path(tmp) / f"cache{r}", image_size=size)
            times["cache: epoch 1"].append(time.perf_counter() - start + _cached_epoch(ds))
            times["cache: epoch 2+"].append(_cached_epoch(ds))
            if loader_workers:
                ds.loader_workers = loader_workers
                times[f"cache: epoch 2+, {loader_workers} loader workers"].append(_cached_epoch(ds))
    times["images"] = [float(count)]
    return times


def _run(overrides: list[str]) -> dict[str, float]:
    from feddg.config import build_config
    from feddg.evaluation.plots import read_metrics
    from feddg.experiment import run_experiment

    cfg = build_config({}, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        results = run_experiment(cfg, Path(tmp) / "run", progress=False)
        total = time.perf_counter() - start
        rounds = [r["time_round_s"] for r in read_metrics(Path(tmp) / "run")]
    return {"round_s": statistics.median(rounds[1:] or rounds), "total_s": total,
            "ood_acc": results["final"]["ood_acc"], "id_acc": results["final"]["id_acc"]}


def digits_rounds(rounds: int = 3, max_per_domain: int = 1000, seeds: int = 2) -> dict[str, list[dict[str, float]]]:
    """FedAvg on Digits-DG, built-in vs exported to folders, interleaved, experiment seeds ``0 .. seeds-1``.

    The folder holds the same images with the same (``feddg.json``) transforms, but in folder order
    (class by class), so clients get other samples than with the built-in order: accuracies match
    up to seed-to-seed noise, not bit for bit.
    """
    from feddg.data.export import export_dataset

    common = ["partition.num_clients=6", f"federation.rounds={rounds}", "split.target=mnistm", "eval.every=1",
              "optim.lr=0.05", "federation.workers=1", "data.domains=[mnist, uci, synth, mnistm]"]
    out: dict[str, list[dict[str, float]]] = {"built-in": [], "folder (exported PNG)": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "digits"
        export_dataset("digits-dg", root, max_per_domain=max_per_domain)
        folder = ["data.dataset=folder", f"data.root={root}", f"data.cache_dir={Path(tmp) / 'cache'}"]
        for seed in range(seeds):  # experiment seeds 0, 1, ...: accuracy differences of the same size are noise
            out["built-in"].append(_run([*common, f"seed={seed}", f"data.max_per_domain={max_per_domain}"]))
            out["folder (exported PNG)"].append(_run([*common, f"seed={seed}", *folder]))
    return out


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def data_report(
    images: int, size: int, repeats: int, threads: int, loader_workers: int, digits: tuple[int, int, int] | None
) -> Iterator[Table | str]:
    """``feddg bench data``, each line or table as soon as it is measured: the load average, the folder table
    (:func:`folder_throughput`), the Digits-DG table when ``digits`` gives its ``(rounds, max_per_domain, seeds)``
    (:func:`digits_rounds`), the load average."""
    with compute_threads(threads):  # the caller's thread counts restored after
        yield f"load average before: {load_average()}"
        times = folder_throughput(images, size, repeats, loader_workers)
        count = times.pop("images")[0]
        t = Table(title=f"{int(count)} JPEGs at {size}px, batch 32, {threads} torch thread(s), "
                  f"{repeats} interleaved rounds")
        for col in ("variant", "min s", "median s", "img/s (best)", "× decode every epoch"):
            t.add_column(col, justify="left" if col == "variant" else "right")
        yardstick = min(times["decode every epoch"])
        for name, secs in times.items():
            t.add_row(name, f"{min(secs):.2f}", f"{statistics.median(secs):.2f}", f"{count / min(secs):,.0f}",
                      f"{yardstick / min(secs):.2f}")
        yield t
        if digits is not None:
            rounds, max_per_domain, seeds = digits
            runs = digits_rounds(rounds, max_per_domain, seeds)
            t = Table(title=f"FedAvg on Digits-DG ({max_per_domain}/domain, 6 clients, {rounds} rounds, "
                      "target mnistm), interleaved, seeds 0, 1, ...")
            for col in ("data path", "s/round (median, each seed)", "total s", "ood acc", "id acc"):
                t.add_column(col, justify="left" if col == "data path" else "right")
            for name, rows in runs.items():
                t.add_row(name, *(" ".join(f"{r[k]:.{2 if k == 'round_s' else 1}f}" for r in rows)
                                  for k in ("round_s", "total_s", "ood_acc", "id_acc")))
            yield t
        yield f"load average after: {load_average()}"
