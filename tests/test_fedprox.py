"""FedProx's proximal term (Li et al. 2020, eq. 2): μ/2 ‖w − w^t‖², hand-computed value and gradient."""

import torch
from torch import nn
from toy import assert_reply_weights, toy_federation

from feddg.algorithms.components.local import train_local
from feddg.algorithms.fedprox import proximal_term
from feddg.federation.client import client_context
from feddg.messages import load_weights, weights_of


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


def test_client_update_minimises_the_task_loss_plus_half_mu_times_the_squared_distance():
    """The method's local objective, against ``train_local`` on eq. 2 written here, from the same client stream: a
    proximal term of μ (not μ/2), or none, moves the weights elsewhere."""
    mu = 1.0
    fed = toy_federation("method.name=fedprox", f"method.params.mu={mu}")
    start = weights_of(fed.model)
    reply, _ = fed.method.client_update(fed.model, {**start, "lr": 0.1}, {}, client_context(fed, 0, 1))
    load_weights(fed.model, start)
    anchor = [p.detach().clone() for p in fed.model.parameters()]
    ctx = client_context(fed, 0, 1)

    def eq2(m, x, y):
        return ctx.task.loss(m(x), y) + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor))

    train_local(fed.model, ctx, lr=0.1, loss_fn=eq2)
    assert_reply_weights(reply, weights_of(fed.model), start, rtol=1e-5)


def test_the_default_mu_is_the_middle_of_the_hfedf_grid():
    from feddg.algorithms.fedprox import FedProx, FedProxParams

    assert FedProxParams().mu == 0.01 and FedProx.search_space["mu"] == [1e-1, 1e-2, 1e-3]  # hFedF paper, Table 10
