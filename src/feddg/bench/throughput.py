"""Benchmarks behind ``feddg bench``: model throughput and engine wall time per round.

``feddg bench models`` times a plain training loop of each model on random data; with ``--feddg`` it times
feddg's client loop (:func:`~feddg.algorithms.components.local.train_local`: Adam, the task's loss, batches from
the dataset) against a plain PyTorch loop of the same model, batch, optimiser and loss on the same data held in
memory as tensors (the yardstick), interleaved. The task follows the model's output: dense ``[B, C, H, W]`` logits
(the U-Net) train on ``synthetic-mri`` slices with the segmentation loss, ``[B, C]`` logits on random images with
cross-entropy, and text models (``tiny-roberta@128``: ``@`` is the maximum length in tokens) on ``synthetic-sentiment``
reviews with cross-entropy against Hugging Face's own forward, counted in non-padding tokens/s.

Numbers go into docs/benchmarks.md together with the command that produced them; no test
asserts a speed.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table
from torch import Tensor, nn

from feddg.algorithms.base import ClientContext, OptimSettings
from feddg.algorithms.components.local import train_local
from feddg.config import ExperimentConfig, load_config
from feddg.data.base import DomainDataset, ascii_int
from feddg.engines.workers import compute_threads
from feddg.evaluation.plots import read_metrics
from feddg.models import create_model, model_inputs
from feddg.numerics import adam
from feddg.tasks import Task


def train_images_per_second(
    name: str, image_size: int, channels: int = 3, batch: int = 32, seconds: float = 2.0, rounds: int = 3,
    options: Mapping[str, Any] | None = None,
) -> float:
    """Best-of-``rounds`` SGD training throughput (forward, loss, backward, step) on random data (classification
    models; ``options`` are model options)."""
    torch.manual_seed(0)
    model = create_model(name, num_classes=10, in_channels=channels, image_size=image_size, **(options or {})).train()
    if _dense_output(model, channels, image_size):
        raise ValueError(f"{name} gives dense [B, C, H, W] outputs (segmentation): time it with --feddg")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, channels, image_size, image_size), torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    best = 0.0
    for _ in range(rounds):
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            step()
            steps += 1
        best = max(best, batch * steps / elapsed)
    return best


def engine_seconds_per_round(cfg: ExperimentConfig) -> dict[str, float]:
    """Run ``cfg`` once in a scratch directory; mean and min wall time per round (round 1 excluded
    when there are more, since it pays for warm-up), plus the start-up time."""
    from feddg.experiment import run_experiment  # the whole stack; keep `feddg bench models` light

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_experiment(cfg, Path(tmp) / "run", progress=False)
        total = time.perf_counter() - t0
        rows = read_metrics(Path(tmp) / "run")
    per_round = [r["time_round_s"] for r in rows]
    steady = per_round[1:] if len(per_round) > 1 else per_round
    return {
        "rounds": len(per_round),
        "mean_round_s": float(np.mean(steady)),
        "min_round_s": float(np.min(steady)),
        "total_s": total,
        "overhead_s": total - float(np.sum(per_round)),
    }


def parse_model_spec(spec: str) -> tuple[str, int, dict[str, object]]:
    """``name[@size][:key=value...]`` (size 28 when left out; integer, float or string values) as
    ``(name, size, options)``: ``unet@64:width=8``."""
    head, *pairs = spec.strip().split(":")
    name, _, px = head.partition("@")
    options: dict[str, object] = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"{spec!r}: model options are key=value, got {pair!r}")
        value: object = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                pass
        options[key] = value
    size = ascii_int(px) if px else 28
    if size is None or size < 1:
        raise ValueError(f"{spec!r}: the size after @ is a positive whole number (pixels; tokens for text models), "
                         f"got {px!r}")
    return name, size, options


def _label(name: str, options: Mapping[str, Any]) -> str:
    return name + "".join(f" {k}={v}" for k, v in options.items())


def models_table(models: list[str], threads: int, seconds: float, batch: int = 32, repeats: int = 3) -> Table:
    """``feddg bench models``: training images/s of each ``model@size[:key=value...]`` (:func:`parse_model_spec`)
    with ``threads`` torch threads (the caller's restored after), best of ``repeats``."""
    specs = [parse_model_spec(m) for m in models]  # every spec read before anything is timed
    t = Table(title=f"training throughput, batch {batch}, {threads} torch threads")
    t.add_column("model")
    t.add_column("px", justify="right")
    t.add_column("img/s", justify="right")
    with compute_threads(threads):
        for name, px, options in specs:
            ips = train_images_per_second(name, px, batch=batch, seconds=seconds, rounds=repeats, options=options)
            t.add_row(_label(name, options), str(px), f"{ips:,.0f}")
    return t


LR, WEIGHT_DECAY = 1e-3, 5e-4  # Adam's, in both loops of :func:`loops_table`


@dataclass
class LoopBench:
    """One model's two loops on the same data: :meth:`feddg` runs ``train_local`` on ``dataset``'s batches of
    ``train_idx``; :meth:`plain` the same number of steps of a bare loop on ``x``, ``y`` (the same samples as
    tensors). Both start every run from ``start`` (the weights and BatchNorm statistics) with a fresh Adam."""

    model: nn.Module
    start: dict[str, Tensor]
    task: Task
    dataset: DomainDataset
    train_idx: np.ndarray
    x: Tensor | dict[str, Tensor]
    y: Tensor
    batch: int

    @property
    def steps(self) -> int:
        return len(self.train_idx) // self.batch

    def feddg(self, seed: int) -> float:
        """Wall seconds of feddg's client loop over ``train_idx`` (one local epoch)."""
        self.model.load_state_dict(self.start)
        ctx = ClientContext(client_id=0, round=0, dataset=self.dataset, train_idx=self.train_idx,
                            batch_size=self.batch, local_epochs=1,
                            optim=OptimSettings(name="adam", weight_decay=WEIGHT_DECAY),
                            generator=torch.Generator().manual_seed(seed), task=self.task)
        t0 = time.perf_counter()
        train_local(self.model, ctx, LR)
        return time.perf_counter() - t0

    def plain(self, seed: int) -> float:
        """Wall seconds of the yardstick: shuffled batches sliced from the tensors, forward, the task's loss,
        backward, Adam's step."""
        self.model.load_state_dict(self.start)
        model, loss_fn = self.model, self.task.loss
        t0 = time.perf_counter()
        model.train()
        opt = adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        order = torch.randperm(len(self.train_idx), generator=torch.Generator().manual_seed(seed)) % len(self.y)
        for idx in order.split(self.batch):
            opt.zero_grad(set_to_none=True)
            if isinstance(self.x, dict):  # transformers' own forward on the batch cut to its longest sequence
                longest = int(self.x["attention_mask"][idx].sum(1).max())
                ids, mask = self.x["input_ids"][idx, :longest], self.x["attention_mask"][idx, :longest]
                logits = model.hf(input_ids=ids, attention_mask=mask).logits  # type: ignore[operator]
            else:
                logits = model(self.x[idx])
            loss_fn(logits, self.y[idx]).backward()
            opt.step()
        return time.perf_counter() - t0

    @property
    def units(self) -> tuple[str, float]:
        """What one epoch over ``train_idx`` processes: its images, or (text) its non-padding tokens."""
        if isinstance(self.x, dict):
            tokens = self.x["attention_mask"].sum(1)[torch.from_numpy(self.train_idx) % len(self.y)]
            return "tokens", float(tokens.sum())
        return "img", float(len(self.train_idx))


def _dense_output(model: nn.Module, channels: int, image_size: int) -> bool:
    """Whether ``model`` gives dense ``[B, C, H, W]`` logits (a segmentation model) rather than ``[B, C]``."""
    model.eval()
    with torch.no_grad():
        out = model(torch.zeros(2, channels, image_size, image_size))
    model.train()
    return out.dim() == 4


def loop_bench(name: str, image_size: int, batch: int, steps: int, options: Mapping[str, Any] | None = None,
               channels: int = 3) -> LoopBench:
    """:class:`LoopBench` of model ``name`` on ``steps`` batches: ``synthetic-mri`` slices at ``image_size`` with the
    segmentation task for a model with dense outputs, else random uint8 images of 10 classes with classification.
    ``train_idx`` cycles through the first ``min(N, steps × batch)`` samples; the tensors hold those, normalised."""
    from feddg.data import load_dataset
    from feddg.data.tensor_dataset import TensorDomainDataset
    from feddg.tasks import make_task

    if model_inputs(name) == "tokens":
        return _text_loop_bench(name, image_size, batch, steps, options)
    torch.manual_seed(0)
    probe = create_model(name, num_classes=2, in_channels=channels, image_size=image_size, **(options or {}))
    dataset: DomainDataset
    if _dense_output(probe, channels, image_size):
        dataset, classes, task_name = load_dataset("synthetic-mri", image_size=image_size), 2, "segmentation"
        model = probe
    else:
        rng = np.random.default_rng(0)
        n = min(steps * batch, 4096)
        images = rng.integers(0, 256, size=(n, channels, image_size, image_size), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).astype(np.int64)
        dataset = TensorDomainDataset.from_parts("random", [(images, labels)], ["random"],
                                                 [str(c) for c in range(10)], [0.5] * channels, [0.25] * channels)
        classes, task_name = 10, "classification"
        torch.manual_seed(0)
        model = create_model(name, num_classes=classes, in_channels=channels, image_size=image_size,
                             **(options or {}))
    used = np.arange(min(len(dataset), steps * batch))
    x, y = dataset.get_batch(used, train=False)
    assert isinstance(x, Tensor)  # image models
    start = {k: v.clone() for k, v in model.state_dict().items()}
    return LoopBench(model.train(), start, make_task(task_name, classes), dataset, np.resize(used, steps * batch),
                     x, y, batch)


def _text_loop_bench(name: str, max_length: int, batch: int, steps: int,
                     options: Mapping[str, Any] | None) -> LoopBench:
    """:class:`LoopBench` of text model ``name`` on the built-in ``synthetic-sentiment`` reviews, tokenised to at most
    ``max_length`` tokens (the spec's ``@N``); the yardstick's tensors are padded to the longest review and each of
    its batches is cut to its own longest, as the dataset's batches are."""
    from feddg.data import load_dataset
    from feddg.tasks import make_task

    dataset = load_dataset("synthetic-sentiment", max_length=max_length)
    torch.manual_seed(0)
    model = create_model(name, num_classes=2, **dataset.model_args(), **(options or {}))
    used = np.arange(min(len(dataset), steps * batch))
    x, y = dataset.get_batch(used, train=False)
    assert isinstance(x, dict)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    return LoopBench(model.train(), start, make_task("classification", 2), dataset, np.resize(used, steps * batch),
                     x, y, batch)


def _calibrated_steps(name: str, image_size: int, batch: int, seconds: float,
                      options: Mapping[str, Any] | None) -> int:
    """Steps that take the plain loop about ``seconds`` (from a short timed run after a warm-up)."""
    probe = loop_bench(name, image_size, batch, 3, options)
    probe.plain(0)
    per_step = probe.plain(1) / probe.steps
    return max(2, round(seconds / per_step))


def time_loops(bench: LoopBench, repeats: int) -> dict[str, list[float]]:
    """Seconds of each loop over ``repeats`` interleaved runs (feddg, plain, feddg, plain, ...), after one untimed
    run of each."""
    loops: dict[str, Callable[[int], float]] = {"feddg train_local": bench.feddg, "plain PyTorch": bench.plain}
    for run in loops.values():
        run(0)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for r in range(repeats):
        for name, run in loops.items():
            times[name].append(run(r + 1))
    return times


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def loops_table(models: list[str], threads: int, seconds: float, batch: int = 32, repeats: int = 3,
                steps: int = 0) -> Table:
    """``feddg bench models --feddg``: images/s of feddg's client loop and of the plain PyTorch loop of each
    ``model@size[:key=value...]`` on the same data (:class:`LoopBench`), ``repeats`` interleaved runs of ``steps``
    batches each (0: as many as take the plain loop about ``seconds``), with ``threads`` torch threads; best
    (from the minimum time) and median images/s and feddg / plain of each; the load average in the caption. The
    caller's thread counts are restored after."""
    specs = [parse_model_spec(m) for m in models]
    before = load_average()
    rows = []
    with compute_threads(threads):
        for name, px, options in specs:
            n = steps or _calibrated_steps(name, px, batch, seconds, options)
            bench = loop_bench(name, px, batch, n, options)
            rows.append((name, px, options, bench.task.name, n, time_loops(bench, repeats), bench.units))
    shown = ", ".join(f"{_label(name, options)} @ {px} px" for name, px, options in specs)
    t = Table(title=f"training throughput, feddg's client loop vs a plain PyTorch loop: {shown}; batch {batch}, "
              f"Adam, {threads} torch threads, {repeats} interleaved repeats",
              caption=f"load average before: {before}; after: {load_average()}")
    for col in ("model", "px / tokens", "task", "steps", "loop", "per s (best)", "per s (median)",
                "× plain (best, median)"):
        t.add_column(col, justify="left" if col in ("model", "task", "loop") else "right")
    for name, px, options, task, n, times, (unit, amount) in rows:
        best = {k: amount / min(v) for k, v in times.items()}
        median = {k: amount / statistics.median(v) for k, v in times.items()}
        (fed, *_), plain = times, "plain PyTorch"
        for loop in times:
            ratio = f"{best[fed] / best[plain]:.2f}, {median[fed] / median[plain]:.2f}" if loop == fed else ""
            t.add_row(_label(name, options), str(px), task, str(n), loop, f"{best[loop]:,.0f} {unit}",
                      f"{median[loop]:,.0f} {unit}", ratio)
    return t


#: ``feddg bench engine``'s engines: the overrides that select each
ENGINE_VARIANTS = {
    "sequential": ["federation.engine=inprocess", "federation.workers=1"],
    "workers": ["federation.engine=inprocess", "federation.workers=auto"],
    "flower": ["federation.engine=flower"],
}


def engine_table(config: Path, overrides: list[str], engines: list[str]) -> Table:
    """``feddg bench engine``: seconds per round of ``config`` on each of ``engines`` (``ValueError`` for an
    engine not in :data:`ENGINE_VARIANTS`, before anything runs)."""
    unknown = [e for e in engines if e not in ENGINE_VARIANTS]
    if unknown:
        raise ValueError(f"unknown engine {unknown[0]!r}; expected one of {sorted(ENGINE_VARIANTS)}")
    t = Table(title=f"seconds per round: {config}")
    for col in ("engine", "rounds", "mean s/round", "min s/round", "start-up s", "total s"):
        t.add_column(col, justify="right" if col != "engine" else "left")
    for engine in engines:
        cfg = load_config(config, overrides + ENGINE_VARIANTS[engine])
        r = engine_seconds_per_round(cfg)
        t.add_row(engine, str(r["rounds"]), f"{r['mean_round_s']:.2f}", f"{r['min_round_s']:.2f}",
                  f"{r['overhead_s']:.1f}", f"{r['total_s']:.1f}")
    return t
