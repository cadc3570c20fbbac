"""Local optimisers and schedules of the transformer recipe: AdamW, linear warm-up, gradient clipping."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from toy import ToyDomains, ToyNet, assert_reply_weights, toy_federation

from feddg.algorithms.base import OptimSettings
from feddg.algorithms.components.local import (
    grad_scaler,
    gradient_batches,
    make_optimizer,
    scaled_step,
    train_steps,
    trainable,
)
from feddg.federation.client import client_context
from feddg.federation.rounds import learning_rate
from feddg.messages import load_weights, weights_of


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
    assert float(w.detach()) == pytest.approx(2.0 * (1 - 0.1 * 0.5))
    adam = make_optimizer([nn.Parameter(torch.ones(1))], OptimSettings(name="adam", momentum=0.9), lr=0.1)
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="unknown optimiser 'rmsprop'"):
        make_optimizer([w], OptimSettings(name="rmsprop"), lr=0.1)


def test_sgd_applies_momentum_and_l2_weight_decay():
    w = nn.Parameter(torch.tensor([1.0]))
    opt = make_optimizer([w], OptimSettings(name="sgd", momentum=0.9, weight_decay=0.1), lr=0.1)
    for _ in range(2):
        w.grad = torch.ones(1)
        opt.step()
    # d = g + wd·w; buf ← 0.9 buf + d; w ← w − lr buf:  d1 = 1.1, w1 = 0.89;  d2 = 1.089, buf2 = 2.079, w2 = 0.6821
    assert float(w.detach()) == pytest.approx(0.6821)


def test_adam_weight_decay_is_l2_through_the_adaptive_step():
    w = nn.Parameter(torch.tensor([2.0]))
    opt = make_optimizer([w], OptimSettings(name="adam", momentum=0.9, weight_decay=0.5), lr=0.1)
    w.grad = torch.zeros(1)  # the decay term wd·w is the whole gradient, normalised: w ← w − lr
    opt.step()
    assert float(w.detach()) == pytest.approx(2.0 - 0.1, rel=1e-6)


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
    assert [len(y) for _, y in trainable(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36)), batches)] == [2]
    assert [len(y) for _, y in trainable(nn.Linear(36, 4), batches)] == [1, 2]


def test_under_fp16_loss_scaling_the_edit_and_the_clip_see_the_true_gradients() -> None:
    w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    seen: list[list[float]] = []

    def edit() -> None:  # records the gradient it is handed, then adds (0, −4)
        assert w.grad is not None
        seen.append(w.grad.tolist())
        w.grad += torch.tensor([0.0, -4.0])

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert scaled_step(-(w * torch.tensor([3.0, 0.0])).sum(), opt, scaler, edit, clip=1.0) is True
    assert seen == [[-3.0, 0.0]]  # the loss scale 2^10 already divided out
    assert w.detach().tolist() == pytest.approx([0.6, 0.8])  # (3, 4) / 5: the edit was not divided by the scale


@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_only_fp16_gets_a_loss_scaler(amp: str) -> None:
    ctx = client_context(toy_federation(), 0, 1)
    assert grad_scaler(replace(ctx, optim=replace(ctx.optim, amp=amp))).is_enabled() == (amp == "fp16")


def test_train_steps_are_sgd_on_the_given_loss_with_edited_then_clipped_gradients_and_report_the_mean_loss() -> None:
    """Two epochs of ``train_steps`` against the loop written here on a twin client stream: in training mode (ToyNet's
    BatchNorm on batch statistics), w ← w − lr·clip(∇loss_fn + edit), returning the mean batch loss and the steps."""
    lr, clip, shift = 0.1, 1.0, 0.05
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", f"optim.grad_clip={clip}",
                         "federation.local_epochs=2")
    start = weights_of(fed.model)
    params = list(fed.model.parameters())

    def loss_fn(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:  # not the task's loss alone
        return F.cross_entropy(m(x), y) + 0.01 * sum((p**2).sum() for p in m.parameters())

    def edit() -> None:
        for p in params:
            assert p.grad is not None
            p.grad += shift

    mean_loss, steps = train_steps(fed.model, client_context(fed, 0, 1), lr, loss_fn, edit)
    trained = weights_of(fed.model)

    load_weights(fed.model, start)
    fed.model.train()
    ref = client_context(fed, 0, 1)
    losses: list[float] = []
    norms: list[float] = []
    for _ in range(2):
        for x, y in ref.batches():
            loss = loss_fn(fed.model, x, y)
            grads = [g + shift for g in torch.autograd.grad(loss, params)]
            norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(lr * g * min(1.0, clip / (norm + 1e-6)))  # clip_grad_norm_'s factor
            losses.append(float(loss.detach()))
            norms.append(norm)
    assert max(norms) > clip  # the clip bound the steps
    assert steps == len(losses) == 8  # 54 examples in batches of 16: 4 a epoch
    assert mean_loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert_reply_weights(trained, weights_of(fed.model), start, rtol=1e-5)


def test_a_client_of_only_single_sample_batches_is_refused_under_batchnorm_and_trained_without() -> None:
    fed = toy_federation()
    ctx = client_context(fed, 0, 1)
    one = replace(ctx, train_idx=ctx.train_idx[:1])
    with pytest.raises(ValueError, match="nothing to train on"):
        train_steps(fed.model, one, 0.1)  # ToyNet has BatchNorm
    assert train_steps(nn.Sequential(nn.Flatten(), nn.Linear(36, 4)), one, 0.1)[1] == 1


def test_gradient_batches_are_the_clients_examples_in_order_and_draw_nothing() -> None:
    fed = toy_federation()
    ctx = client_context(fed, 0, 1)
    state = ctx.generator.get_state()
    ds, idx, b = fed.dataset, ctx.train_idx, ctx.batch_size
    assert isinstance(ds, ToyDomains)
    got = list(gradient_batches(fed.model, ctx))
    starts = range(0, len(idx), b)
    assert len(got) == len(starts) == 4  # 54 examples: 16, 16, 16, 6
    for (x, y), s in zip(got, starts, strict=True):
        assert torch.equal(x, ds.x[idx[s : s + b]]) and y.tolist() == ds.labels[idx[s : s + b]].tolist()
    assert torch.equal(ctx.generator.get_state(), state)
