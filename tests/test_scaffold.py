"""SCAFFOLD: control variates against their closed form on a quadratic, FedAvg at c = c_i = 0, the server step."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from toy import Point, ToyMLPHeadNet, quadratic, toy_federation

from feddg.algorithms import Reply, ServerContext
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.scaffold import (
    CONTROL,
    DELTA,
    OWN,
    Scaffold,
    ScaffoldParams,
    corrected_training,
    full_gradient,
    option2,
)
from feddg.federation.client import client_context
from feddg.messages import load_weights, weights_of


def test_option2_closed_form():
    got = option2(np.array([1.0]), np.array([0.5]), np.array([2.0]), np.array([1.0]), steps=4, lr=0.25)
    np.testing.assert_allclose(got, [1.0 - 0.5 + 1.0 / (4 * 0.25)])


class QuadraticScaffold(Scaffold):
    loss_fn = staticmethod(quadratic)


def _targets(fed):
    return np.array([float(fed.dataset.x[c.train_idx].mean()) for c in fed.clients])


@pytest.mark.parametrize("control", ["option2", "option1"])
def test_on_a_quadratic_the_variates_are_the_gradients_and_every_client_takes_the_global_step(control):
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000")
    a, lr = _targets(fed), 0.1
    assert np.ptp(a) > 0.5  # the clients' optima differ: plain local SGD drifts apart
    method, model = QuadraticScaffold(ScaffoldParams(control=control)), Point()
    state = method.server_init(model, ServerContext(4, 2, 0))
    cstates: dict[int, dict] = {}

    def run(round, epochs):
        replies = []
        for cid in range(4):
            msg = {**method.client_config(state, cid, round), "lr": lr, "round": round}
            ctx = replace(client_context(fed, cid, round), local_epochs=epochs)
            reply, cstates[cid] = method.client_update(model, msg, cstates.get(cid, {}), ctx)
            replies.append(Reply(cid, reply))
        return replies

    x0 = float(state["weights"]["w/w"][0])
    replies = run(1, epochs=1)  # K = 1 step from x0: c_i⁺ = ∇f_i(x0) = x0 − a_i exactly (option I and II)
    np.testing.assert_allclose([cstates[k][OWN + "w"][0] for k in range(4)], x0 - a, rtol=1e-5)
    state, _ = method.aggregate(state, replies)
    np.testing.assert_allclose(state["control"]["w"], np.mean(x0 - a), rtol=1e-5)  # c = mean_i c_i (all sampled)
    np.testing.assert_allclose(state["weights"]["w/w"], x0 - lr * (x0 - a.mean()), rtol=1e-5)

    x1 = float(state["weights"]["w/w"][0])
    replies = run(2, epochs=5)  # g − c_i + c = (y − a_i) − (x0 − a_i) + (x0 − ā) = y − ā: GD on f = mean f_i
    for r in replies:
        np.testing.assert_allclose(r.message["w/w"], a.mean() + (1 - lr) ** 5 * (x1 - a.mean()), rtol=1e-5)


def test_option1_variate_adds_the_weight_decay_term_to_the_mean_gradient() -> None:
    """Option I with ``wd > 0``: ``c_i⁺ = ∇f_i(x) + wd·x = (x − a_i) + wd·x`` on the quadratic at ``x = 3``."""
    wd = 0.1
    fed = toy_federation("optim.momentum=0", f"optim.weight_decay={wd}", "federation.batch_size=1000")
    method, model = QuadraticScaffold(ScaffoldParams(control="option1")), Point()
    msg = {**method.client_config(method.server_init(model, ServerContext(4, 2, 0)), 0, 1), "lr": 0.1, "round": 1}
    reply, own = method.client_update(model, msg, {}, client_context(fed, 0, 1))
    x, a = 3.0, _targets(fed)[0]
    np.testing.assert_allclose(np.asarray(own[OWN + "w"]), [x - a + wd * x], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(reply[DELTA + "w"]), [x - a + wd * x], rtol=1e-5)  # c_i = 0: Δc_i = c_i⁺


def test_round_two_uploads_the_change_of_the_variate_and_the_server_control_is_the_mean_variate() -> None:
    """Option II on ToyNet over two rounds, all four clients each round: the test keeps its own ``c_i`` from the
    replies' weights, ``Δc_i = (x − y_i)/(K η) − c`` and ``c_i ← c_i + Δc_i``; the reply's ``dc/`` must be that
    change (in round 1 ``c = c_i = 0``, so only round 2 tells ``Δc_i`` from ``c_i⁺``), and after aggregation
    ``c = mean_i c_i`` (``c ← c + (1/N) Σ_i Δc_i`` from ``c = 0``)."""
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0")
    method, model, lr = Scaffold(), fed.model, 0.1
    names = [n for n, _ in model.named_parameters()]
    state = method.server_init(model, ServerContext(4, 2, 0))
    own = {cid: {n: np.zeros(p.shape) for n, p in model.named_parameters()} for cid in range(4)}
    cstates: dict[int, dict] = {}
    for round in (1, 2):
        x, c, replies = state["weights"], state["control"], []
        for cid in range(4):
            ctx = client_context(fed, cid, round)
            assert ctx.num_examples % ctx.batch_size > 1  # no one-sample batch for BatchNorm to skip
            steps = math.ceil(ctx.num_examples / ctx.batch_size) * ctx.local_epochs
            msg = {**method.client_config(state, cid, round), "lr": lr, "round": round}
            reply, cstates[cid] = method.client_update(model, msg, cstates.get(cid, {}), ctx)
            for n in names:
                delta = (x["w/" + n].astype(np.float64) - reply["w/" + n]) / (steps * lr) - c[n]
                np.testing.assert_allclose(np.asarray(reply[DELTA + n]), delta, rtol=1e-4, atol=1e-5)
                own[cid][n] = own[cid][n] + delta
            replies.append(Reply(cid, reply))
        state, _ = method.aggregate(state, replies)
        for n in names:
            np.testing.assert_allclose(state["control"][n], np.mean([own[k][n] for k in range(4)], axis=0),
                                       rtol=1e-4, atol=1e-5)
    assert max(float(np.abs(own[k][n]).max()) for k in range(4) for n in names) > 1e-2  # c_i(1) ≠ 0 in round 2


def test_with_zero_variates_the_first_round_is_fedavgs():
    fed = toy_federation("method.name=scaffold", "optim.momentum=0")
    state = Scaffold().server_init(fed.model, ServerContext(4, 3, 0))
    w0 = weights_of(fed.model)
    replies, avg_replies = [], []
    for cid in range(4):
        msg = {**Scaffold().client_config(state, cid, 1), "lr": 0.1, "round": 1}
        avg, _ = FedAvg().client_update(fed.model, {**w0, "lr": 0.1, "round": 1}, {}, client_context(fed, cid, 1))
        reply, cstate = Scaffold().client_update(fed.model, msg, {}, client_context(fed, cid, 1))
        assert all(np.array_equal(reply[k], avg[k]) for k in avg if k.startswith("w/"))
        assert set(reply) == {*avg, *(DELTA + n for n, _ in fed.model.named_parameters())}
        assert set(cstate) == {OWN + n for n, _ in fed.model.named_parameters()}
        replies.append(Reply(cid, reply))
        avg_replies.append(Reply(cid, avg))
    new, _ = Scaffold().aggregate(state, replies)
    ref, _ = FedAvg().aggregate(state, avg_replies)
    assert all(np.array_equal(new["weights"][k], ref["weights"][k]) for k in ref["weights"])
    assert set(msg) - {"lr", "round"} == {*w0, *(CONTROL + n for n, _ in fed.model.named_parameters())}


def test_server_step_and_control_update():
    state = {"weights": {"w/p": np.array([1.0], np.float32), "w/b": np.array([0.0], np.float32)},
             "control": {"p": np.array([0.5], np.float32)}, "num_clients": 4}
    replies = [Reply(0, {"w/p": np.array([2.0], np.float32), "w/b": np.array([1.0], np.float32),
                         DELTA + "p": np.array([0.4], np.float32), "num_examples": 10}),
               Reply(1, {"w/p": np.array([4.0], np.float32), "w/b": np.array([3.0], np.float32),
                         DELTA + "p": np.array([0.8], np.float32), "num_examples": 30})]
    new, _ = Scaffold(ScaffoldParams(server_lr=0.5)).aggregate(state, replies)
    np.testing.assert_allclose(new["weights"]["w/p"], 1.0 + 0.5 * (3.5 - 1.0))  # x + η_g (ȳ − x), ȳ n-weighted
    np.testing.assert_allclose(new["weights"]["w/b"], 2.5)  # buffers (not in control): FedAvg
    np.testing.assert_allclose(new["control"]["p"], 0.5 + (0.4 + 0.8) / 4, rtol=1e-6)  # c + (1/N) Σ_S Δc_i


def test_option2_refuses_momentum_on_the_client_too():  # a client of another deployment's config
    fed = toy_federation("method.name=scaffold", "optim.momentum=0")
    msg = {**Scaffold().client_config(Scaffold().server_init(fed.model, ServerContext(4, 3, 0)), 0, 1),
           "lr": 0.1, "round": 1}
    ctx = client_context(fed, 0, 1)
    ctx.optim = replace(ctx.optim, momentum=0.9)
    with pytest.raises(ValueError, match="momentum=0"):
        Scaffold().client_update(fed.model, msg, {}, ctx)


@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_a_correction_moves_each_weight_by_lr_times_it_under_every_amp(amp):
    """One plain SGD step (the client's data in one batch): ``w − lr (g + d)`` against ``w − lr g``. Under fp16 the
    correction must be added to the unscaled gradient (it was added to the scaled one, then divided by the loss
    scale: SCAFFOLD and MTGC, which share ``corrected_training``, became plain local SGD)."""
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000", f"optim.amp='{amp}'")
    model, lr, w0 = fed.model, 0.1, weights_of(fed.model)
    names = [n for n, _ in model.named_parameters()]
    plain_loss, _ = corrected_training(model, client_context(fed, 0, 1), lr, [torch.zeros_like(p) for p in
                                                                               model.parameters()])
    plain = weights_of(model)
    load_weights(model, w0)
    loss, steps = corrected_training(model, client_context(fed, 0, 1), lr, [torch.ones_like(p) for p in
                                                                             model.parameters()])
    corrected = weights_of(model)
    assert steps == 1 and loss == plain_loss
    for n in names:
        np.testing.assert_allclose(plain["w/" + n] - corrected["w/" + n], lr, rtol=1e-3)


def test_option_two_with_momentum_or_adam_is_refused_when_the_config_loads():
    from feddg.config import ConfigError, build_config

    for over in (["optim.momentum=0.9"], ["optim.name=adam", "optim.momentum=0"]):
        with pytest.raises(ConfigError, match="SCAFFOLD option II assumes plain SGD"):
            build_config({}, ["method.name=scaffold", *over])
    build_config({}, ["method.name=scaffold", "optim.momentum=0"])
    build_config({}, ["method.name=scaffold", "method.params.control=option1", "optim.name=adam"])


class OverflowOnce:
    """The quadratic, its first call scaled past fp16's range: the loss scaler skips that step."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, model, x, y):
        self.calls += 1
        return quadratic(model, x, y) * (1e38 if self.calls == 1 else 1.0)


def test_option2_counts_only_the_steps_fp16_took():
    """K is the optimiser steps that moved y: three epochs with the first step skipped give
    ``c_i⁺ = (x − y)/(2 η)`` with ``y = a + (1 − η)² (x − a)`` (the skipped step counted made it 2/3 of that)."""
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000", "optim.amp='fp16'")
    method, model, lr = Scaffold(), Point(), 0.1
    method.loss_fn = OverflowOnce()
    state = method.server_init(model, ServerContext(4, 2, 0))
    msg = {**method.client_config(state, 0, 1), "lr": lr, "round": 1}
    ctx = replace(client_context(fed, 0, 1), local_epochs=3)
    reply, own = method.client_update(model, msg, {}, ctx)
    x, a = 3.0, _targets(fed)[0]
    np.testing.assert_allclose(reply["w/w"], a + (1 - lr) ** 2 * (x - a), rtol=1e-5)
    np.testing.assert_allclose(own[OWN + "w"], (x - a) * (1 - (1 - lr) ** 2) / (2 * lr), rtol=1e-5)


def test_option1_skips_a_single_sample_batch_under_batchnorm_and_refuses_a_client_without_any_batch():
    fed = toy_federation("optim.weight_decay=0")
    model, ctx = ToyMLPHeadNet(), client_context(fed, 0, 1)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    ctx = replace(ctx, batch_size=ctx.num_examples - 1)  # one full batch, then one sample (BatchNorm1d raises)
    got = full_gradient(model, ctx)
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    x, y = next(ctx.batches(shuffle=False, train=False))
    model.train()
    expected = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), list(model.parameters()))
    for g, e in zip(got, expected, strict=True):  # the mean over the samples it used, not over all of them
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-6)
    alone = replace(ctx, train_idx=ctx.train_idx[:1])
    assert full_gradient(model, alone) is None
    method = Scaffold(ScaffoldParams(control="option1"))
    msg = {**method.client_config(method.server_init(model, ServerContext(4, 2, 0)), 0, 1), "lr": 0.1, "round": 1}
    ci = {OWN + n: np.full(p.shape, 0.5, np.float32) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^client 0 has nothing to train on: its 1 example\(s\) make only one-sample "
                                         r"batches \(batch size \d+\), which a BatchNorm model skips$"):
        method.client_update(model, msg, ci, alone)  # it reported a trained model (train_loss 0): the server drops it


def test_option2_keeps_the_variate_when_fp16_skipped_every_step() -> None:
    """One epoch whose only step fp16 skipped: ``K = 0``, y = x, so nothing estimates ``c_i⁺``: the client keeps its
    ``c_i`` (0.5 here) and uploads ``Δc_i = 0`` (``(x − y)/(K η)`` would be 0/0)."""
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000", "optim.amp='fp16'")
    method, model = Scaffold(), Point()
    method.loss_fn = OverflowOnce()
    msg = {**method.client_config(method.server_init(model, ServerContext(4, 2, 0)), 0, 1), "lr": 0.1, "round": 1}
    reply, own = method.client_update(model, msg, {OWN + "w": np.array([0.5], np.float32)}, client_context(fed, 0, 1))
    np.testing.assert_array_equal(reply["w/w"], [3.0])  # the skipped step moved nothing
    np.testing.assert_array_equal(own[OWN + "w"], [0.5])
    np.testing.assert_array_equal(reply[DELTA + "w"], [0.0])
