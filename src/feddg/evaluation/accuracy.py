"""Accuracy of a model on index sets of a dataset, broken down by domain; the device placement and mixed
precision that evaluation and the local training loop share."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from feddg.data.base import DomainDataset

Predict = Callable[[nn.Module, Tensor], Tensor]

#: ``optim.amp`` -> autocast dtype
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device | str, amp: str = "off") -> torch.autocast:
    """``torch.autocast`` on ``device``'s type with ``amp``'s dtype (bf16 | fp16); disabled for ``off``."""
    if amp != "off" and amp not in AMP_DTYPES:
        raise ValueError(f"unknown amp {amp!r}; expected off, bf16 or fp16")
    return torch.autocast(torch.device(device).type, dtype=AMP_DTYPES.get(amp, torch.bfloat16), enabled=amp != "off")


def to_device(x: Tensor, device: torch.device | str, channels_last: bool = False) -> Tensor:
    """``x`` on ``device``; an image batch (4-d) in ``torch.channels_last`` format when asked."""
    fmt = torch.channels_last if channels_last and x.dim() == 4 else torch.preserve_format
    return x.to(device, non_blocking=True, memory_format=fmt)


@torch.no_grad()
def correct_by_domain(
    model: nn.Module,
    dataset: DomainDataset,
    indices: np.ndarray,
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    predict: Predict | None = None,
    amp: str = "off",
    channels_last: bool = False,
) -> dict[int, tuple[int, int]]:
    """``{domain_id: (correct, total)}`` of ``model`` on ``indices`` (eval mode, no augmentation), under
    :func:`autocast` with ``amp``."""
    model.eval()
    predict = predict or (lambda m, x: m(x))
    indices = np.asarray(indices, dtype=np.int64)
    correct = np.zeros(len(dataset.domains), dtype=np.int64)
    total = np.zeros(len(dataset.domains), dtype=np.int64)
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        x, y = dataset.get_batch(chunk, train=False)
        with autocast(device, amp):
            logits = predict(model, to_device(x, device, channels_last))
        hit = (logits.argmax(1).cpu() == y).numpy()
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
