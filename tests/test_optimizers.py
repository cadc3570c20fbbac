"""Local optimisers and schedules of the transformer recipe: AdamW, linear warm-up, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from feddg.algorithms.base import OptimSettings
from feddg.algorithms.components.local import make_optimizer, scaled_step
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
