"""FedSR: representation, regularisers against closed forms, local reference, Monte-Carlo prediction."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal, kl_divergence
from toy import ToyNet, toy_federation

from feddg.algorithms import fedsr
from feddg.algorithms.fedsr import FedSR, FedSRNet, FedSRParams, cmi_term, l2r_term
from feddg.federation.client import client_context
from feddg.messages import weights_of
from feddg.models import create_model


def test_cmi_term_is_the_kl_to_the_class_conditional_reference():
    g = torch.Generator().manual_seed(0)
    mu, sigma = torch.randn(4, 3, generator=g), torch.rand(4, 3, generator=g) + 0.1
    r_mu, r_sigma, scale = torch.randn(4, 3, generator=g), torch.rand(4, 3, generator=g) + 0.2, torch.tensor(1.7)
    expected = kl_divergence(Normal(mu * scale, sigma * scale), Normal(r_mu, r_sigma)).sum(1)
    torch.testing.assert_close(cmi_term(mu, sigma, scale, r_mu, r_sigma), expected)
    assert float(cmi_term(r_mu, r_sigma, torch.tensor(1.0), r_mu, r_sigma).abs().max()) < 1e-6


def test_l2r_term_is_the_euclidean_norm_of_z():
    torch.testing.assert_close(l2r_term(torch.tensor([[3.0, 4.0], [0.0, -2.0]])), torch.tensor([5.0, 2.0]))


@pytest.mark.parametrize("name", ["lenet", "resnet18", "alexnet"])
def test_the_featurizer_outputs_mean_and_scale_of_z(name):
    with torch.device("meta"):
        base = create_model(name, num_classes=7, in_channels=3, image_size=32)
        net = FedSRNet(base, z_dim=16)
    linears = [m for m in net.net.modules() if isinstance(m, torch.nn.Linear)]
    assert linears[-1].out_features == 32  # [μ, s]
    assert (net.classifier.in_features, net.classifier.out_features, net.feature_dim) == (16, 7, 16)


@pytest.mark.parametrize(("name", "z_dim"), [("lenet", 84), ("alexnet", 1024), ("resnet18", 512)])
def test_the_default_z_is_as_wide_as_the_layer_it_replaces(name, z_dim):
    """z takes the place of the head's last linear layer's input: AlexNet's 1024-d hidden layer, not its 9216-d
    features (which made fc3 1024 → 18432 and the classifier 9216-wide)."""
    with torch.device("meta"):
        net = FedSRNet(create_model(name, num_classes=7, in_channels=3, image_size=32))
    assert net.z_dim == net.classifier.in_features == z_dim


def test_features_sample_in_training_and_return_the_mean_in_eval():
    torch.manual_seed(0)
    net = FedSRNet(ToyNet(), z_dim=5)
    x = torch.randn(8, 1, 6, 6)
    net.eval()
    mu, sigma = net.distribution(x)
    assert (sigma > 0).all()
    torch.testing.assert_close(net.features(x), mu)
    net.train()
    assert not torch.allclose(net.features(x), net.features(x))
    torch.manual_seed(1)  # a draw z = μ + σ ε, with μ, σ of training mode (batch statistics in BatchNorm)
    drawn = net.features(x)
    mu, sigma = net.distribution(x)
    torch.manual_seed(1)
    torch.testing.assert_close(drawn, mu + sigma * torch.randn(mu.shape))


def test_prediction_averages_softmax_over_monte_carlo_draws():
    torch.manual_seed(0)
    method = FedSR(FedSRParams(num_samples=20, z_dim=5))
    net = method.prepare_model(ToyNet()).eval()
    x = torch.randn(6, 1, 6, 6)
    with torch.no_grad():
        got = method.predict(net, x)
        mu, sigma = net.distribution(x)
        eps = torch.randn((20, 1, 5), generator=torch.Generator().manual_seed(0))  # the same draws for every sample
        expected = F.softmax(net.classifier(mu + sigma * eps), dim=2).mean(0).log()
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(method.predict(net, x), got)  # deterministic
        alone = torch.cat([method.predict(net, x[i : i + 1]) for i in range(6)])
        torch.testing.assert_close(alone, got)  # and independent of the batch (eval.batch_size moved the figures)
        net.net.classifier.bias[5:] = -1e4  # σ -> 0: a single draw is exact
        torch.testing.assert_close(method.predict(net, x), F.log_softmax(net(x), dim=1))


def test_client_update_keeps_the_reference_local_and_sends_only_declared_keys():
    fed = toy_federation("method.name=fedsr")
    method = fed.method
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1}
    reply, state = method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    assert set(reply) == {*weights_of(fed.model), "num_examples", "train_loss", "l2r", "cmi"}
    assert set(state) == {"ref/mu", "ref/sigma", "ref/scale"}
    assert state["ref/mu"].shape == (4, 16) and np.abs(state["ref/mu"]).max() > 0  # trained
    reply2, state2 = method.client_update(fed.model, msg, state, client_context(fed, 0, 2))
    assert not np.array_equal(state2["ref/mu"], state["ref/mu"])  # continues from its own state
    assert reply["l2r"] > 0 and reply["cmi"] > 0


@pytest.mark.parametrize(("l2r", "cmi", "given"), [(1.0, 0.0, False), (0.0, 0.5, False), (0.3, 0.2, False),
                                                  (0.3, 0.2, True)])
def test_one_local_step_descends_ce_plus_l2r_plus_cmi_rebuilt_by_hand(
    monkeypatch: pytest.MonkeyPatch, l2r: float, cmi: float, given: bool
) -> None:
    """One SGD step on one batch, z drawn from the same seed: the model's and the reference's new values are
    w − η∇[CE(classifier(z), y) + λ_L2R mean‖z‖ + λ_CMI mean KL(N(cμ, (cσ)²) ‖ N(r_μ[y], softplus(r_σ[y])²))], the
    loss built here from the term functions; either weight alone moves the step (a dropped term fails). ``given``: the
    reference starts from the client's state (a later round), not from the first round's start."""
    fed = toy_federation("method.name=fedsr", f"method.params.l2r={l2r}", f"method.params.cmi={cmi}",
                         "optim.weight_decay=0")  # the first momentum step is the plain gradient step
    model, lr = fed.model, 0.1
    x, y = fed.dataset.get_batch(np.arange(0, 120, 15), train=False)  # classes 0, 0, 1, 1, …, 3, 3
    monkeypatch.setattr(fedsr, "local_batches", lambda *_: iter([(0, x, y)]))
    hand = copy.deepcopy(model).train()
    assert isinstance(hand, FedSRNet)
    ctx = client_context(fed, 0, 1)
    # the reference's first-round start: r_μ = 0, r_σ = 1 (before softplus), c = 1; or a state of a later round
    g = torch.Generator().manual_seed(1)
    start = ({"ref/mu": torch.randn(4, 16, generator=g), "ref/sigma": torch.rand(4, 16, generator=g) - 0.5,
              "ref/scale": torch.tensor(1.3)} if given else
             {"ref/mu": torch.zeros(4, 16), "ref/sigma": torch.ones(4, 16), "ref/scale": torch.ones(())})
    torch.manual_seed(3)
    reply, state = fed.method.client_update(model, {**weights_of(model), "lr": lr, "round": 1},
                                            {k: v.numpy() for k, v in start.items()} if given else {}, ctx)

    r_mu, r_sigma, scale = (start[k].clone().requires_grad_() for k in ("ref/mu", "ref/sigma", "ref/scale"))
    torch.manual_seed(3)
    mu, sigma = hand.distribution(x)
    z = mu + sigma * torch.randn(mu.shape)
    loss = (F.cross_entropy(hand.classifier(z), y) + l2r * l2r_term(z).mean()
            + cmi * cmi_term(mu, sigma, scale, r_mu[y], F.softplus(r_sigma)[y]).mean())
    named = {**{f"w/{n}": p for n, p in hand.named_parameters()}, "ref/mu": r_mu, "ref/sigma": r_sigma,
             "ref/scale": scale}
    grads = torch.autograd.grad(loss, list(named.values()))
    got = {**reply, **state}
    for (key, t), g in zip(named.items(), grads, strict=True):
        np.testing.assert_allclose(np.asarray(got[key]), (t - lr * g).detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=key)
    assert reply["train_loss"] == pytest.approx(float(loss.detach()), rel=1e-5)


def test_the_wrapped_models_conv_stages_are_found_inside_it():
    from feddg.models.stages import conv_stages

    net = create_model("lenet", num_classes=4, in_channels=1, image_size=28)
    wrapped = FedSRNet(net)
    assert conv_stages(wrapped) == [f"net.{n}" for n in conv_stages(net)] == ["net.conv.2", "net.conv.5"]
    modules = dict(wrapped.named_modules())
    assert all(modules[n] is dict(net.named_modules())[n.removeprefix("net.")] for n in conv_stages(wrapped))


def test_defaults_are_the_official_codes() -> None:
    """λ_L2R = 1e-2, λ_CMI = 5e-4 (FedSR's code defaults, docs/methods/fedsr.md) and 20 test-time draws."""
    p = FedSRParams()
    assert (p.l2r, p.cmi, p.num_samples, p.z_dim) == (1e-2, 5e-4, 20, None)
