"""The FFA layer (Algorithm 2, eqs. 2, 4, 5, 8–10) and its attachment to zoo models."""

import copy

import numpy as np
import pytest
import torch

from feddg.algorithms.components.ffa import (
    FFALayer,
    Variant,
    attach_ffa,
    batch_variance,
    channel_stats,
    ffa_transform,
    fuse_variance,
    momentum_update,
    safe_sqrt,
)
from feddg.models import create_model
from feddg.models.stages import conv_stages


def _x(b=6, c=3, h=5, w=4, seed=0):
    return torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(seed)) * 2 + 1


def test_eq2_channel_statistics_match_numpy():
    x = _x()
    mu, sigma = channel_stats(x, eps=1e-6)
    xn = x.numpy().astype(np.float64)
    np.testing.assert_allclose(mu.numpy(), xn.mean(axis=(2, 3)), rtol=1e-5)
    np.testing.assert_allclose(sigma.numpy(), np.sqrt(xn.var(axis=(2, 3)) + 1e-6), rtol=1e-5)
    with pytest.raises(ValueError, match="feature map"):
        channel_stats(torch.randn(4, 3))


def test_eq4_client_specific_variance_matches_numpy():
    s = torch.randn(9, 5)
    np.testing.assert_allclose(batch_variance(s).numpy(), s.numpy().var(axis=0), rtol=1e-5)  # 1/B, not 1/(B-1)
    assert torch.equal(batch_variance(torch.randn(1, 5)), torch.zeros(5))  # a batch of one sample


def test_eq8_fusion_and_eq5_momentum():
    var = torch.tensor([0.5, 2.0, 0.0])
    gamma = torch.tensor([1.0, 0.5, 1.5])
    assert torch.allclose(fuse_variance(var, gamma), torch.tensor([1.0, 3.0, 0.0]))
    bar = torch.tensor([0.0, 1.0])
    stat = torch.tensor([[1.0, 3.0], [3.0, 5.0]])  # E_B = [2, 4]
    assert torch.allclose(momentum_update(bar, stat, 0.9), torch.tensor([0.2, 1.3]))


def test_eq9_eq10_with_zero_variance_reproduce_the_input():
    x = _x()
    eps = torch.randn(6, 3)
    out = ffa_transform(x, *channel_stats(x), torch.zeros(3), torch.zeros(3), eps, eps)
    assert torch.allclose(out, x, atol=1e-5)


def test_eq9_eq10_with_fixed_noise_match_lemma_4_1():
    # X̂ = X + ε_σ Σ̂_σ (X − μ)/σ + ε_μ Σ̂_μ  (eqs. 16–17)
    x = _x()
    std_mu, std_sigma = torch.tensor([0.3, 0.0, 1.0]), torch.tensor([0.2, 0.5, 0.0])
    e_mu, e_sigma = torch.randn(6, 3), torch.randn(6, 3)
    mu, sigma = channel_stats(x)
    out = ffa_transform(x, mu, sigma, std_mu, std_sigma, e_mu, e_sigma)
    xbar = (x - mu[..., None, None]) / sigma[..., None, None]
    expected = x + (e_sigma * std_sigma)[..., None, None] * xbar + (e_mu * std_mu)[..., None, None]
    assert torch.allclose(out, expected, atol=1e-5)
    # the augmented channel statistics are the sampled ones (μ̂, σ̂)
    mu_hat, sigma_hat = channel_stats(out, eps=0.0)
    assert torch.allclose(mu_hat, mu + e_mu * std_mu, atol=1e-4)
    assert torch.allclose(sigma_hat, (sigma + e_sigma * std_sigma).abs(), atol=1e-3)


def test_layer_is_identity_in_eval_mode_and_with_p_zero():
    x = _x()
    layer = FFALayer("full", p=1.0)
    assert torch.equal(layer.eval()(x), x)
    layer = FFALayer("full", p=0.0).train()
    assert torch.equal(layer(x), x)
    assert torch.equal(layer.mu_bar, torch.zeros(3)) and torch.equal(layer.sigma_bar, torch.ones(3))
    assert not torch.equal(FFALayer("full", p=1.0).train()(x), x)


@pytest.mark.parametrize("variant", ["full", "direct"])
def test_momentum_statistics_follow_eq5_over_steps(variant: Variant) -> None:
    x, alpha = _x(), 0.9
    layer = FFALayer(variant, p=1.0, momentum=alpha).train()
    for _ in range(3):
        layer(x)
    mu, sigma = channel_stats(x)
    m, s = mu.mean(0), sigma.mean(0)
    assert layer.mu_bar is not None and layer.sigma_bar is not None  # both variants track μ̄, σ̄
    # μ̄_0 = 0, σ̄_0 = 1  ->  μ̄_n = (1 − αⁿ) m,  σ̄_n = αⁿ + (1 − αⁿ) s
    assert torch.allclose(layer.mu_bar, (1 - alpha**3) * m, atol=1e-6)
    assert torch.allclose(layer.sigma_bar, alpha**3 + (1 - alpha**3) * s, atol=1e-6)


def test_momentum_is_updated_only_when_the_layer_is_active():
    x, alpha = _x(), 0.5
    layer = FFALayer("full", p=0.5, momentum=alpha).train()
    torch.manual_seed(3)
    active = sum(not torch.equal(layer(x), x) for _ in range(20))
    assert 0 < active < 20
    m = channel_stats(x)[0].mean(0)
    assert torch.allclose(layer.mu_bar, (1 - alpha**active) * m, atol=1e-5)


@pytest.mark.parametrize(("variant", "random_std"), [("full", 0.5), ("random", 0.25)])
def test_forward_draws_independent_noises_for_mean_and_std(variant: Variant, random_std: float) -> None:
    # the layer's own draws, replayed: the p draw, then ε_μ, then ε_σ (eq. 10), each [B, C] from N(0, 1)
    x = _x()
    torch.manual_seed(11)
    out = FFALayer(variant, p=1.0, random_std=random_std).train()(x)
    torch.manual_seed(11)
    torch.rand(())
    e_mu, e_sigma = torch.randn(6, 3), torch.randn(6, 3)
    mu, sigma = channel_stats(x)
    if variant == "full":  # no γ received yet: Σ̂² = (1 + 1) Σ² (eqs. 4, 8)
        std_mu, std_sigma = (2 * batch_variance(mu)).sqrt(), (2 * batch_variance(sigma)).sqrt()
    else:  # FedFA-R: the configured constant for every channel
        std_mu = std_sigma = torch.full((3,), random_std)
    xbar = (x - mu[..., None, None]) / sigma[..., None, None]
    expected = x + (e_sigma * std_sigma)[..., None, None] * xbar + (e_mu * std_mu)[..., None, None]  # Lemma 4.1
    assert torch.allclose(out, expected, atol=1e-5)


def test_variant_perturbation_stds():
    mu, sigma = torch.randn(8, 4), torch.rand(8, 4) + 0.5
    var_mu, var_sigma = batch_variance(mu), batch_variance(sigma)
    gamma = torch.tensor([0.0, 1.0, 2.0, 1.0])

    full = FFALayer("full")
    s_mu, s_sigma = full.perturbation_std(mu, sigma)  # no γ received yet: γ = 1
    assert torch.allclose(s_mu, (2 * var_mu).sqrt()) and torch.allclose(s_sigma, (2 * var_sigma).sqrt())
    full.modulation_mu, full.modulation_sigma = gamma, gamma
    s_mu, _ = full.perturbation_std(mu, sigma)
    assert torch.allclose(s_mu, ((gamma + 1) * var_mu).sqrt())

    s_mu, s_sigma = FFALayer("client").perturbation_std(mu, sigma)  # FedFA-C: Σ̂² = Σ²
    assert torch.allclose(s_mu, var_mu.sqrt()) and torch.allclose(s_sigma, var_sigma.sqrt())
    assert FFALayer("random", random_std=0.5).perturbation_std(mu, sigma) == (0.5, 0.5)  # FedFA-R
    direct = FFALayer("direct")
    direct.modulation_mu = direct.modulation_sigma = torch.tensor([3.0, 0.0, 0.0, 0.0])
    s_mu, _ = direct.perturbation_std(mu, sigma)  # (Σ²_shared + 1) ⊙ Σ²
    assert torch.allclose(s_mu**2, torch.tensor([4.0, 1, 1, 1]) * var_mu, rtol=1e-5)
    assert not FFALayer("client").tracks_stats and not FFALayer("random").tracks_stats
    with pytest.raises(ValueError, match="variant"):
        FFALayer("other")


def test_mean_and_std_use_their_own_modulation_and_direct_defaults_to_zero():
    mu, sigma = torch.randn(8, 2), torch.rand(8, 2) + 0.5
    var_mu, var_sigma = batch_variance(mu), batch_variance(sigma)
    full = FFALayer("full")
    full.modulation_mu, full.modulation_sigma = torch.tensor([0.0, 3.0]), torch.tensor([1.0, 0.0])
    s_mu, s_sigma = full.perturbation_std(mu, sigma)
    assert torch.allclose(s_mu**2, torch.tensor([1.0, 4.0]) * var_mu, rtol=1e-5)  # (γ_μ + 1) Σ²_μ
    assert torch.allclose(s_sigma**2, torch.tensor([2.0, 1.0]) * var_sigma, rtol=1e-5)  # (γ_σ + 1) Σ²_σ
    # direct fusion before any server message: zero shared variance, so Σ̂² = Σ²
    s_mu, s_sigma = FFALayer("direct").perturbation_std(mu, sigma)
    assert torch.allclose(s_mu**2, var_mu, rtol=1e-5) and torch.allclose(s_sigma**2, var_sigma, rtol=1e-5)


def test_reset_forgets_client_state_and_server_message():
    layer = FFALayer("full", p=1.0).train()
    layer(_x())
    layer.modulation_mu = layer.modulation_sigma = torch.ones(3)
    layer.reset()
    assert (layer.mu_bar, layer.sigma_bar, layer.modulation_mu, layer.modulation_sigma) == (None, None, None, None)


def test_safe_sqrt_has_finite_gradient_at_zero():
    v = torch.tensor([0.0, 4.0], requires_grad=True)
    r = safe_sqrt(v)
    r.sum().backward()
    assert torch.equal(r.detach(), torch.tensor([0.0, 2.0])) and torch.isfinite(v.grad).all()
    assert torch.equal(v.grad, torch.tensor([0.0, 0.25]))  # zero at 0; 1 / (2 √4) at 4


@pytest.mark.parametrize("variant", ["full", "client", "direct", "random"])
def test_degenerate_batches_give_finite_values_and_gradients(variant):
    layer = FFALayer(variant, p=1.0).train()
    for x in (torch.randn(1, 3, 4, 4), torch.full((4, 3, 4, 4), 0.7), torch.zeros(2, 3, 1, 1)):
        x = x.requires_grad_(True)
        out = layer(x)
        (out**2).sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all(), (variant, x.shape)
        assert torch.isfinite(layer.mu_bar if layer.tracks_stats else torch.zeros(1)).all()


def test_a_batch_of_one_is_reproduced_by_the_statistic_variants():
    x = torch.randn(1, 3, 4, 4)
    layer = FFALayer("full", p=1.0).train()
    assert torch.allclose(layer(x), x, atol=1e-5)  # Σ² over a batch of one is 0: nothing to sample


def _cnn():
    torch.manual_seed(0)
    return create_model("cnn", num_classes=10, in_channels=3, image_size=28)


def test_attaching_keeps_state_dict_keys_and_eval_output():
    base = _cnn()
    model = copy.deepcopy(base)
    names = conv_stages(model)
    attach_ffa(model, names, {k: FFALayer("full", p=1.0) for k in range(1, 5)}, tap_stage=4)
    assert list(model.state_dict()) == list(base.state_dict())
    x = torch.randn(4, 3, 28, 28)
    model.eval(), base.eval()
    assert torch.equal(model(x), base(x))
    model.train()
    base.train()
    assert not torch.allclose(model(x), base(x))
    assert all(layer.mu_bar is not None for layer in model.fedfa.layers.values())
    assert model.fedfa.channels() == {1: 32, 2: 64, 3: 128, 4: 256}


def test_only_the_chosen_stages_get_ffa_and_the_tap_sees_the_last_stage():
    model = _cnn().train()
    att = attach_ffa(model, conv_stages(model), {1: FFALayer(p=1.0), 4: FFALayer(p=1.0)}, tap_stage=4)
    att.tap.recording = True
    model(torch.randn(3, 3, 28, 28))
    assert set(att.channels()) == {1, 4}
    assert att.tap.features.shape == (3, 256, 3, 3)
    att.tap.recording, att.tap.features = False, None
    clone = copy.deepcopy(model)  # hooks are bound methods: the copy uses its own layers
    clone.fedfa.layers["1"].reset()
    clone(torch.randn(3, 3, 28, 28))
    assert clone.fedfa.layers["1"].mu_bar is not None and clone.fedfa.layers["1"] is not att.layers["1"]
    with pytest.raises(ValueError, match="out of range"):
        attach_ffa(_cnn(), conv_stages(model), {5: FFALayer()}, tap_stage=4)


def test_attaching_twice_to_a_missing_module_or_with_the_tap_out_of_range_is_refused() -> None:
    model = _cnn()
    attach_ffa(model, conv_stages(model), {1: FFALayer()}, tap_stage=1)
    with pytest.raises(ValueError, match="already has FFA layers"):
        attach_ffa(model, conv_stages(model), {2: FFALayer()}, tap_stage=2)
    with pytest.raises(ValueError, match=r"FFA stages \[5\] out of range"):
        attach_ffa(_cnn(), conv_stages(model), {1: FFALayer()}, tap_stage=5)  # the tap's stage is checked too
    with pytest.raises(ValueError, match="stage module 'blocks.9' not found in SmallCNN"):
        attach_ffa(_cnn(), ["blocks.0", "blocks.9"], {1: FFALayer()}, tap_stage=2)


def test_the_tap_records_the_ffa_augmented_stage_output_only_while_recording():
    model = _cnn().train()
    names = conv_stages(model)
    att = attach_ffa(model, names, {4: FFALayer(p=1.0)}, tap_stage=4)
    final: list[torch.Tensor] = []  # registered last: sees what the next module receives
    dict(model.named_modules())[names[3]].register_forward_hook(lambda m, i, o: final.append(o))
    model(torch.randn(3, 3, 28, 28))
    assert att.tap.features is None  # not recording
    att.tap.recording = True
    model(torch.randn(3, 3, 28, 28))
    assert att.tap.features is final[1]


def test_stage_channels_measures_every_stage_and_restores_the_mode():
    model = _cnn()
    att = attach_ffa(model, conv_stages(model), {1: FFALayer(p=1.0)}, tap_stage=4)
    for training in (True, False):
        model.train(training)
        assert att.stage_channels(model, torch.randn(2, 3, 28, 28)) == {1: 32, 2: 64, 3: 128, 4: 256}
        assert model.training is training and att.layers["1"].training is training


@pytest.mark.parametrize("name", ["lenet", "alexnet", "resnet18", "swin_tiny_test"])
def test_ffa_runs_on_every_zoo_model(name):
    model = create_model(name, num_classes=10, in_channels=3, image_size=32).train()
    names = conv_stages(model)
    attach_ffa(model, names, {k: FFALayer(p=1.0) for k in range(1, len(names) + 1)}, tap_stage=len(names))
    x = torch.randn(2, 3, 32, 32, requires_grad=True)
    model(x).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert len(model.fedfa.channels()) == len(names)


def test_layer_defaults_are_the_papers():
    # docs/methods/fedfa.md: variant full, p 0.5 (Algorithm 2), momentum α 0.99 (eq. 5), random_std 0.5 (FedFA-R)
    layer = FFALayer()
    assert (layer.variant, layer.p) == ("full", 0.5)
    x = _x()
    layer = FFALayer(p=1.0).train()
    layer(x)  # one active step from μ̄ = 0, σ̄ = 1
    mu, sigma = channel_stats(x)
    assert torch.allclose(layer.mu_bar, 0.01 * mu.mean(0), atol=1e-6)
    assert torch.allclose(layer.sigma_bar, 0.99 + 0.01 * sigma.mean(0), atol=1e-6)
    assert FFALayer("random").perturbation_std(mu, sigma) == (0.5, 0.5)
