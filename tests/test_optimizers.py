"""Local optimisers and schedules of the transformer recipe: AdamW, linear warm-up, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from toy import ToyNet

from feddg.algorithms.base import OptimSettings
from feddg.algorithms.components.local import make_optimizer, scaled_step, trainable
from feddg.federation.rounds import learning_rate


def test_warmup_ramps_linearly_then_the_schedule_runs_over_the_remaining_rounds():
    lrs = [learning_rate(0.1, "cosine", r, 12, warmup=3) for r in range(1, 13)]
    assert lrs[:3] == pytest.approx([0.025, 0.05, 0.075])  # r / (k + 1)
    assert lrs[3] == pytest.approx(0.1)  # the cosine's first round, over 12 − 3 = 9 rounds
    assert lrs[7] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    assert learning_rate(0.1, "step", 13, 30, step_size=10, gamma=0.5, warmup=3) == pytest.approx(0.1)
    assert learning_rate(0.1, "step", 14, 30, step_size=10, gamma=0.5, warmup=3) == pytest.approx(0.05)
    assert learning_rate(0.1, "constant", 2, 5) == 0.1  # no warm-up: unchanged


def test_adamw_decays_the_weights_decoupled_and_uses_momentum_as_beta1():
    w = nn.Parameter(torch.tensor([2.0]))
    opt = make_optimizer([w], OptimSettings(name="adamw", momentum=0.8, weight_decay=0.5), lr=0.1)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["betas"] == (0.8, 0.999)
    w.grad = torch.zeros(1)  # no gradient: only the decoupled decay moves it, w ← w (1 − lr·wd)
    opt.step()
    assert float(w) == pytest.approx(2.0 * (1 - 0.1 * 0.5))
    adam = make_optimizer([nn.Parameter(torch.ones(1))], OptimSettings(name="adam", momentum=0.9), lr=0.1)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["betas"] == (0.9, 0.999)


def test_sgd_applies_momentum_and_l2_weight_decay():
    w = nn.Parameter(torch.tensor([1.0]))
    opt = make_optimizer([w], OptimSettings(name="sgd", momentum=0.9, weight_decay=0.1), lr=0.1)
    for _ in range(2):
        w.grad = torch.ones(1)
        opt.step()
    # d = g + wd·w; buf ← 0.9 buf + d; w ← w − lr buf:  d1 = 1.1, w1 = 0.89;  d2 = 1.089, buf2 = 2.079, w2 = 0.6821
    assert float(w) == pytest.approx(0.6821)


def test_adam_weight_decay_is_l2_through_the_adaptive_step():
    w = nn.Parameter(torch.tensor([2.0]))
    opt = make_optimizer([w], OptimSettings(name="adam", momentum=0.9, weight_decay=0.5), lr=0.1)
    w.grad = torch.zeros(1)  # the decay term wd·w is the whole gradient, normalised: w ← w − lr
    opt.step()
    assert float(w) == pytest.approx(2.0 - 0.1, rel=1e-6)


@pytest.mark.parametrize("clip, expected", [(None, [3.0, 4.0]), (1.0, [0.6, 0.8]), (10.0, [3.0, 4.0])])
def test_gradient_clipping_bounds_the_global_norm_of_the_step(clip, expected):
    w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    loss = -(w * torch.tensor([3.0, 4.0])).sum()  # gradient (−3, −4), norm 5
    scaled_step(loss, opt, torch.amp.GradScaler("cpu", enabled=False), clip=clip)
    assert w.detach().tolist() == pytest.approx(expected)


def test_the_config_accepts_the_recipe_and_refuses_bad_values():
    from feddg.config import ConfigError, build_config

    cfg = build_config({}, ["optim.name=adamw", "optim.warmup_rounds=2", "optim.grad_clip=1.0"])
    assert (cfg.optim.name, cfg.optim.warmup_rounds, cfg.optim.grad_clip) == ("adamw", 2, 1.0)
    for bad in ("optim.grad_clip=0", "optim.warmup_rounds=-1", "optim.momentum=1.0"):
        with pytest.raises(ConfigError):
            build_config({}, [bad])


def test_edited_gradients_are_clipped_and_the_step_is_reported():
    w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    loss = -(w * torch.tensor([3.0, 0.0])).sum()  # gradient (−3, 0)

    def edit() -> None:  # adds (0, −4): the edited gradient (−3, −4) has norm 5
        assert w.grad is not None
        w.grad += torch.tensor([0.0, -4.0])

    assert scaled_step(loss, opt, torch.amp.GradScaler("cpu", enabled=False), edit, clip=1.0) is True
    assert w.detach().tolist() == pytest.approx([0.6, 0.8])  # clipped after the edit: (3, 4) / 5


def test_an_overflowing_fp16_step_is_skipped_and_reported():
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    assert scaled_step((w * float("inf")).sum(), opt, scaler) is False  # inf gradients: no step, scale backed off
    assert w.detach().tolist() == [1.0, 1.0] and scaler.get_scale() == 2.0**15
    opt.zero_grad()
    assert scaled_step(w.sum(), opt, scaler) is True
    assert w.detach().tolist() == pytest.approx([0.0, 0.0])


def test_single_sample_batches_are_skipped_only_under_batchnorm():
    batches = [(torch.randn(1, 1, 6, 6), torch.tensor([0])), (torch.randn(2, 1, 6, 6), torch.tensor([1, 2]))]
    assert [len(y) for _, y in trainable(ToyNet(), batches)] == [2]  # ToyNet has BatchNorm
    assert [len(y) for _, y in trainable(nn.Linear(36, 4), batches)] == [1, 2]
