"""Issue 29's per-client set-up cut changes no result: local_batches without optim.augment builds no Augmenter
and draws nothing from the client's generator beyond its batches' shuffles."""

from types import SimpleNamespace

import torch
from torch import nn

from feddg.algorithms.components.local import local_batches


def _ctx(seed: int) -> SimpleNamespace:
    """The context fields local_batches reads: 10 samples in batches of 4 (4, 4, 2), shuffled by the generator."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(10, 1, 6, 6, generator=torch.Generator().manual_seed(0)), torch.arange(10) % 4

    def batches():
        order = torch.randperm(10, generator=g)
        return [(x[order[i:i + 4]], y[order[i:i + 4]]) for i in range(0, 10, 4)]

    return SimpleNamespace(optim=SimpleNamespace(augment=[]), generator=g, local_epochs=2, batches=batches,
                           task=SimpleNamespace(num_classes=4))


def test_local_batches_without_augment_are_the_contexts_batches_and_draw_nothing_more():
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 4), nn.BatchNorm1d(4))
    ctx, ref = _ctx(7), _ctx(7)
    got = list(local_batches(model, ctx))
    want = [(e, x, y) for e in range(2) for x, y in ref.batches()]
    assert [len(y) for _, _, y in want] == [4, 4, 2] * 2
    assert len(got) == len(want) == 6
    for (e, x, y), (e2, x2, y2) in zip(got, want, strict=True):
        assert e == e2 and torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(ctx.generator.get_state(), ref.generator.get_state())
