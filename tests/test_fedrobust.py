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
