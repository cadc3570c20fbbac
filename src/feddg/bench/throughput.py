"""Benchmarks behind ``feddg bench``: model throughput and engine wall time per round.

Numbers go into docs/benchmarks.md together with the command that produced them; no test
asserts a speed.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from feddg.config import ExperimentConfig
from feddg.evaluation.plots import read_metrics
from feddg.models import create_model


def train_images_per_second(
    name: str, image_size: int, channels: int = 3, batch: int = 32, seconds: float = 2.0, rounds: int = 3
) -> float:
    """Best-of-``rounds`` SGD training throughput (forward, loss, backward, step) on random data."""
    torch.manual_seed(0)
    model = create_model(name, num_classes=10, in_channels=channels, image_size=image_size).train()
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
