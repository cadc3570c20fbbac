"""Classification: cross-entropy, accuracy from per-domain (correct, total) tallies."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from feddg.tasks.base import CLASS_LABELS, Task


class Classification(Task):
    """One class per sample: ``F.cross_entropy`` (hard labels, or class probabilities after label mixing);
    accuracy = 100 · correct / total, chance 100 / classes."""

    name = "classification"
    metric = "acc"
    label = "accuracy"
    targets: ClassVar[frozenset[str]] = frozenset({CLASS_LABELS})

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def tally_zeros(self, num_domains: int) -> np.ndarray:
        return np.zeros((num_domains, 2), dtype=np.int64)

    def tally(self, output: Tensor, target: Tensor, domains: np.ndarray, num_domains: int) -> np.ndarray:
        """``[num_domains, 2]``: correct predictions (argmax) and samples, per domain."""
        hit = (output.argmax(1).cpu() == target.cpu()).numpy()
        out = self.tally_zeros(num_domains)
        np.add.at(out[:, 0], domains, hit)
        np.add.at(out[:, 1], domains, 1)
        return out

    def score(self, tally: np.ndarray) -> float:
        return 100.0 * int(tally[0]) / int(tally[1])

    def count(self, tally: np.ndarray) -> int:
        return int(tally[1])

    def chance(self) -> float:
        return 100.0 / self.num_classes
