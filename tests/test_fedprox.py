"""FedProx's proximal term (Li et al. 2020, eq. 2): μ/2 ‖w − w^t‖², hand-computed value and gradient."""

import torch
from torch import nn

from feddg.algorithms.fedprox import proximal_term


def test_proximal_term_is_the_squared_distance_to_the_anchor_with_gradient_mu_times_the_difference():
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.copy_(torch.tensor([0.5]))
    anchor = [torch.tensor([[0.0, 1.0]]), torch.tensor([0.0])]
    term = proximal_term(model, anchor)
    assert isinstance(term, torch.Tensor)
    assert term.item() == 1.0 + 9.0 + 0.25  # (1-0)² + (-2-1)² + (0.5-0)²
    mu = 0.1
    (0.5 * mu * term).backward()
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.1, -0.3]]))
    torch.testing.assert_close(model.bias.grad, torch.tensor([0.05]))


def test_a_model_without_trainable_parameters_has_no_proximal_term():
    assert proximal_term(nn.ReLU(), []) == 0
