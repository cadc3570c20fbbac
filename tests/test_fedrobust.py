"""FedRobust: the affine perturbation, the projection, one descent-ascent step on a linear model by hand, and a
client's perturbation kept in its state inside the norm balls."""

import math

import numpy as np
import pytest
import torch
from toy import toy_federation

from feddg.algorithms.fedrobust import DELTA, LAMBDA, FedRobust, FedRobustParams, descent_ascent_step, perturb, project
from feddg.federation.client import client_context
from feddg.messages import weights_of


def test_perturb_maps_flattened_images_or_each_pixels_channels():
    x = torch.arange(4.0).reshape(1, 2, 1, 2)  # channels [0, 1] and [2, 3]
    swap, shift = torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([10.0, 20.0])
    torch.testing.assert_close(perturb(x, swap, shift, "channels"), torch.tensor([[[[12.0, 13.0]], [[20.0, 21.0]]]]))
    lam = torch.eye(4) * 2
    torch.testing.assert_close(perturb(x, lam, torch.ones(4), "pixels"), (2 * x + 1))


def test_projection_scales_the_deviation_into_each_ball():
    lam, delta = torch.eye(2) + torch.tensor([[3.0, 0.0], [0.0, 4.0]]), torch.tensor([0.6, 0.8])
    project(lam, delta, eps_lambda=1.0, eps_delta=2.0)  # ‖Λ − I‖_F = 5 → 1; ‖δ‖ = 1 ≤ 2 stays
    torch.testing.assert_close(lam, torch.eye(2) + torch.tensor([[0.6, 0.0], [0.0, 0.8]]))
    torch.testing.assert_close(delta, torch.tensor([0.6, 0.8]))


@pytest.mark.parametrize(("eps", "scale_lambda", "scale_delta"), [(1.0, 1.0, 1.0),
                                                                   (0.1, 0.1 / math.sqrt(0.1), 0.1 / math.sqrt(0.02))])
def test_one_step_descends_w_and_ascends_lambda_and_delta_by_hand(eps, scale_lambda, scale_delta):
    """``L = w · (Λx + δ)`` at ``Λ = I, δ = 0``, ``x = [1, 2]``, ``w = [1, −1]``: ``∂L/∂w = x``, ``∂L/∂Λ = w xᵀ``,
    ``∂L/∂δ = w``; lr = η_a = 0.1."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    lam, delta = torch.eye(2), torch.zeros(2)
    params = FedRobustParams(eps_lambda=eps, eps_delta=eps, ascent_lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = descent_ascent_step(model, lambda m, x, y: m(x).sum(), torch.tensor([[1.0, 2.0]]), torch.zeros(1), lam,
                               delta, opt, torch.amp.GradScaler("cpu", enabled=False), params)
    assert float(loss) == pytest.approx(-1.0)
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.9, -1.2]]))
    # Λ − I = 0.1 w xᵀ = [[0.1, 0.2], [−0.1, −0.2]] (‖·‖_F = √0.1), δ = 0.1 w = [0.1, −0.1] (‖·‖ = √0.02)
    torch.testing.assert_close(lam, torch.eye(2) + scale_lambda * torch.tensor([[0.1, 0.2], [-0.1, -0.2]]))
    torch.testing.assert_close(delta, scale_delta * torch.tensor([0.1, -0.1]))
    assert not lam.requires_grad and not delta.requires_grad


def test_a_client_keeps_its_perturbation_in_its_state_inside_the_balls():
    fed = toy_federation("method.name=fedrobust", "method.params.eps_lambda=0.05", "method.params.eps_delta=0.02")
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1}
    reply, state = fed.method.client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    assert set(reply) == {*msg.keys() - {"lr", "round"}, "num_examples", "train_loss"}  # Λ, δ never leave
    lam, delta = state[LAMBDA], state[DELTA]
    assert lam.shape == (36, 36) and delta.shape == (36,)  # ToyDomains: d = 1·6·6
    assert 0 < np.linalg.norm(lam - np.eye(36)) <= 0.05 + 1e-6 and 0 < np.linalg.norm(delta) <= 0.02 + 1e-6
    _, again = fed.method.client_update(fed.model, dict(msg), state, client_context(fed, 0, 2))
    _, fresh = fed.method.client_update(fed.model, dict(msg), {}, client_context(fed, 0, 2))
    assert not np.array_equal(again[LAMBDA], fresh[LAMBDA])  # round 2 goes on from its state, not from Λ = I
    assert not np.array_equal(again[DELTA], fresh[DELTA])


def test_pixels_beyond_max_dim_is_refused_in_one_line():
    method = FedRobust(FedRobustParams(max_dim=35))
    with pytest.raises(ValueError, match=r"perturb=pixels needs a 36×36 Λ .*perturb=channels"):
        method.initial(torch.zeros(2, 1, 6, 6))
    eye, zero = FedRobust(FedRobustParams(perturb="channels", max_dim=1)).initial(torch.zeros(2, 3, 6, 6))
    assert eye.shape == (3, 3) and zero.shape == (3,)


def test_perturb_applies_a_non_symmetric_lambda_not_its_transpose():
    x = torch.arange(4.0).reshape(1, 2, 1, 2)  # channels [0, 1] and [2, 3]
    lam = torch.tensor([[1.0, 2.0], [0.0, 1.0]])  # channel 0 ← x₀ + 2 x₁, channel 1 ← x₁
    torch.testing.assert_close(perturb(x, lam, torch.zeros(2), "channels"), torch.tensor([[[[4.0, 7.0]], [[2.0, 3.0]]]]))
    up = torch.eye(4) + torch.diag(torch.ones(3), 1)  # pixel i ← x_i + x_{i+1}
    torch.testing.assert_close(perturb(x, up, torch.zeros(4), "pixels"), torch.tensor([[[[1.0, 3.0]], [[5.0, 3.0]]]]))


def _gda_by_hand(w, x, steps, lr):
    """Simultaneous descent-ascent on ``L = w · (Λx + δ)`` from ``Λ = I, δ = 0`` (no projection): ``∂L/∂w = Λx + δ``,
    ``∂L/∂Λ = w xᵀ``, ``∂L/∂δ = w``."""
    lam, delta = np.eye(len(x)), np.zeros(len(x))
    for _ in range(steps):
        x_tilde = lam @ x + delta
        w, lam, delta = w - lr * x_tilde, lam + lr * np.outer(w, x), delta + lr * w
    return w, lam, delta


@pytest.mark.parametrize("scaled", [False, True])
def test_two_steps_use_each_steps_own_gradients_and_the_unscaled_ones(scaled):
    """Two steps (the gradients of step 1 must not leak into step 2); ``scaled``: a GradScaler at 2¹⁰, whose scale
    the ascent divides out, as the optimiser's step does."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    lam, delta = torch.eye(2), torch.zeros(2)
    params = FedRobustParams(eps_lambda=10.0, eps_delta=10.0, ascent_lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    x = torch.tensor([[1.0, 2.0]])
    for _ in range(2):
        descent_ascent_step(model, lambda m, x, y: m(x).sum(), x, torch.zeros(1), lam, delta, opt, scaler, params)
    w, want_lam, want_delta = _gda_by_hand(np.array([1.0, -1.0]), np.array([1.0, 2.0]), 2, 0.1)
    np.testing.assert_allclose(model.weight.detach().numpy()[0], w, rtol=1e-6)
    np.testing.assert_allclose(lam.numpy(), want_lam, rtol=1e-6)
    np.testing.assert_allclose(delta.numpy(), want_delta, rtol=1e-6)


def test_a_step_the_scaler_skips_leaves_the_perturbation_as_it_was():
    """An infinite loss (an fp16 overflow): the scaler skips the model's step, and (Λ, δ) stay at (I, 0)."""
    model = torch.nn.Linear(2, 1, bias=False)
    lam, delta = torch.eye(2), torch.zeros(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    descent_ascent_step(model, lambda m, x, y: m(x).sum() * float("inf"), torch.tensor([[1.0, 2.0]]), torch.zeros(1),
                        lam, delta, opt, scaler, FedRobustParams())
    assert torch.equal(lam, torch.eye(2)) and torch.equal(delta, torch.zeros(2))


class Recording(FedRobust):
    """The task's loss, recording each step's perturbed input and loss."""

    def __init__(self, params):
        super().__init__(params)
        self.inputs, self.losses = [], []

    def loss_fn(self, m, x, y):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        self.inputs.append(x.detach().clone())
        self.losses.append(float(loss.detach()))
        return loss


def test_a_client_trains_in_training_mode_and_its_train_loss_is_the_mean_of_its_steps_losses():
    fed = toy_federation("method.name=fedrobust")
    fed.model.eval()  # the client trains in training mode whatever it is given: BatchNorm counts its 4 batches
    method = Recording(FedRobustParams())
    reply, _ = method.client_update(fed.model, {**weights_of(fed.model), "lr": 0.1, "round": 1}, {},
                                    client_context(fed, 0, 1))
    seen = method.losses
    assert len(seen) == 4 and reply["train_loss"] == pytest.approx(sum(seen) / 4, rel=1e-9)  # 54 examples: 4 batches
    assert int(reply["w/bn.num_batches_tracked"]) == 4


def test_a_client_perturbs_its_first_batch_with_the_lambda_and_delta_of_its_state():
    """State (Λ, δ) inside the balls: the first step's input is ``Λ x + δ`` of the client's first batch."""
    fed = toy_federation("method.name=fedrobust")
    rng = np.random.default_rng(0)
    lam = (np.eye(36) + 0.01 * rng.normal(size=(36, 36)) / 6).astype(np.float32)  # ‖Λ − I‖_F ≈ 0.01
    delta = (0.05 * rng.normal(size=36) / 6).astype(np.float32)  # ‖δ‖ ≈ 0.05
    method = Recording(FedRobustParams())
    method.client_update(fed.model, {**weights_of(fed.model), "lr": 0.1, "round": 2}, {LAMBDA: lam, DELTA: delta},
                         client_context(fed, 0, 2))
    x, _ = next(client_context(fed, 0, 2).batches())  # the same seed: the same first batch
    want = x.flatten(1).double().numpy() @ lam.T.astype(np.float64) + delta
    np.testing.assert_allclose(method.inputs[0].flatten(1).numpy(), want, atol=1e-5)


def test_projection_uses_each_balls_own_radius():
    lam, delta = torch.eye(2) + torch.tensor([[0.3, 0.0], [0.0, 0.4]]), torch.tensor([0.6, 0.8])
    project(lam, delta, eps_lambda=1.0, eps_delta=0.5)  # ‖Λ − I‖_F = 0.5 ≤ 1 stays; ‖δ‖ = 1 → 0.5
    torch.testing.assert_close(lam, torch.eye(2) + torch.tensor([[0.3, 0.0], [0.0, 0.4]]))
    torch.testing.assert_close(delta, torch.tensor([0.3, 0.4]))


def test_defaults_are_the_documented_ones_and_max_dim_itself_is_accepted():
    p = FedRobustParams()
    assert (p.eps_lambda, p.eps_delta, p.ascent_lr, p.perturb, p.max_dim) == (0.5, 0.5, 0.01, "pixels", 4096)
    eye, zero = FedRobust(FedRobustParams(max_dim=36)).initial(torch.zeros(2, 1, 6, 6))
    assert eye.shape == (36, 36) and zero.shape == (36,)
