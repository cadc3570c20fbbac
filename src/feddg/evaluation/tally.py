"""A model's per-domain tallies on index sets of a dataset (one pass, any task), and the metrics from them.

Tallies are the task's additive sufficient statistics (``feddg.tasks``), ``[num_domains, ...]``: the tally of a
union of index sets is the sum of theirs, so a figure does not depend on how evaluation was split (where a
sample's output does not depend on its batch: FedBN's ``unseen_bn: target`` normalises with the batch's statistics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn

from feddg.data.base import DomainDataset
from feddg.devices import Inputs, autocast, to_device
from feddg.tasks import Task, metric_key

Predict = Callable[[nn.Module, Inputs], Tensor]


def batch_outputs(
    model: nn.Module,
    dataset: DomainDataset,
    indices: np.ndarray,
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    predict: Predict | None = None,
    amp: str = "off",
    channels_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor, np.ndarray]]:
    """``(output, target, indices)`` of each evaluation batch of ``indices``: eval mode, no augmentation, under
    :func:`~feddg.devices.autocast` with ``amp`` (the caller holds ``torch.no_grad``)."""
    model.eval()
    predict = predict or (lambda m, x: m(x))
    indices = np.asarray(indices, dtype=np.int64)
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        x, y = dataset.get_batch(chunk, train=False)
        with autocast(device, amp):
            output = predict(model, to_device(x, device, channels_last))
        yield output, y, chunk


@torch.no_grad()
def tally_by_domain(
    model: nn.Module,
    dataset: DomainDataset,
    indices: np.ndarray,
    task: Task,
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    predict: Predict | None = None,
    amp: str = "off",
    channels_last: bool = False,
) -> np.ndarray:
    """The task's tally of ``model`` on ``indices`` per domain, ``[len(dataset.domains), ...]``, in one pass (eval
    mode, no augmentation, under :func:`~feddg.devices.autocast` with ``amp``)."""
    total: np.ndarray | None = None
    for output, y, chunk in batch_outputs(model, dataset, indices, batch_size=batch_size, device=device,
                                          predict=predict, amp=amp, channels_last=channels_last):
        part = task.tally(output, y, dataset.domain_ids[chunk], len(dataset.domains))
        total = part if total is None else total + part
    return total if total is not None else task.tally_zeros(len(dataset.domains))


def domain_metrics(task: Task, tally: np.ndarray, domains: list[str], role: str) -> dict[str, float]:
    """``{<role>_<metric>/<domain>: score, <role>_<metric>: mean over the domains}`` for the domains with samples."""
    per = {metric_key(role, task.metric, domains[d]): task.score(tally[d])
           for d in range(len(tally)) if task.count(tally[d]) > 0}
    if per:
        per[metric_key(role, task.metric)] = float(np.mean(list(per.values())))
    return per

