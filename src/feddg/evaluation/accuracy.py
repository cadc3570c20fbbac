"""Accuracy of a model on index sets of a dataset, broken down by domain."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from feddg.data.base import DomainDataset

Predict = Callable[[nn.Module, Tensor], Tensor]


@torch.no_grad()
def correct_by_domain(
    model: nn.Module,
    dataset: DomainDataset,
    indices: np.ndarray,
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    predict: Predict | None = None,
) -> dict[int, tuple[int, int]]:
    """``{domain_id: (correct, total)}`` of ``model`` on ``indices`` (eval mode, no augmentation)."""
    model.eval()
    predict = predict or (lambda m, x: m(x))
    indices = np.asarray(indices, dtype=np.int64)
    correct = np.zeros(len(dataset.domains), dtype=np.int64)
    total = np.zeros(len(dataset.domains), dtype=np.int64)
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        x, y = dataset.get_batch(chunk, train=False)
        hit = (predict(model, x.to(device)).argmax(1).cpu() == y).numpy()
        dom = dataset.domain_ids[chunk]
        np.add.at(correct, dom, hit)
        np.add.at(total, dom, 1)
    return {d: (int(correct[d]), int(total[d])) for d in range(len(total)) if total[d] > 0}


def merge_counts(*counts: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Sum several ``{domain: (correct, total)}`` tallies."""
    out: dict[int, tuple[int, int]] = {}
    for c in counts:
        for d, (k, n) in c.items():
            k0, n0 = out.get(d, (0, 0))
            out[d] = (k0 + k, n0 + n)
    return out


def accuracy_metrics(counts: dict[int, tuple[int, int]], domains: list[str], prefix: str) -> dict[str, float]:
    """``{prefix/<domain>: acc, prefix: mean over domains}`` in percent."""
    per = {f"{prefix}/{domains[d]}": 100.0 * k / n for d, (k, n) in sorted(counts.items())}
    if per:
        per[prefix] = float(np.mean(list(per.values())))
    return per
