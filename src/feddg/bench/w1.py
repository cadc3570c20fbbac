"""W1: FedAvg, 4 clients × 2,000 images 3×28×28, ``cnn4``, batch 32, SGD, 1 local epoch, 5 rounds.

feddg's in-process engine (``workers`` 1 with torch's threads and with one, 2, ``auto``) against the
pure-compute yardstick this module contains: a plain PyTorch loop doing the same 20 client-epochs on 2
one-thread processes (10 each), with no messages, aggregation or evaluation. Timings are wall seconds of
the whole run, interleaved.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table
from torch import nn

from feddg.algorithms.registry import create_method
from feddg.config import ExperimentConfig, build_config
from feddg.data.tensor_dataset import TensorDomainDataset
from feddg.engines.inprocess import run_inprocess
from feddg.engines.workers import can_fork, resolve_workers
from feddg.federation.server import Server
from feddg.federation.setup import Federation, make_clients, make_split, make_topology, resolve_device
from feddg.models import create_model

CLIENTS, IMAGES, SIZE, CLASSES, ROUNDS, BATCH, LR = 4, 2000, 28, 10, 5, 32, 0.05
TEST_IMAGES = 200  # the held-out domain, evaluated once after the last round


def w1_dataset(images: int = IMAGES, seed: int = 0) -> TensorDomainDataset:
    """5 domains (4 training domains of ``images``, 1 test domain of 200): class prototypes plus noise."""
    rng = np.random.default_rng(seed)
    protos = rng.integers(0, 256, size=(CLASSES, 3, SIZE, SIZE))
    parts = []
    for n in [images] * CLIENTS + [TEST_IMAGES]:
        y = rng.integers(0, CLASSES, size=n)
        x = np.clip(protos[y] + rng.normal(0, 40, size=(n, 3, SIZE, SIZE)), 0, 255).astype(np.uint8)
        parts.append((x, y.astype(np.int64)))
    domains = ["test", *[f"d{i}" for i in range(CLIENTS)]]
    return TensorDomainDataset.from_parts("w1", [parts[-1], *parts[:-1]], domains, [str(c) for c in range(CLASSES)],
                                          mean=[0.5] * 3, std=[0.25] * 3)


def w1_config(workers: int | str, images: int = IMAGES, device: str = "cpu", threads: int | str = "auto"
              ) -> ExperimentConfig:
    """W1 as a config; ``data.max_per_domain`` carries the images per client (the dataset itself is built here)."""
    return build_config({
        "data": {"max_per_domain": images},
        "name": "w1", "model": {"name": "cnn4"}, "method": {"name": "fedavg"}, "device": device,
        "partition": {"kind": "by_domain", "num_clients": CLIENTS, "holdout": 0.0}, "split": {"target": "test"},
        "optim": {"name": "sgd", "lr": LR, "schedule": "constant"},
        "federation": {"rounds": ROUNDS, "local_epochs": 1, "batch_size": BATCH, "workers": workers,
                       "threads": threads},
        "eval": {"every": ROUNDS},
    })


def w1_federation(cfg: ExperimentConfig) -> Federation:
    """The W1 federation of ``cfg`` (a spawned worker rebuilds it by this module path)."""
    ds = w1_dataset(cfg.data.max_per_domain or IMAGES)
    split = make_split(ds, cfg)
    clients = make_clients(ds, split, cfg)
    method = create_method(cfg.method.name, cfg.method.params)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model = method.prepare_model(create_model("cnn4", num_classes=CLASSES)).to(device)
    return Federation(cfg, ds, split, clients, method, model, device, make_topology(cfg, clients, model))


def run_feddg(workers: int | str, images: int = IMAGES, device: str = "cpu", threads: int | str = "auto") -> float:
    """Wall seconds of W1 through feddg's in-process engine (pool start-up, 5 rounds, evaluation, files)."""
    cfg = w1_config(workers, images, device, threads)
    fed = w1_federation(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_inprocess(Server(fed, Path(tmp) / "run"), factory=w1_federation)
        return time.perf_counter() - t0


def _plain_worker(images: torch.Tensor, labels: torch.Tensor, epochs: int, seed: int, device: str = "cpu") -> None:
    """``epochs`` client-epochs of plain SGD training (the yardstick's half): on one thread, or on ``device``
    with the batches built there (a GPU's yardstick)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = create_model("cnn4", num_classes=CLASSES).to(device)
    images, labels = images.to(device), labels.to(device)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.load_state_dict(start)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=5e-4)
        for idx in torch.randperm(len(labels), generator=g).split(BATCH):
            idx = idx.to(device)
            x = (images[idx].float().div_(255.0) - 0.5) / 0.25
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), labels[idx]).backward()
            opt.step()
    if device != "cpu":
        torch.cuda.synchronize()


def _plain_data(images: int) -> tuple[torch.Tensor, torch.Tensor]:
    ds = w1_dataset(images)
    train = np.flatnonzero(ds.domain_ids != ds.domain_index("test"))[:images]
    return ds.images[train], torch.from_numpy(ds.labels[train])


def run_plain_on(device: str, images: int = IMAGES) -> float:
    """Wall seconds of the 20 client-epochs in this process on ``device`` (a GPU's yardstick)."""
    x, y = _plain_data(images)
    t0 = time.perf_counter()
    _plain_worker(x, y, CLIENTS * ROUNDS, 0, device)
    return time.perf_counter() - t0


def run_plain(images: int = IMAGES, processes: int = 2) -> float:
    """Wall seconds of the same 20 client-epochs on ``processes`` forked one-thread processes."""
    x, y = _plain_data(images)
    epochs = CLIENTS * ROUNDS // processes
    importlib.import_module("torch._dynamo")  # the first optimiser step imports it: not compute; forks inherit it
    ctx: Any = mp.get_context("fork" if can_fork() else "spawn")  # no fork once CUDA (and its autograd threads) ran
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_plain_worker, args=(x, y, epochs, i)) for i in range(processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a yardstick process failed: exit codes {[p.exitcode for p in procs]}")
    return time.perf_counter() - t0


#: ``--variants`` key -> (row name, run); ``auto``'s row names the worker count it resolves to here
VARIANTS = ("plain", "1", "1-threads-2", "2", "auto")


def _variants(images: int) -> dict[str, tuple[str, Callable[[], float]]]:
    auto = resolve_workers("auto", torch.device("cpu")) or 1
    return {"plain": ("plain PyTorch, 2 × 1 thread", lambda: run_plain(images)),
            "1": ("feddg workers: 1 (threads: auto = 1)", lambda: run_feddg(1, images)),
            "1-threads-2": ("feddg workers: 1, threads: 2", lambda: run_feddg(1, images, threads=2)),
            "2": ("feddg workers: 2", lambda: run_feddg(2, images)),
            "auto": (f"feddg workers: auto (= {auto})", lambda: run_feddg("auto", images))}


def check_variants(variants: Sequence[str]) -> None:
    """Refuse a variant list without the yardstick or with a name not in :data:`VARIANTS`."""
    if set(variants) - set(VARIANTS) or "plain" not in variants:
        raise ValueError(f"W1 variants must include 'plain' (the yardstick) and be among {','.join(VARIANTS)}, "
                         f"got {','.join(variants)}")


def w1_table(repeats: int, images: int = IMAGES, variants: Sequence[str] = VARIANTS
             ) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each variant over ``repeats`` interleaved rounds, the order rotated each round so
    that no variant always runs after the same one (a fixed order made ``auto`` look 2 s slower than ``2``, the
    same pool); the yardstick (``plain``) comes first."""
    check_variants(variants)
    table = _variants(images)
    runs = {table[key][0]: table[key][1] for key in VARIANTS if key in variants}
    names = list(runs)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            c0 = cpu_seconds()  # before the run builds its data: ≈ 0.4 s of CPU outside its wall clock, both sides
            wall = runs[name]()
            times[name].append((wall, cpu_seconds() - c0))
    return times


def _spin() -> None:
    while True:
        pass


@contextmanager
def background_load(processes: int) -> Iterator[None]:
    """``processes`` busy loops (one core each) running for the duration: a load that stays the same for every
    variant, so that "under load" is a condition of the run rather than of whatever else the machine does."""
    ctx: Any = mp.get_context("fork" if can_fork() else "spawn")
    procs = [ctx.Process(target=_spin, name="feddg-bench-load", daemon=True) for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        yield
        if not all(p.is_alive() for p in procs):  # the figures would claim a load they did not run under
            raise RuntimeError("a busy-loop process ended before the benchmark did: its figures are not under load")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()


def summary(times: dict[str, list[tuple[float, float]]]) -> list[tuple[str, float, float, float, float]]:
    """(variant, min s, median s, min / yardstick's min, min CPU s) rows; the first variant is the yardstick."""
    yard = min(w for w, _ in next(iter(times.values())))
    return [(n, min(w for w, _ in t), statistics.median(w for w, _ in t), min(w for w, _ in t) / yard,
             min(c for _, c in t)) for n, t in times.items()]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its finished (joined) children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def w1_report(repeats: int, images: int = IMAGES, variants: Sequence[str] = VARIANTS, load: int = 0
              ) -> Iterator[Table | str]:
    """``feddg bench w1``, each line or table as soon as it is measured: the load average, the table of
    :func:`w1_table` (min, median, ratio to the yardstick), the load average; ``load`` busy loops run throughout."""
    yield f"load average before: {load_average()}" + (f"; {load} busy-loop process(es) started" if load else "")
    t = Table(title=f"W1: FedAvg, 4 clients × {images} images 3×28×28, cnn4, batch 32, 5 rounds; "
              f"{repeats} interleaved" + (f"; under {load} busy loop(s)" if load else ""))
    for col in ("variant", "min s", "median s", "× yardstick (min)", "CPU s (min)"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    with background_load(load):
        rows = summary(w1_table(repeats, images, variants))
        after = load_average()
    for name, lo, med, ratio, cpu in rows:
        t.add_row(name, f"{lo:.1f}", f"{med:.1f}", f"{ratio:.2f}", f"{cpu:.1f}")
    yield t
    yield f"load average after: {after}"
