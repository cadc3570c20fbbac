"""FedIIR: classifier-gradient penalty, the server's EMA mean, and what a client sends."""

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy import ToyDomains, ToyMLPHeadNet, assert_reply_is_sgd_steps, toy_federation

from feddg.algorithms import Reply
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.fediir import (
    BATCHES,
    GRAD_PREFIX,
    MEAN_PREFIX,
    FedIIR,
    FedIIRParams,
    batch_gradient_sum,
    ema_update,
    gradient_penalty,
)
from feddg.federation.client import client_context
from feddg.messages import weights_of


def test_penalty_is_the_squared_distance_to_the_mean_gradient():
    grads = (torch.tensor([[1.0, 2.0]]), torch.tensor([3.0]))
    mean = [torch.tensor([[0.0, 4.0]]), torch.tensor([1.0])]
    assert float(gradient_penalty(grads, mean)) == pytest.approx(1 + 4 + 4)


def test_ema_update_closed_form():
    out = ema_update({"w": np.array([2.0, 0.0])}, {"w": np.array([0.0, 4.0])}, 0.95)
    np.testing.assert_allclose(out["w"], [1.9, 0.2])


def test_batch_gradient_sum_adds_per_batch_classifier_gradients_and_keeps_bn_statistics():
    fed = toy_federation()
    model, ctx = fed.model, client_context(fed, 0, 1)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    got, batches = batch_gradient_sum(model, ctx, model.classifier)
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    expected = [torch.zeros_like(p) for p in model.classifier.parameters()]
    n = 0
    for x, y in ctx.batches(shuffle=False, train=False):
        model.train()
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.classifier.parameters()))
        expected = [e + g for e, g in zip(expected, grads)]
        n += 1
    assert batches == n == int(np.ceil(ctx.num_examples / 16))
    np.testing.assert_allclose(got["weight"], expected[0].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["bias"], expected[1].numpy(), rtol=1e-5, atol=1e-7)


def test_on_an_mlp_head_the_penalty_takes_its_last_linear_layer_unless_the_whole_head_is_asked_for():
    """The official code's classifier is one linear layer on the featurizer: on an AlexNet-like head the hidden
    layers and their BatchNorm are featurizer, not penalised (they were: 10.5 M parameters on AlexNet)."""
    model = ToyMLPHeadNet()
    last = FedIIR().server_init(model, None)["grad_mean"]
    assert {k: v.shape for k, v in last.items()} == {"weight": (4, 8), "bias": (4,)}
    whole = FedIIR(FedIIRParams(penalised="head")).server_init(model, None)["grad_mean"]
    assert set(whole) == {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"}


def test_the_gradient_pass_skips_a_single_sample_batch_under_batchnorm_as_training_does():
    fed = toy_federation()
    model, ctx = ToyMLPHeadNet(), client_context(fed, 0, 1)
    ctx = replace(ctx, batch_size=ctx.num_examples - 1)  # one full batch, then one sample (BatchNorm1d raises)
    got, batches = batch_gradient_sum(model, ctx, model.classifier[3])
    x, y = next(ctx.batches(shuffle=False, train=False))
    model.train()
    expected = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.classifier[3].parameters()))
    assert batches == 1
    np.testing.assert_allclose(got["weight"], expected[0].numpy(), rtol=1e-5, atol=1e-7)
    reply, _ = FedIIR().client_update(model, {**weights_of(model), **FedIIR().client_config(
        FedIIR().server_init(model, None), 0, 1), "lr": 0.1, "round": 1}, {}, ctx)
    assert reply[BATCHES] == 1 and reply[GRAD_PREFIX + "weight"].shape == (4, 8)


def test_server_folds_batch_weighted_client_gradients_into_the_ema():
    method = FedIIR(FedIIRParams(ema=0.9))
    old = {"weight": np.ones((2, 3), np.float32), "bias": np.zeros(2, np.float32)}
    state = {"weights": {"w/a": np.zeros(1, np.float32)}, "grad_mean": old}
    replies = [
        Reply(0, {"w/a": np.ones(1, np.float32), "num_examples": 10, GRAD_PREFIX + "weight": np.full((2, 3), 6.0),
                  GRAD_PREFIX + "bias": np.full(2, 2.0), BATCHES: 2}),
        Reply(1, {"w/a": np.ones(1, np.float32), "num_examples": 30, GRAD_PREFIX + "weight": np.full((2, 3), 2.0),
                  GRAD_PREFIX + "bias": np.full(2, 6.0), BATCHES: 2}),
    ]
    new, _ = method.aggregate(state, replies)
    np.testing.assert_allclose(new["grad_mean"]["weight"], 0.9 * 1 + 0.1 * (8 / 4))  # Σ sums / Σ batches
    np.testing.assert_allclose(new["grad_mean"]["bias"], 0.1 * 2.0)
    np.testing.assert_allclose(new["weights"]["w/a"], 1.0)


def test_zero_penalty_is_fedavg_and_a_positive_one_changes_training():
    fed = toy_federation()
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1}
    state = FedIIR().server_init(fed.model, None)
    iir_msg = {**msg, **FedIIR().client_config(state, 0, 1)}
    avg, _ = FedAvg().client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    zero, _ = FedIIR(FedIIRParams(penalty=0.0)).client_update(fed.model, dict(iir_msg), {}, client_context(fed, 0, 1))
    big, _ = FedIIR(FedIIRParams(penalty=1.0)).client_update(fed.model, dict(iir_msg), {}, client_context(fed, 0, 1))
    keys = [k for k in avg if k.startswith("w/")]
    assert all(np.allclose(avg[k], zero[k], atol=1e-6) for k in keys)
    assert max(float(np.abs(avg[k] - big[k]).max()) for k in keys) > 1e-3
    assert set(zero) == {*keys, GRAD_PREFIX + "weight", GRAD_PREFIX + "bias", BATCHES, "num_examples", "train_loss"}
    assert zero[GRAD_PREFIX + "weight"].shape == fed.model.classifier.weight.shape


def test_a_client_steps_on_the_loss_plus_its_distance_to_a_nonzero_mean_gradient() -> None:
    """One full batch, two epochs, plain SGD against a non-zero ``ḡ``: the reply is two steps on
    ``CE + γ Σ ‖∇_classifier CE − ḡ‖²`` rebuilt here with plain autograd (double backprop through the penalty)."""
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000")
    data = fed.dataset
    assert isinstance(data, ToyDomains)
    lr, gamma = 0.1, 0.5
    torch.manual_seed(0)
    mean = {"weight": 0.5 * torch.randn(4, 16), "bias": 0.5 * torch.randn(4)}
    msg = {**weights_of(fed.model), **{MEAN_PREFIX + k: v.numpy() for k, v in mean.items()}, "lr": lr, "round": 1}
    ctx = replace(client_context(fed, 0, 1), local_epochs=2)
    model = copy.deepcopy(fed.model).train()
    reply, _ = FedIIR(FedIIRParams(penalty=gamma)).client_update(fed.model, msg, {}, ctx)
    x, y = data.x[ctx.train_idx], torch.as_tensor(data.labels[ctx.train_idx])
    head = model.get_submodule("classifier")
    head_params = [head.get_parameter("weight"), head.get_parameter("bias")]

    def loss() -> torch.Tensor:
        ce = F.cross_entropy(model(x), y)
        head_grads = torch.autograd.grad(ce, head_params, create_graph=True)
        return ce + gamma * sum(((g - m) ** 2).sum() for g, m in zip(head_grads, mean.values(), strict=True))

    assert_reply_is_sgd_steps(reply, msg, model, loss, lr, steps=2)


def test_a_client_sends_the_classifier_gradients_at_the_model_it_received_not_the_trained_one() -> None:
    """The reply's ``grad/`` is Σ over the client's batches of ∇_classifier CE at the received weights (before
    training, in order, train mode), rebuilt here with plain autograd on a copy of the received model."""
    fed = toy_federation()
    model, ctx = copy.deepcopy(fed.model), client_context(fed, 0, 1)
    msg = {**weights_of(fed.model), **FedIIR().client_config(FedIIR().server_init(fed.model, None), 0, 1),
           "lr": 0.1, "round": 1}
    reply, _ = FedIIR(FedIIRParams(penalty=1.0)).client_update(fed.model, msg, {}, ctx)
    assert float(np.abs(reply["w/classifier.weight"] - msg["w/classifier.weight"]).max()) > 1e-3  # it trained
    params = list(model.classifier.parameters())
    expected = [torch.zeros_like(p) for p in params]
    model.train()
    batches = 0
    for x, y in ctx.batches(shuffle=False, train=False):
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        expected = [e + g for e, g in zip(expected, grads, strict=True)]
        batches += 1
    assert reply[BATCHES] == batches > 1
    np.testing.assert_allclose(reply[GRAD_PREFIX + "weight"], expected[0].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(reply[GRAD_PREFIX + "bias"], expected[1].numpy(), rtol=1e-5, atol=1e-7)


def test_a_round_without_any_client_batch_leaves_the_mean_gradient_unchanged() -> None:
    """Σ_k batches_k = 0: no gradient to fold (0/0), so ``ḡ`` stays; the weights are still FedAvg's."""
    old = {"weight": np.full((2, 3), 0.5, np.float32), "bias": np.ones(2, np.float32)}
    state = {"weights": {"w/a": np.zeros(1, np.float32)}, "grad_mean": old}
    replies = [Reply(k, {"w/a": np.full(1, 2.0, np.float32), "num_examples": 1, GRAD_PREFIX + "weight": np.zeros((2, 3)),
                         GRAD_PREFIX + "bias": np.zeros(2), BATCHES: 0}) for k in range(2)]
    new, _ = FedIIR(FedIIRParams(ema=0.9)).aggregate(state, replies)
    np.testing.assert_array_equal(new["grad_mean"]["weight"], 0.5)
    np.testing.assert_array_equal(new["grad_mean"]["bias"], 1.0)
    np.testing.assert_allclose(new["weights"]["w/a"], 2.0)


def test_defaults_are_the_official_codes() -> None:
    """γ = 1e-3 (the code's default for PACS), β = 0.95, and the one linear classifier (docs/methods/fediir.md)."""
    p = FedIIRParams()
    assert (p.penalty, p.ema, p.penalised) == (1e-3, 0.95, "last_linear")
