"""FedSAM: one SAM step against its closed form on a quadratic, BatchNorm statistics updated once, and a client's
local training on a 1-d quadratic."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from toy import Point, quadratic, toy_federation

from feddg.algorithms.fedsam import FedSAM, FedSAMParams, ascent, sam_step
from feddg.federation.client import client_context
from feddg.messages import weights_of


class Bowl(torch.nn.Module):
    """``L(w) = ½ wᵀ A w`` with ``A = diag(1, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))


def bowl_loss(model, x, y):
    return 0.5 * (model.w[0] ** 2 + 3 * model.w[1] ** 2)


def test_ascent_is_rho_along_the_normalised_gradient_and_zero_for_a_zero_gradient():
    p = [torch.zeros(2), torch.zeros(1)]
    eps = ascent(p, [torch.tensor([3.0, 0.0]), torch.tensor([4.0])], rho=0.5)
    torch.testing.assert_close(torch.cat(eps), torch.tensor([0.3, 0.0, 0.4]))  # ‖g‖ = 5
    assert all(float(e.abs().sum()) == 0 for e in ascent(p, [torch.zeros(2), torch.zeros(1)], rho=0.5))


def test_one_sam_step_on_a_quadratic_is_its_closed_form():
    model, rho, lr = Bowl(), 0.1, 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss = sam_step(model, bowl_loss, torch.zeros(1), torch.zeros(1), opt, scaler, rho)
    w, a = np.array([1.0, 2.0]), np.array([1.0, 3.0])
    g = a * w  # [1, 6]
    eps = rho * g / np.sqrt(37.0)
    expected = w - lr * a * (w + eps)  # the gradient at w + ε, the step from w
    np.testing.assert_allclose(model.w.detach().numpy(), expected, rtol=1e-6)
    assert float(loss) == pytest.approx(6.5)  # L(w) = ½ (1 + 3·4), not L(w + ε)


def test_the_second_pass_leaves_batchnorm_statistics_as_the_first_left_them():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    x = torch.randn(8, 3)
    ref = torch.nn.BatchNorm1d(4)
    ref.train()
    with torch.no_grad():
        ref(net[0](x))  # one forward of the unperturbed batch
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    sam_step(net, lambda m, x, y: m(x).pow(2).mean(), x, x, opt, torch.amp.GradScaler("cpu", enabled=False), 0.5)
    torch.testing.assert_close(net[1].running_mean, ref.running_mean)
    torch.testing.assert_close(net[1].running_var, ref.running_var)
    assert int(net[1].num_batches_tracked) == 1


class QuadraticSAM(FedSAM):
    loss_fn = staticmethod(quadratic)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_a_client_on_a_quadratic_steps_with_the_gradient_at_the_perturbed_point(clip):
    """Two epochs of one full batch; ``clip``: the perturbed gradient's norm is bounded (``optim.grad_clip``).
    ``train_loss`` is the mean of ``L(w)`` (not ``L(w + ε)``) over the two steps."""
    clip_over = () if clip is None else (f"optim.grad_clip={clip}",)
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000", *clip_over)
    ctx = replace(client_context(fed, 0, 1), local_epochs=2)
    a = float(fed.dataset.x[fed.clients[0].train_idx].mean())
    model, rho, lr = Point(), 0.2, 0.1
    reply, _ = QuadraticSAM(FedSAMParams(rho=rho)).client_update(model, {**weights_of(model), "lr": lr, "round": 1},
                                                                 {}, ctx)
    w, losses = 3.0, []
    for _ in range(2):  # 1-d: ε = ρ sign(w − a), w ← w − lr (w + ε − a)
        losses.append(0.5 * (w - a) ** 2)
        g = w + rho * np.sign(w - a) - a
        w = w - lr * (g if clip is None else np.clip(g, -clip, clip))
    np.testing.assert_allclose(reply["w/w"], [w], rtol=1e-6)
    assert reply["train_loss"] == pytest.approx(np.mean(losses), rel=1e-6)


def test_defaults_and_a_non_finite_gradient_gives_no_ascent():
    """ρ = 0.05 (SAM's default, docs/methods/fedsam.md); an fp16 overflow (inf or nan in g) gives ε = 0, so the
    second pass and ``back_to_w`` leave w finite (ε = ρ·inf/inf would be nan)."""
    assert FedSAMParams().rho == 0.05
    p = [torch.zeros(2), torch.zeros(1)]
    for bad in (float("inf"), float("nan")):
        eps = ascent(p, [torch.tensor([bad, 1.0]), torch.tensor([4.0])], rho=0.5)
        assert all(torch.equal(e, torch.zeros_like(e)) for e in eps), bad


def test_a_client_trains_in_training_mode_and_batchnorm_counts_each_batch_once():
    """A model left in eval mode: the client switches to training mode; 54 examples in batches of 16 are 4 batches,
    and the second (perturbed) pass of each leaves BatchNorm's count as the first left it."""
    fed = toy_federation("method.name=fedsam")
    fed.model.eval()
    reply, _ = fed.method.client_update(fed.model, {**weights_of(fed.model), "lr": 0.1, "round": 1}, {},
                                        client_context(fed, 0, 1))
    assert int(reply["w/bn.num_batches_tracked"]) == 4
