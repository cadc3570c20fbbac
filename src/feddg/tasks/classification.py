"""Classification: cross-entropy, accuracy from per-domain (correct, total) tallies; macro-F1 (WILDS' IWildCam
metric) from the same tallies' per-class counts."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from feddg.tasks.base import CLASS_LABELS, Task


class Classification(Task):
    """One class per sample: ``F.cross_entropy`` (hard labels, or class probabilities after label mixing);
    accuracy = 100 · correct / total, chance 100 / classes. The tally also counts, per class, the correct
    predictions, the samples and the predictions, for the per-class view."""

    name = "classification"
    metric = "acc"
    label = "accuracy"
    targets: ClassVar[frozenset[str]] = frozenset({CLASS_LABELS})
    offers: ClassVar[tuple[str, ...]] = ("macro_f1",)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def tally_zeros(self, num_domains: int) -> np.ndarray:
        return np.zeros((num_domains, 2 + 3 * self.num_classes), dtype=np.int64)

    def tally(self, output: Tensor, target: Tensor, domains: np.ndarray, num_domains: int) -> np.ndarray:
        """``[num_domains, 2 + 3C]``: correct predictions (argmax) and samples, then per class the correct
        predictions, the samples and the predictions, per domain."""
        pred, y = output.argmax(1).cpu().numpy(), target.cpu().numpy()
        hit = pred == y
        c = self.num_classes
        out = self.tally_zeros(num_domains)
        np.add.at(out[:, 0], domains, hit)
        np.add.at(out[:, 1], domains, 1)
        np.add.at(out, (domains, 2 + y), hit)
        np.add.at(out, (domains, 2 + c + y), 1)
        np.add.at(out, (domains, 2 + 2 * c + pred), 1)
        return out

    def score(self, tally: np.ndarray) -> float:
        return 100.0 * int(tally[0]) / int(tally[1])

    def count(self, tally: np.ndarray) -> int:
        return int(tally[1])

    def chance(self) -> float:
        return 100.0 / self.num_classes

    def extra_score(self, name: str, tally: np.ndarray) -> float:
        """``macro_f1``: 100 · the mean over the classes with samples in the tally of F1_k = 2·TP_k / (T_k + P_k)
        (T_k samples of class k, P_k predictions of it): scikit-learn's ``f1_score(average="macro",
        labels=unique(y_true))``, as WILDS scores IWildCam (Koh et al. 2021)."""
        if name != "macro_f1":
            return super().extra_score(name, tally)
        c = self.num_classes
        hits, true, predicted = tally[2 : 2 + c], tally[2 + c : 2 + 2 * c], tally[2 + 2 * c :]
        present = true > 0
        return 100.0 * float(np.mean(2 * hits[present] / (true[present] + predicted[present])))

    def class_view(self, tally: np.ndarray) -> dict[str, list[float | None]]:
        """Each class's recall (``None`` without samples) and its share of the predictions, in %."""
        c, n = self.num_classes, max(int(tally[1]), 1)
        correct, true, predicted = tally[2 : 2 + c], tally[2 + c : 2 + 2 * c], tally[2 + 2 * c :]
        return {"recall": [100.0 * int(k) / int(t) if t else None for k, t in zip(correct, true, strict=True)],
                "predicted": [100.0 * int(p) / n for p in predicted]}
