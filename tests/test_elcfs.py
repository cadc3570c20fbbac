"""FedDG-ELCFS: the continuous frequency space interpolation (λ = 0, 1, between), the bank draws, the boundary and
background regions of a hand-made mask, region embeddings and the contrastive loss on hand-made features, the
first-order episodic update, the shared spectra (what leaves a client, under DP too) and one reproducible round
on the pixel task of tests/toy_pixels.py."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import ndimage
from support.augmentation import shift_training_batches
from toy import run_recording_replies
from toy_pixels import NAME, pixel_federation, registered

from feddg.aggregation.accounting import statistic_privacy
from feddg.algorithms import Reply, elcfs
from feddg.algorithms.components.local import local_batches
from feddg.algorithms.elcfs import (
    ELCFSParams,
    boundary_loss,
    boundary_regions,
    contrastive_loss,
    draw_rows,
    interpolation_ratios,
    region_embeddings,
)
from feddg.algorithms.harmofl import mix_low_frequency
from feddg.config import build_config
from feddg.engines.inprocess import run_setup
from feddg.federation.client import client_context
from feddg.federation.server import Server


@pytest.fixture(autouse=True, scope="module")
def pixel_task():
    with registered():
        yield


PIXELS = {"data": {"dataset": NAME}, "model": {"name": "pixelnet"}, "split": {"target": "c"},
          "partition": {"kind": "by_domain", "num_clients": 4}, "optim": {"lr": 0.5},
          "federation": {"rounds": 1, "batch_size": 16, "workers": 1}, "device": "cpu", "name": "pixels",
          "method": {"name": "elcfs"}}


def pixels(*over):
    return pixel_federation(build_config(PIXELS, list(over)))


# --------------------------------------------------------------------------- interpolation


def test_interpolation_keeps_the_image_at_0_takes_the_other_amplitude_at_1_and_mixes_between():
    """b = 0 on 1×6×6 images: F(0) = Σx, interpolated signed, so the result is x + λ(a_n − Σx)/36 per image."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1, 6, 6, generator=g) + 1.0
    other = torch.tensor([50.0, 20.0, 8.0]).reshape(3, 1, 1, 1)  # one drawn bank row per image
    lam = torch.tensor([0.0, 1.0, 0.3])
    out = mix_low_frequency(x, other, lam, 0)
    s = x.sum(dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(out[0], x[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].sum(), other[1].sum(), atol=1e-4, rtol=1e-5)
    want = x + lam.reshape(3, 1, 1, 1) * (other - s) / 36
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_the_window_follows_the_ratio_and_a_bank_of_another_width_is_refused():
    method = elcfs.ELCFS(ELCFSParams(window=0.34))  # b = ⌊6 · 0.34⌋ = 2: a 5×5 window
    x = torch.randn(2, 1, 6, 6)
    bank = torch.rand(3, 1, 5, 5) * 10
    out = method.transform(x, bank, np.array([1, 1, 2]), torch.Generator().manual_seed(0))
    assert out.shape == x.shape and not torch.allclose(out, x)
    with pytest.raises(ValueError, match="windows are 3 wide, these images need 5"):
        method.transform(x, bank[..., 1:4, 1:4], np.array([1, 1, 2]), None)
    assert torch.equal(method.transform(x, bank[:0], np.array([], dtype=np.int64), None), x)  # nobody else: as is


def test_a_bank_row_is_drawn_by_client_first_then_within_it():
    g = torch.Generator().manual_seed(0)
    owners = np.array([5, 5, 5, 7])  # client 7 has one spectrum, client 5 three: each client half the time
    rows = draw_rows(owners, 4000, g)
    assert set(rows.tolist()) == {0, 1, 2, 3}
    assert (rows == 3).float().mean().item() == pytest.approx(0.5, abs=0.03)
    lam = interpolation_ratios(1000, 0.2, 0.6, g)
    assert lam.min() >= 0.2 and lam.max() <= 0.6 and lam.mean().item() == pytest.approx(0.4, abs=0.02)
    assert torch.equal(interpolation_ratios(5, 1.0, 1.0, g), torch.ones(5))  # train_ELCFS.py: replacement
    with pytest.raises(ValueError, match="lam_min"):
        ELCFSParams(lam_min=0.8, lam_max=0.2)


# --------------------------------------------------------------------------- boundary regions and loss


def test_boundary_and_background_regions_of_a_hand_made_mask():
    mask = torch.zeros(1, 6, 6, dtype=torch.bool)
    mask[0, 1:4, 1:4] = True  # a 3×3 square
    bd, bg = boundary_regions(mask, 1, 1)
    ring = mask.clone()
    ring[0, 2, 2] = False  # erosion by the cross keeps only the centre
    assert torch.equal(bd, ring) and bd.sum() == 8
    arms = {(0, 1), (0, 2), (0, 3), (4, 1), (4, 2), (4, 3), (1, 0), (2, 0), (3, 0), (1, 4), (2, 4), (3, 4)}
    assert {tuple(p) for p in bg[0].nonzero().tolist()} == arms
    # two dilations: every pixel within L1 distance 2 of the square, minus the square
    _, bg2 = boundary_regions(mask, 1, 2)
    dist = [[max(0, 1 - r, r - 3) + max(0, 1 - c, c - 3) for c in range(6)] for r in range(6)]
    assert bg2[0].tolist() == [[0 < d <= 2 for d in row] for row in dist]
    # outside the image counts as background: a mask along the border is all boundary
    edge = torch.zeros(1, 6, 6, dtype=torch.bool)
    edge[0, 0, :] = True
    edge[0, 1, :] = True
    assert torch.equal(boundary_regions(edge, 1, 1)[0][0, 0], torch.ones(6, dtype=torch.bool))
    # the authors' scipy.ndimage calls, on random masks
    rng = np.random.default_rng(0)
    for _ in range(5):
        m = ndimage.binary_opening(rng.random((9, 11)) > 0.4)
        bd, bg = boundary_regions(torch.from_numpy(m)[None], 1, 5)
        assert np.array_equal(bd[0].numpy(), m & ~ndimage.binary_erosion(m, iterations=1))
        assert np.array_equal(bg[0].numpy(), ndimage.binary_dilation(m, iterations=5) & ~m)


def test_region_embeddings_average_the_features_over_the_region():
    f = torch.arange(16.0).reshape(2, 2, 2, 2)  # image 0: channel 0 = [[0, 1], [2, 3]], channel 1 = [[4, 5], [6, 7]]
    region = torch.tensor([[[1, 0], [0, 1]], [[0, 0], [0, 0]]], dtype=torch.bool)
    emb, keep = region_embeddings(f, region)
    assert keep.tolist() == [True, False]  # an empty region gives no embedding
    torch.testing.assert_close(emb, torch.tensor([[1.5, 5.5]]))
    up = torch.zeros(1, 4, 4, dtype=torch.bool)
    up[0, :2, :2] = True  # a mask at twice the features' resolution: resized (nearest)
    torch.testing.assert_close(region_embeddings(f[:1], up)[0], torch.tensor([[0.0, 4.0]]))
    odd = torch.zeros(1, 4, 4, dtype=torch.bool)
    odd[0, 1, 1] = True  # nearest keeps the even rows and columns only: this region vanishes at 2×2
    assert region_embeddings(f[:1], odd)[1].tolist() == [False]


def test_contrastive_loss_by_hand():
    e = math.e
    # one positive per anchor: both denominators hold the positive and the two negatives
    h = torch.tensor([[2.0, 0], [1, 0], [0, 3], [0, 1]])  # cosine: 1 within a label, 0 across
    y = torch.tensor([1, 1, 0, 0])
    for den in ("negatives", "all"):
        assert contrastive_loss(h, y, 1.0, den).item() == pytest.approx(math.log((e + 2) / e), rel=1e-6)
    # three positives of label 1 and one of label 0: the code's form keeps the other positives out
    h = torch.tensor([[1.0, 0], [1, 0], [1, 0], [0, 1]])
    y = torch.tensor([1, 1, 1, 0])
    assert contrastive_loss(h, y, 1.0, "negatives").item() == pytest.approx(math.log((e + 1) / e), rel=1e-6)
    assert contrastive_loss(h, y, 1.0, "all").item() == pytest.approx(math.log((2 * e + 1) / e), rel=1e-6)
    # the temperature divides the similarities
    assert contrastive_loss(h, y, 0.5, "negatives").item() == pytest.approx(math.log((e**2 + 1) / e**2), rel=1e-6)
    # no positive pair: zero; no negative: zero (and a finite gradient)
    assert contrastive_loss(h[2:], y[2:], 1.0).item() == 0.0
    hh = h[:3].clone().requires_grad_(True)
    loss = contrastive_loss(hh, y[:3], 1.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and torch.isfinite(hh.grad).all()


def test_contrastive_loss_takes_no_anchor_as_its_own_positive():
    """h = [1, 0], [0, 1] (label 1), [−1, 0] (label 0), τ = 1: s_01 = 0, s_02 = −1, s_12 = 0. The pairs (0, 1) and
    (1, 0) give log(1 + e⁻¹) and log 2, in both denominators; a pair (a, a) would add s_aa = 1 terms."""
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    y = torch.tensor([1, 1, 0])
    want = (math.log(1 + math.exp(-1)) + math.log(2)) / 2
    for den in ("negatives", "all"):
        assert contrastive_loss(h, y, 1.0, den).item() == pytest.approx(want, rel=1e-6)


def test_boundary_loss_contrasts_raw_and_transformed_boundary_embeddings_with_background_ones():
    g = torch.Generator().manual_seed(0)
    f_raw, f_trans = torch.randn(2, 3, 6, 6, generator=g), torch.randn(2, 3, 6, 6, generator=g)
    y = torch.zeros(2, 6, 6, dtype=torch.long)
    y[0, 1:4, 1:4] = 1
    y[1, 2:5, 0:3] = 1
    p = ELCFSParams(background_width=1)
    bd, bg = boundary_regions(y == 1, 1, 1)
    parts = [region_embeddings(f, r)[0] for r in (bd, bg) for f in (f_raw, f_trans)]
    want = contrastive_loss(torch.cat(parts), torch.tensor([1, 1, 1, 1, 0, 0, 0, 0]), 0.05)
    torch.testing.assert_close(boundary_loss(f_raw, f_trans, y, 2, p), want)
    assert boundary_loss(f_raw, f_trans, torch.zeros_like(y), 2, p).item() == 0.0  # no foreground: nothing to contrast
    y3 = y.clone()
    y3[1, 0, 4:] = 2  # a second foreground class adds its own term
    assert boundary_loss(f_raw, f_trans, y3, 3, p).item() != pytest.approx(boundary_loss(f_raw, f_trans, y3, 2, p).item())


# --------------------------------------------------------------------------- the episodic update


def test_one_step_is_the_first_order_episodic_update(monkeypatch):
    """Plain SGD on one full batch, the transform the identity, γ = 0: θ ← θ − η(∇L(θ) + ∇L(θ')),
    θ' = θ − β clip(∇L(θ), ±c); with second_order, the gradient of L(θ') is taken through θ'."""
    monkeypatch.setattr(elcfs.ELCFS, "transform", lambda self, x, *a: x)
    for second in (False, True):
        fed = pixels("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=256",
                     "method.params.boundary_weight=0", "method.params.meta_lr=0.5", "method.params.inner_clip=0.05",
                     f"method.params.second_order={second}")
        model, ctx = fed.model, client_context(fed, 0, 1)
        x, y = fed.dataset.get_batch(ctx.train_idx, train=True)
        theta = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}

        def loss_at(w):
            return fed.task.loss(torch.func.functional_call(model, w, (x,)), y)

        g = torch.autograd.grad(loss_at(theta), list(theta.values()), create_graph=second)
        fast = {n: t - 0.5 * gi.clamp(-0.05, 0.05) for (n, t), gi in zip(theta.items(), g, strict=True)}
        g_out = torch.autograd.grad(loss_at(fast), list(theta.values()))
        want = {n: (t - 0.1 * (gi + go)).detach() for (n, t), gi, go in zip(theta.items(), g, g_out, strict=True)}
        state = fed.method.server_init(model, None)
        state["bank"] = (np.zeros((0, 1, 1, 1), np.float32), np.zeros(0, np.int64))
        msg = {**fed.method.client_config(state, 0, 1), "lr": 0.1, "round": 1}
        reply, _ = fed.method.client_update(model, msg, {}, ctx)
        for n, w in want.items():
            np.testing.assert_allclose(reply[f"w/{n}"], w.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{n} {second}")


def test_one_step_takes_the_outer_loss_and_the_boundary_term_on_the_interpolated_images():
    """One bank row, λ fixed, b = 0: x^{k→n} = x + λ(a − Σx)/36 per image (no draw matters). Plain SGD on one full
    batch: θ ← θ − η ∇[L(x; θ) + L(x^{k→n}; θ') + γ L_bd(f(x; θ), f(x^{k→n}; θ'))], θ' = θ − β clip(∇L(x; θ), ±c)
    first order, the pixel net's conv features rebuilt by hand."""
    lam, a, gamma = 0.8, 20.0, 0.5
    fed = pixels("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=256", "method.params.window=0",
                 f"method.params.lam_min={lam}", f"method.params.lam_max={lam}", f"method.params.boundary_weight={gamma}",
                 "method.params.meta_lr=0.5", "method.params.inner_clip=0.05")
    model, ctx = fed.model, client_context(fed, 0, 1)
    x, y = fed.dataset.get_batch(ctx.train_idx, train=True)
    x_trans = x + lam * (a - x.sum(dim=(-2, -1), keepdim=True)) / 36
    theta = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}

    def features(w: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.conv2d(images, w["conv.weight"], w["conv.bias"], padding=1))

    def head(w: dict[str, torch.Tensor], f: torch.Tensor) -> torch.Tensor:
        return F.conv2d(f, w["classifier.weight"], w["classifier.bias"])

    f_raw = features(theta, x)
    loss_inner = fed.task.loss(head(theta, f_raw), y)
    g = torch.autograd.grad(loss_inner, list(theta.values()), retain_graph=True)
    fast = {n: t - 0.5 * gi.clamp(-0.05, 0.05) for (n, t), gi in zip(theta.items(), g, strict=True)}
    f_trans = features(fast, x_trans)
    bd = boundary_loss(f_raw, f_trans, y, 2, fed.method.params)
    assert bd.item() > 0.01  # the boundary term is in play
    total = loss_inner + fed.task.loss(head(fast, f_trans), y) + gamma * bd
    grads = torch.autograd.grad(total, list(theta.values()))
    want = {n: (t - 0.1 * gr).detach() for (n, t), gr in zip(theta.items(), grads, strict=True)}
    state = fed.method.server_init(model, None)
    state["bank"] = (np.full((1, 1, 1, 1), a, np.float32), np.array([1]))  # one row, of client 1
    msg = {**fed.method.client_config(state, 0, 1), "lr": 0.1, "round": 1}
    reply, _ = fed.method.client_update(model, msg, {}, ctx)
    for n, w in want.items():
        np.testing.assert_allclose(reply[f"w/{n}"], w.numpy(), rtol=1e-5, atol=1e-6, err_msg=n)


def test_the_reported_loss_is_the_mean_over_the_batches_of_the_inner_plus_the_outer_loss():
    """lr = β = 0, γ = 0, no other client's spectra (x^{k→n} = x): θ' = θ, so train_loss is the mean over the
    client's batches (drawn again from an equal stream) of L(x_b; θ) + L(x_b; θ') = 2 L(x_b; θ)."""
    fed = pixels("method.params.meta_lr=0", "method.params.boundary_weight=0")
    model = fed.model
    state = fed.method.server_init(model, None)
    state["bank"] = (np.zeros((0, 1, 1, 1), np.float32), np.zeros(0, np.int64))
    msg = {**fed.method.client_config(state, 0, 1), "lr": 0.0, "round": 1}
    reply, _ = fed.method.client_update(model, msg, {}, client_context(fed, 0, 1))
    with torch.no_grad():
        losses = [2 * float(fed.task.loss(model(x), y)) for _, x, y in local_batches(model, client_context(fed, 0, 1))]
    assert len(losses) > 1 and reply["train_loss"] == pytest.approx(np.mean(losses), rel=1e-5)


# --------------------------------------------------------------------------- what is shared


def test_each_client_uploads_the_amplitude_windows_of_an_eighth_of_its_images(tmp_path):
    fed = pixels("method.params.window=0.34")  # 6×6 images: b = 2, 5×5 windows
    server = Server(fed, tmp_path)
    run_setup(server)
    amps, owners = server.state["bank"]
    for cid, client in enumerate(fed.clients):
        n = len(client.train_idx)
        m = max(1, n // 8)
        assert (owners == cid).sum() == m
        ctx = client_context(fed, cid, 0)  # the setup's stream: its first draw picks the images
        pick = client.train_idx[torch.randperm(n, generator=ctx.generator)[:m].numpy()]
        x = fed.dataset.x[torch.as_tensor(pick)]
        spec = torch.fft.fft2(x.double())
        amp = spec.abs()
        amp[..., 0, 0] = spec[..., 0, 0].real  # the zero frequency: the signed sum
        want = torch.fft.fftshift(amp, dim=(-2, -1))[..., 1:6, 1:6]
        np.testing.assert_allclose(amps[owners == cid], want.numpy(), rtol=1e-5, atol=1e-4)
    assert amps.shape[1:] == (1, 5, 5) and amps.dtype == np.float32
    msg = fed.method.client_config(server.state, 2, 1)  # the rows of the other clients only
    assert np.array_equal(msg["bank/owner"], owners[owners != 2])
    assert np.array_equal(msg["bank/amp"], amps[owners != 2])


def test_the_shared_spectra_are_clipped_and_noised_once_and_floored_at_zero_but_the_signed_sum(tmp_path):
    over = ("method.params.window=0.34", "method.params.dp.noise_multiplier=0.05", "method.params.dp.clip=10")
    fed = pixels(*over)
    clean_method = type(fed.method)(fed.method.params.model_copy(update={"dp": None}))
    request = fed.method.setup_request({})
    clean_ctx = client_context(fed, 1, 0)
    clean, _ = clean_method.client_setup(fed.model, request, {}, clean_ctx)
    noisy, _ = fed.method.client_setup(fed.model, request, {}, client_context(fed, 1, 0))
    assert set(noisy) == {"amp/bank"} and noisy["amp/bank"].shape == clean["amp/bank"].shape
    assert clean["amp/bank"].shape[1:] == (1, 5, 5)
    flat = clean["amp/bank"].astype(np.float64).ravel()
    sigma = 0.05 * 2 * 10  # σ = z·Δ, Δ = 2C
    assert np.linalg.norm(flat) > 10  # the clip binds
    noise = sigma * torch.randn(flat.size, generator=clean_ctx.noise, dtype=torch.float64).numpy()
    noised = (flat * 10 / np.linalg.norm(flat) + noise).reshape(clean["amp/bank"].shape)
    want = np.maximum(noised, 0.0)
    want[..., 2, 2] = noised[..., 2, 2]  # the window's centre is the images' signed sum: not an amplitude to floor
    np.testing.assert_allclose(noisy["amp/bank"], want, atol=1e-5)
    assert (want == 0).any() and (want > 0).any()  # the floor binds here and there
    assert fed.method.privacy(7) == statistic_privacy(fed.method.params.dp, 1)  # one release, whatever the rounds
    server = Server(fed, tmp_path)
    server.round = 3
    res = server.write_results()["privacy"]
    assert res["releases"] == 1 and res["unit"] == "client" and res["sigma"] == pytest.approx(sigma)
    assert pixels().method.privacy(3) is None


def test_a_client_of_fewer_than_eight_images_uploads_one_spectrum_of_an_unaugmented_image(monkeypatch):
    """max(1, ⌊5/8⌋) = 1 row; b = 0, so the row is one of the five images' Σx (an "augmentation" adding 100 to every
    pixel in training batches must not reach it)."""
    fed = pixels("method.params.window=0")
    shift_training_batches(monkeypatch, fed.dataset)
    ctx = client_context(fed, 1, 0)
    ctx.train_idx = ctx.train_idx[:5]
    reply, _ = fed.method.client_setup(fed.model, fed.method.setup_request({}), {}, ctx)
    assert reply["amp/bank"].shape == (1, 1, 1, 1)
    sums = fed.dataset.x[torch.as_tensor(ctx.train_idx)].double().sum(dim=(1, 2, 3)).numpy()
    assert np.isclose(sums, reply["amp/bank"].item(), rtol=1e-5, atol=1e-4).any()


def test_the_bank_tags_each_row_with_the_id_of_the_client_that_sent_it():
    """Replies in any order (here client 2's before client 0's): a client is sent every row but its own."""
    method = elcfs.ELCFS()
    replies = [Reply(2, {"amp/bank": np.full((3, 1, 1, 1), 2.0, np.float32)}),
               Reply(0, {"amp/bank": np.full((1, 1, 1, 1), 0.0, np.float32)})]
    state = method.server_setup({"weights": {}}, replies)
    assert state["bank"][1].tolist() == [2, 2, 2, 0]
    msg = method.client_config(state, 2, 1)
    assert msg["bank/owner"].tolist() == [0] and msg["bank/amp"].ravel().tolist() == [0.0]


def test_the_defaults_follow_the_authors_code():
    """docs/methods/elcfs.md: the demo's L = 0.003, λ ~ U(0, 1), ⌊n/8⌋ spectra, β = 1e−3, c = 100, γ = 0.1,
    τ = 0.05, erosion 1 / dilation 5, NTXentLoss's denominator, first order, no DP."""
    p = ELCFSParams()
    assert (p.window, p.lam_min, p.lam_max, p.bank_fraction) == (0.003, 0.0, 1.0, 0.125)
    assert (p.meta_lr, p.inner_clip, p.boundary_weight, p.temperature) == (1e-3, 100.0, 0.1, 0.05)
    assert (p.boundary_width, p.background_width, p.denominator, p.second_order, p.dp) == (1, 5, "negatives", False,
                                                                                          None)


# --------------------------------------------------------------------------- a round


def _round(tmp_path):
    fed = pixels()
    return (fed, *run_recording_replies(fed, tmp_path))


def test_one_round_is_reproducible_and_replies_only_the_weights(tmp_path):
    fed, a, replies = _round(tmp_path / "a")
    _, b, _ = _round(tmp_path / "b")
    for k, v in a.state["weights"].items():
        np.testing.assert_array_equal(v, b.state["weights"][k], err_msg=k)
    weights = {f"w/{k}" for k in fed.model.state_dict()}
    assert len(replies) == 4
    for r, client in zip(replies, fed.clients, strict=True):
        assert set(r) == weights | {"num_examples", "train_loss"} and r["num_examples"] == len(client.train_idx)
        assert math.isfinite(r["train_loss"])
    row = a.metrics[0]
    assert row["bank_spectra"] == sum(max(1, len(c.train_idx) // 8) for c in fed.clients)
    assert row["time_bank_setup_s"] > 0 and math.isfinite(row["ood_pagree"])


def test_the_method_is_refused_without_masks():
    from feddg.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="method elcfs needs dense_masks"):
        build_config({}, ["method.name=elcfs"])
