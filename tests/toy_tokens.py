"""Hand-made token batches (right padding with pad id 1) and a tiny in-memory token dataset, standing in for
``data/text.py``'s TokenDataset in the transformer tests."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from feddg.data.base import DomainDataset

VOCAB, MAX_LENGTH, PAD = 40, 12, 1


def token_batch(lengths: list[int], width: int | None = None, seed: int = 0) -> dict[str, Tensor]:
    """Random ids in [5, VOCAB) (ids 0..4 are the special tokens), ``<s>`` (0) first, right-padded with PAD to
    ``width`` (default: the longest)."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, VOCAB, (n,), generator=g)
        ids[i, 0] = 0
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def padded(x: dict[str, Tensor], extra: int) -> dict[str, Tensor]:
    """``x`` with ``extra`` more padding columns."""
    ids = torch.cat([x["input_ids"], torch.full((len(x["input_ids"]), extra), PAD)], 1)
    return {"input_ids": ids, "attention_mask": torch.cat([x["attention_mask"], torch.zeros_like(ids[:, :extra])], 1)}


class ToyTokens(DomainDataset):
    """``n`` random token sequences of 3..MAX_LENGTH tokens; label 1 where token 7 occurs."""

    name = "toy-token-data"
    inputs = "tokens"

    def __init__(self, n: int = 12) -> None:
        rng = np.random.default_rng(0)
        self.lengths = rng.integers(3, MAX_LENGTH + 1, n).tolist()
        batch = token_batch(self.lengths, MAX_LENGTH)
        self.ids, self.mask = batch["input_ids"], batch["attention_mask"]
        self.labels = (self.ids == 7).any(1).numpy().astype(np.int64)
        self.domain_ids = np.zeros(n, dtype=np.int64)
        self.domains, self.classes = ["a"], ["neg", "pos"]
        self.image_shape = (1, 1, MAX_LENGTH)

    def get_batch(self, indices, train, generator=None):
        idx = torch.as_tensor(np.asarray(indices))
        width = int(self.mask[idx].sum(1).max())  # the batch's longest sequence
        x = {"input_ids": self.ids[idx, :width], "attention_mask": self.mask[idx, :width]}
        return x, torch.as_tensor(self.labels[idx])
