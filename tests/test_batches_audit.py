"""``iterate_batches`` and ``DomainDataset``'s helpers, from a mutation audit of data/base.py: the last partial
batch, which passes draw a per-batch seed, where batches are built (DataLoader workers for evaluation and seeded
training, never from a daemonic process), and the unknown-domain refusal."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feddg.data import base
from feddg.data.base import DomainDataset, iterate_batches


class Recorder(DomainDataset):
    """Ten samples of two domains; a batch is ``(indices, pid of the process that built it)``."""

    name, domains, classes, image_shape = "rec", ["a", "b"], ["x"], (1, 1, 1)

    def __init__(self, seeded: bool = False, workers: int = 0) -> None:
        self.labels, self.domain_ids = np.zeros(10, np.int64), np.repeat([0, 1], 5)
        self.seeded_batches, self.loader_workers = seeded, workers

    def get_batch(self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.asarray(indices)), torch.tensor(os.getpid())


def _sizes(**kw: object) -> list[int]:
    return [len(x) for x, _ in iterate_batches(Recorder(), np.arange(10), 4, shuffle=False, train=True, **kw)]


def test_the_last_partial_batch_is_kept_unless_drop_last() -> None:
    assert _sizes() == [4, 4, 2] and _sizes(drop_last=True) == [4, 4]


def test_an_evaluation_pass_draws_no_seed_from_the_callers_generator() -> None:
    """Only a training pass of a ``seeded_batches`` dataset takes a number from the generator (its batches' seed):
    evaluation leaves the caller's stream where it was, so training draws after it are unchanged."""
    for train, moved in ((False, False), (True, True)):
        g = torch.Generator().manual_seed(0)
        before = g.get_state()
        list(iterate_batches(Recorder(seeded=True), np.arange(10), 4, shuffle=False, train=train, generator=g))
        assert (not torch.equal(g.get_state(), before)) is moved


@pytest.mark.parametrize(("seeded", "train", "in_worker"), [(False, False, True), (True, True, True),
                                                              (False, True, False)])
def test_batches_come_from_loader_workers_for_evaluation_and_seeded_training(seeded: bool, train: bool,
                                                                            in_worker: bool) -> None:
    """With ``loader_workers`` a pass is built in DataLoader processes where that gives the same batches (evaluation,
    or per-batch seeds); unseeded training draws augmentation from the caller's generator, so it stays here."""
    pids = [int(p) for _, p in iterate_batches(Recorder(seeded, workers=1), np.arange(10), 4, shuffle=False,
                                               train=train, generator=torch.Generator().manual_seed(0))]
    assert len(pids) == 3 and all((p != os.getpid()) is in_worker for p in pids)


def test_a_daemonic_process_builds_its_batches_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker-pool client (a daemonic process) may not start DataLoader processes: its batches are built inline."""
    monkeypatch.setattr(base.mp, "current_process", lambda: SimpleNamespace(daemon=True))
    pids = [int(p) for _, p in iterate_batches(Recorder(workers=2), np.arange(10), 4, shuffle=False, train=False)]
    assert pids == [os.getpid()] * 3


def test_an_unknown_domain_is_refused_naming_the_domains() -> None:
    assert Recorder().domain_index("b") == 1
    with pytest.raises(ValueError, match=r"^unknown domain 'c' for rec; expected one of \['a', 'b'\]$"):
        Recorder().domain_index("c")
