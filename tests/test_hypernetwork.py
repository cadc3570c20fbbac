"""The hypernetwork of hFedF Table 8, its vector–Jacobian product, and the Table-6 auto-encoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from toy import ToyNet

from feddg.algorithms.components.embedding_ae import EmbeddingAutoencoder, train_and_embed, unit_range
from feddg.algorithms.components.hypernetwork import HIDDEN, HyperNetwork, default_embedding_dim, hypernetwork_vjp

SHAPES = [("a.weight", torch.Size([2, 3])), ("a.bias", torch.Size([2])), ("b", torch.Size([3, 1, 2]))]


def _tiny(init: str = "default", n: int = 3) -> HyperNetwork:
    torch.manual_seed(0)
    params = {name: torch.randn(shape) for name, shape in SHAPES}
    return HyperNetwork(SHAPES, n, init=init, init_params=params)


@pytest.mark.parametrize(("n", "dim"), [(1, 1), (3, 1), (4, 2), (7, 2), (8, 3), (20, 6)])
def test_embedding_dim_is_floor_of_one_plus_n_over_4(n, dim):
    assert default_embedding_dim(n) == dim


def test_architecture_is_table_8():
    h = _tiny(n=5)
    assert h.embeddings.weight.shape == (5, default_embedding_dim(5))  # ν ∈ R^{N×e}
    layers = list(h.trunk)
    linears = [m for m in layers if isinstance(m, nn.Linear)]
    dims = [(m.in_features, m.out_features) for m in linears]
    assert dims == [(2, 50), (50, 50), (50, 50), (50, 50)]  # three hidden layers of 50 neurons (§5.1)
    # LeakyReLU after the first three linear layers, none after the fourth
    kinds = [type(m).__name__ for m in layers]
    assert kinds == ["Linear", "LeakyReLU", "Linear", "LeakyReLU", "Linear", "LeakyReLU", "Linear"]
    # one head per parameter tensor, 50 -> numel
    assert [(m.in_features, m.out_features) for m in h.heads] == [(50, 6), (50, 2), (50, 6)]
    # θ is everything but ν
    theta_ids = {id(p) for p in h.theta()}
    assert id(h.embeddings.weight) not in theta_ids
    assert len(theta_ids) == len(list(h.parameters())) - 1


def test_theta_names_name_theta_in_order() -> None:
    h = _tiny()
    trunk = [f"trunk.{i}.{k}" for i in (0, 2, 4, 6) for k in ("weight", "bias")]  # the Linears between LeakyReLUs
    heads = [f"heads.{i}.{k}" for i in range(len(SHAPES)) for k in ("weight", "bias")]
    assert h.theta_names() == trunk + heads  # ν (embeddings.weight) is not in θ
    named = dict(h.named_parameters())
    assert all(named[n] is p for n, p in zip(h.theta_names(), h.theta(), strict=True))


def test_forward_is_table_8_rebuilt_from_the_layers_weights() -> None:
    """φ_k = W_k z + b_k with z the trunk of ν[i]: three Linear + LeakyReLU, then a Linear with no activation (the
    paper's Table 8 names LeakyReLU without a slope; PyTorch's default 0.01, as pFedHN's nn.LeakyReLU())."""
    h = _tiny(init="model")
    z = h.embeddings.weight[2].detach()
    for i, linear in enumerate(m for m in h.trunk if isinstance(m, nn.Linear)):
        z = torch.nn.functional.linear(z, linear.weight.detach(), linear.bias.detach())
        z = torch.nn.functional.leaky_relu(z, 0.01) if i < 3 else z
    phi = h.for_client(2)
    for (name, shape), head in zip(SHAPES, h.heads, strict=True):
        want = torch.nn.functional.linear(z, head.weight.detach(), head.bias.detach()).view(shape)
        assert torch.allclose(phi[name].detach(), want, atol=1e-6), name


def test_generates_every_parameter_of_a_client_model_with_its_shape():
    model = ToyNet()
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    h = HyperNetwork(shapes, 4, init="model", init_params=dict(model.named_parameters()))
    phi = h.for_client(2)
    assert list(phi) == [n for n, _ in shapes]
    assert all(phi[n].shape == s for n, s in shapes)
    model.load_state_dict({**model.state_dict(), **{n: t.detach() for n, t in phi.items()}})


def test_model_init_starts_each_head_at_the_client_models_tensor():
    torch.manual_seed(0)
    model = ToyNet()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    h = HyperNetwork([(n, p.shape) for n, p in params.items()], 3, init="model", init_params=params)
    for name, head in zip(h.names, h.heads, strict=True):
        assert torch.equal(head.bias.detach(), params[name].flatten())
        # U(±√3 σ/√50): the largest of ≥ 50 draws sits near the bound, and the std is σ/√50
        sigma = float(params[name].std(unbiased=False))
        bound = np.sqrt(3.0) * sigma / np.sqrt(HIDDEN)
        top = float(head.weight.detach().abs().max())
        assert 0.8 * bound < top <= bound + 1e-7 if bound > 0 else top == 0.0  # a constant tensor: zero weight
    fc = "fc.weight"
    weight = h.heads[h.names.index(fc)].weight.detach()
    assert float(weight.std()) == pytest.approx(float(params[fc].std(unbiased=False)) / np.sqrt(HIDDEN), rel=0.05)
    # generated weights differ from the init by W z, which is of the init's own scale
    phi = {n: t.detach() for n, t in h.for_client(0).items()}
    fc = "fc.weight"
    assert float((phi[fc] - params[fc]).std()) < 2 * float(params[fc].std())


def test_vjp_equals_gradient_of_sum_phi_dot_v_and_the_materialised_jacobian():
    h = _tiny()
    g = torch.Generator().manual_seed(1)
    v = {n: torch.randn(s, generator=g) for n, s in SHAPES}
    g_list, g_nu = hypernetwork_vjp(h, 1, v)
    assert [g.shape for g in g_list] == [p.shape for p in h.theta()]
    g_theta, g_nu = torch.cat([g.flatten() for g in g_list]), g_nu.flatten()

    # (1) gradient of Σ_k <h_k(θ, ν[1]), v_k> computed directly
    h.zero_grad()
    phi = h.for_client(1)
    sum((phi[n] * v[n]).sum() for n, _ in SHAPES).backward()
    direct_theta = torch.cat([p.grad.flatten() for p in h.theta()])
    assert torch.allclose(g_theta, direct_theta, atol=1e-6)
    assert torch.allclose(g_nu, h.embeddings.weight.grad.flatten(), atol=1e-6)
    # only client 1's row of ν gets a gradient
    rows = g_nu.view(3, -1)
    assert rows[1].abs().sum() > 0 and rows[0].abs().sum() == 0 and rows[2].abs().sum() == 0

    # (2) Jᵀ v with the Jacobian materialised (test only) through torch.func
    names = [n for n, _ in h.named_parameters()]
    values = tuple(p.detach() for _, p in h.named_parameters())

    def flat_phi(*ps):
        params = dict(zip(names, ps, strict=True))
        out = torch.func.functional_call(h, params, (params["embeddings.weight"][1],))
        return torch.cat([out[n].flatten() for n, _ in SHAPES])

    jac = torch.func.jacrev(flat_phi, argnums=tuple(range(len(names))))(*values)
    vflat = torch.cat([v[n].flatten() for n, _ in SHAPES])
    jtv = {n: torch.einsum("o,o...->...", vflat, j) for n, j in zip(names, jac, strict=True)}
    theta_names = [n for n, p in h.named_parameters() if not n.startswith("embeddings")]
    assert torch.allclose(g_theta, torch.cat([jtv[n].flatten() for n in theta_names]), atol=1e-5)
    assert torch.allclose(g_nu, jtv["embeddings.weight"].flatten(), atol=1e-5)


def test_default_init_is_the_client_models_tensors() -> None:
    params = {name: torch.randn(shape) for name, shape in SHAPES}
    h = HyperNetwork(SHAPES, 3, init_params=params)  # no init given: "model" (docs/methods/hfedf.md)
    for (name, _), head in zip(SHAPES, h.heads, strict=True):
        assert torch.equal(head.bias.detach(), params[name].flatten())


def test_an_unknown_init_or_a_model_init_without_the_models_tensors_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown hypernetwork init"):
        HyperNetwork(SHAPES, 3, init="xavier")
    with pytest.raises(ValueError, match="needs the client model's initial parameters"):
        HyperNetwork(SHAPES, 3, init="model")


def test_vjp_without_embeddings_returns_none_for_nu():
    h = _tiny()
    v = {n: torch.ones(s) for n, s in SHAPES}
    g_theta, g_nu = hypernetwork_vjp(h, 0, v, wrt_embeddings=False)
    assert g_nu is None and [g.shape for g in g_theta] == [p.shape for p in h.theta()]


# ------------------------------------------------------------------- auto-encoder, Table 6


def test_autoencoder_is_table_6_at_32_px_and_reconstructs_other_sizes():
    ae = EmbeddingAutoencoder(3, 32, latent_dim=2)
    x = torch.rand(5, 3, 32, 32)
    assert ae.encoder_conv(x).shape == (5, 32, 8, 8)  # flatten: 2048
    assert ae.to_latent.in_features == 2048 and ae.encode(x).shape == (5, 2)
    with torch.no_grad():
        y = ae(x)
    assert y.shape == x.shape and float(y.min()) >= 0 and float(y.max()) <= 1  # Sigmoid
    assert EmbeddingAutoencoder(3, 28, 1)(torch.rand(2, 3, 28, 28)).shape == (2, 3, 28, 28)
    assert EmbeddingAutoencoder(1, 6, 1)(torch.rand(2, 1, 6, 6)).shape == (2, 1, 6, 6)


def _table6_forward(ae, x, side):
    """Table 6 rebuilt from torch.nn.functional with the module's weights: (reconstruction, latent)."""
    c1, c2 = (m for m in ae.encoder_conv if isinstance(m, nn.Conv2d))
    d1, d2 = (m for m in ae.decoder_conv if isinstance(m, nn.ConvTranspose2d))
    h = F.max_pool2d(F.relu(F.conv2d(x, c1.weight, c1.bias, stride=1, padding=1)), 2, 2, ceil_mode=True)
    h = F.max_pool2d(F.relu(F.conv2d(h, c2.weight, c2.bias, stride=1, padding=1)), 2, 2, ceil_mode=True)
    z = F.linear(h.flatten(1), ae.to_latent.weight, ae.to_latent.bias)
    h = F.linear(z, ae.from_latent.weight, ae.from_latent.bias).view(-1, 32, side, side)
    h = F.relu(F.conv_transpose2d(h, d1.weight, d1.bias, stride=2))
    out = torch.sigmoid(F.conv_transpose2d(h, d2.weight, d2.bias, stride=2))
    return out[..., : x.shape[-2], : x.shape[-1]], z


def test_autoencoder_forward_is_table_6_rebuilt_from_functional_ops():
    # 6 px: ceil-mode pools 6 -> 3 -> 2, decoder 2 -> 4 -> 8, cropped to 6
    torch.manual_seed(0)
    ae = EmbeddingAutoencoder(2, 6, latent_dim=3)
    c1, c2 = (m for m in ae.encoder_conv if isinstance(m, nn.Conv2d))
    d1, d2 = (m for m in ae.decoder_conv if isinstance(m, nn.ConvTranspose2d))
    assert [c1.weight.shape, c2.weight.shape] == [(16, 2, 3, 3), (32, 16, 3, 3)]
    assert [d1.weight.shape, d2.weight.shape] == [(32, 16, 2, 2), (16, 2, 2, 2)]
    x = torch.randn(4, 2, 6, 6)
    want, z = _table6_forward(ae, x, side=2)
    with torch.no_grad():
        assert torch.allclose(ae.encode(x), z, atol=1e-6)
        assert torch.allclose(ae(x), want, atol=1e-6)


def test_unit_range_maps_a_constant_image_to_zeros():
    assert torch.equal(unit_range(torch.full((2, 1, 3, 3), 4.0)), torch.zeros(2, 1, 3, 3))


def test_unit_range_scales_each_image_to_0_1():
    x = torch.tensor([[[[-1.0, 1.0], [0.0, 3.0]]], [[[2.0, 2.0], [4.0, 6.0]]]])
    expected = torch.tensor([[[[0.0, 0.5], [0.25, 1.0]]], [[[0.0, 0.0], [0.5, 1.0]]]])
    assert torch.allclose(unit_range(x), expected)


def test_autoencoder_training_lowers_reconstruction_and_returns_the_mean_latent():
    torch.manual_seed(0)
    images = torch.rand(32, 1, 8, 8) * torch.linspace(0, 1, 8).view(1, 1, 1, 8)
    ae = EmbeddingAutoencoder(1, 8, 3)
    with torch.no_grad():
        before = float(torch.nn.functional.mse_loss(ae(images), unit_range(images)))
    latent = train_and_embed(ae, images, epochs=20, lr=1e-2, batch_size=16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = float(torch.nn.functional.mse_loss(ae(images), unit_range(images)))
        assert np.allclose(latent, ae.encode(images).mean(0).numpy(), atol=1e-6)
    assert after < 0.5 * before
    assert latent.shape == (3,) and latent.dtype == np.float32


def test_autoencoder_training_is_adam_on_the_mse_to_unit_range_targets_in_shuffled_batches():
    # rebuild C.2's loop by hand: per epoch a permutation from the generator, Adam steps on MSE(ae(x), unit_range(x)),
    # the last batch short (10 images in batches of 4, 4, 2)
    torch.manual_seed(0)
    images = torch.randn(10, 1, 4, 4) * 3 + 1  # normalised-looking inputs: the targets are their [0, 1] rescaling
    ae = EmbeddingAutoencoder(1, 4, 2)
    ref = EmbeddingAutoencoder(1, 4, 2)
    ref.load_state_dict(ae.state_dict())
    train_and_embed(ae, images, epochs=2, lr=1e-2, batch_size=4, generator=torch.Generator().manual_seed(3))
    opt, g = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.Generator().manual_seed(3)
    for _ in range(2):
        order = torch.randperm(10, generator=g)
        for b in (order[:4], order[4:8], order[8:]):
            opt.zero_grad()
            x = images[b]
            lo, hi = x.amin((1, 2, 3), keepdim=True), x.amax((1, 2, 3), keepdim=True)
            torch.nn.functional.mse_loss(ref(x), (x - lo) / (hi - lo)).backward()
            opt.step()
    for (name, p), q in zip(ae.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5), name
