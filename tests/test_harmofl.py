"""HarmoFL: the low-frequency window, amplitude normalisation (replaced / interpolated, phase kept, a real inverse
FFT), the weight-perturbed step on quadratics, the setup upload and the server's average, one reproducible round."""

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from support.augmentation import shift_training_batches
from toy import run_recording_replies, toy_federation

from feddg.algorithms import harmofl
from feddg.algorithms.base import ClientContext
from feddg.algorithms.components.local import local_batches
from feddg.algorithms.harmofl import (
    AmpNormNet,
    amplitude_window,
    low_freq_mask,
    low_freq_radius,
    mix_low_frequency,
    perturb,
    perturbed_step,
)
from feddg.devices import Inputs, images
from feddg.engines.inprocess import run_inprocess, run_setup
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.messages import load_weights

# --------------------------------------------------------------------------- the window


def test_the_low_frequency_window_is_2b_plus_1_wide_around_the_zero_frequency():
    assert low_freq_radius(384, 384, 0.0) == 0  # the code's L = 0: the zero frequency alone
    assert low_freq_radius(384, 384, 0.003) == 1 and low_freq_radius(384, 384, 0.01) == 3
    assert low_freq_radius(6, 8, 0.34) == 2 and low_freq_radius(12, 6, 0.34) == 2  # the shorter side counts
    mask = low_freq_mask(8, 8, 1)  # fft2 layout: frequencies -1, 0, 1 on both axes, wrapping around
    assert mask.sum() == 9
    assert all(mask[u, v] for u in (7, 0, 1) for v in (7, 0, 1))
    assert not mask[2, 0] and not mask[0, 6]
    assert low_freq_mask(5, 7, 0).nonzero().tolist() == [[0, 0]]
    for height, width, radius in ((6, 6, 3), (6, 8, 3), (8, 6, 3), (8, 8, -1)):  # either side too short; b < 0
        with pytest.raises(ValueError, match="does not fit"):
            low_freq_mask(height, width, radius)


# --------------------------------------------------------------------------- amplitude normalisation


def test_dc_only_normalisation_moves_each_channels_signed_sum_to_the_target():
    """b = 0: F(0) = Σx, interpolated signed (raw pixels' amplitude in any normalisation): x + λ(t − Σx)/(HW) per
    channel, a negative sum included (its amplitude |Σx| would have moved the other way)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 6, generator=g) + torch.tensor([2.0, -1.0, 0.3])[:, None, None]
    target = torch.tensor([40.0, 7.0, -90.0]).reshape(1, 3, 1, 1)
    s = x.sum(dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(amplitude_window(x, 0), s)  # the window's centre: the signed sum
    for lam in (1.0, 0.25):
        out = mix_low_frequency(x, target, lam, 0)
        want = x + lam * (target - s) / 30
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # the phase is kept at every other frequency, the amplitude outside the window too
    out = mix_low_frequency(x, target, 1.0, 0)
    fx, fo = torch.fft.fft2(x), torch.fft.fft2(out)
    outside = ~low_freq_mask(5, 6, 0)
    torch.testing.assert_close(fo.angle()[..., outside], fx.angle()[..., outside], atol=1e-3, rtol=0)
    torch.testing.assert_close(fo.abs()[..., outside], fx.abs()[..., outside], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mix_low_frequency(x, target, 0.0, 0), x, atol=1e-5, rtol=1e-5)  # λ = 0: x itself


@pytest.mark.parametrize("radius", [0, 1, 3])
def test_mixing_normalised_images_is_mixing_their_raw_pixels_then_normalising(radius):
    """The papers mix raw, non-negative pixels; feddg's images arrive as (x − m)/s per channel. The two agree (a
    bright image moves toward a dark one, not away from it), which mixing |Σx| at the zero frequency broke."""
    g = torch.Generator().manual_seed(0)
    bright, dark = torch.rand(2, 3, 16, 16, generator=g), 0.3 * torch.rand(2, 3, 16, 16, generator=g)
    m, s = torch.tensor([0.5, 0.4, 0.3])[:, None, None], torch.tensor([0.5, 0.2, 0.25])[:, None, None]
    lam = torch.tensor([0.3, 1.0])
    got = mix_low_frequency((bright - m) / s, amplitude_window((dark - m) / s, radius), lam, radius)
    raw = mix_low_frequency(bright, amplitude_window(dark, radius), lam, radius)
    torch.testing.assert_close(got, (raw - m) / s, atol=2e-5, rtol=1e-5)
    assert ((got * s + m).mean() < bright.mean()).item()  # darker, toward the other site


def test_a_window_of_half_width_one_rescales_the_first_harmonic_and_keeps_the_second():
    """x = 1 + cos(2πh/8) + ½cos(4πh/8) on 8×8: F(0) = 64, F(±1, 0) = 32, F(±2, 0) = 16, all of phase 0."""
    h = torch.arange(8.0)[:, None].expand(8, 8)
    x = (1 + torch.cos(2 * math.pi * h / 8) + 0.5 * torch.cos(4 * math.pi * h / 8))[None, None]
    assert torch.allclose(amplitude_window(x, 1)[0, 0], torch.tensor([[0, 32, 0], [0, 64, 0], [0, 32, 0.0]]),
                          atol=1e-3)
    target = torch.tensor([[0, 16, 0], [0, 32, 0], [0, 16, 0.0]])[None, None]  # fftshift layout: DC in the centre
    want = {1.0: 0.5 + 0.5 * torch.cos(2 * math.pi * h / 8) + 0.5 * torch.cos(4 * math.pi * h / 8),
            0.5: 0.75 + 0.75 * torch.cos(2 * math.pi * h / 8) + 0.5 * torch.cos(4 * math.pi * h / 8)}
    for lam, expected in want.items():
        out = mix_low_frequency(x, target, lam, 1)
        torch.testing.assert_close(out[0, 0], expected, atol=1e-5, rtol=1e-5)
        # the inverse FFT of Â e^{iP} was real: the output's spectrum is Â e^{iP} itself, nothing was dropped
        spec = torch.fft.fft2(x)
        amp = torch.fft.fftshift(spec.abs(), dim=(-2, -1))
        amp[..., 3:6, 3:6] = (1 - lam) * amp[..., 3:6, 3:6] + lam * target
        built = torch.polar(torch.fft.ifftshift(amp, dim=(-2, -1)), spec.angle())
        assert torch.fft.ifft2(built).imag.abs().max() < 1e-5
        torch.testing.assert_close(torch.fft.fft2(out), built, atol=1e-3, rtol=1e-4)


# --------------------------------------------------------------------------- weight perturbation


class Vector(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w))


def _step(w0, c, lr, alpha, clip=None):
    model = Vector(w0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    c = torch.tensor(c)
    loss = perturbed_step(list(model.parameters()), lambda: 0.5 * (c * model.w**2).sum(), opt, scaler, alpha,
                          lambda: torch.autocast("cpu", enabled=False), clip)
    return model.w.detach(), float(loss)


def test_the_perturbed_step_on_a_quadratic_is_the_gradient_at_w_plus_delta_applied_from_w():
    """L = ½ Σ c_i w_i²: g = c∘w, δ = α g/‖g‖, w' = w − η c∘(w + δ)."""
    w, c, lr, alpha = np.array([3.0, -4.0]), np.array([1.0, 2.0]), 0.1, 0.05
    g = c * w
    delta = alpha * g / np.linalg.norm(g)
    new, loss = _step(w.tolist(), c.tolist(), lr, alpha)
    np.testing.assert_allclose(new.numpy(), w - lr * c * (w + delta), rtol=1e-6)
    assert loss == pytest.approx(0.5 * (c * w**2).sum())  # the reported loss is the one at w
    plain, _ = _step(w.tolist(), c.tolist(), lr, 0.0)  # α = 0: one plain step
    np.testing.assert_allclose(plain.numpy(), w - lr * c * w, rtol=1e-6)
    # L = ½‖w‖²: w' = w (1 − η − ηα/‖w‖)
    iso, _ = _step(w.tolist(), [1.0, 1.0], lr, alpha)
    np.testing.assert_allclose(iso.numpy(), w * (1 - lr - lr * alpha / 5.0), rtol=1e-6)


def test_the_gradient_taken_at_w_plus_delta_is_clipped_to_the_global_norm():
    """optim.grad_clip = 1: w' = w − η G/‖G‖ with G = c∘(w + δ) (‖G‖ > 1 here), and α = 0: w − η g/‖g‖."""
    w, c, lr, alpha = np.array([3.0, -4.0]), np.array([1.0, 2.0]), 0.1, 0.05
    g = c * w
    big = c * (w + alpha * g / np.linalg.norm(g))
    new, _ = _step(w.tolist(), c.tolist(), lr, alpha, clip=1.0)
    np.testing.assert_allclose(new.numpy(), w - lr * big / np.linalg.norm(big), rtol=1e-6)
    plain, _ = _step(w.tolist(), c.tolist(), lr, 0.0, clip=1.0)
    np.testing.assert_allclose(plain.numpy(), w - lr * g / np.linalg.norm(g), rtol=1e-6)


def test_a_tiny_gradient_still_gives_a_perturbation_of_length_alpha():
    """‖g‖ = 5e-7: δ = α g/(‖g‖ + 1e−12) is α times the unit gradient (a larger guard would shrink it)."""
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([3e-7, 4e-7])
    (delta,) = perturb([a], 0.05)
    torch.testing.assert_close(delta, torch.tensor([0.03, 0.04]), rtol=1e-5, atol=0)


def test_perturb_adds_alpha_times_the_unit_gradient_over_all_parameters():
    a, b = torch.nn.Parameter(torch.tensor([1.0, 1.0])), torch.nn.Parameter(torch.tensor([2.0]))
    none = torch.nn.Parameter(torch.tensor([5.0]))  # no gradient: untouched
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # ‖g‖ = 5 over both
    deltas = perturb([a, b, none], 0.5)
    torch.testing.assert_close(deltas[0], torch.tensor([0.3, 0.0]))
    torch.testing.assert_close(deltas[1], torch.tensor([0.4]))
    assert torch.equal(deltas[2], torch.zeros(1)) and none.item() == 5.0
    torch.testing.assert_close(a.detach(), torch.tensor([1.3, 1.0]))
    torch.testing.assert_close(b.detach(), torch.tensor([2.4]))
    a.grad = torch.tensor([float("inf"), 0.0])  # an fp16 overflow step: no perturbation
    assert all(not d.any() for d in perturb([a, b], 0.5))


# --------------------------------------------------------------------------- setup and rounds


@pytest.mark.parametrize("radius", [0, 1])
def test_each_client_uploads_its_mean_amplitude_window_and_the_server_averages_them(tmp_path, radius):
    fed = toy_federation("method.name=harmofl", f"method.params.radius={radius}")
    assert isinstance(fed.model, AmpNormNet) and fed.model.amp.shape == (1, 2 * radius + 1, 2 * radius + 1)
    server = Server(fed, tmp_path)
    setup = []
    client_setup = fed.method.client_setup

    def record(*a):
        out = client_setup(*a)
        setup.append(out[0])
        return out

    fed.method.client_setup = record
    run_setup(server)
    assert len(setup) == 4 and all(set(r) == {"amp/mean"} for r in setup)
    for reply, client in zip(setup, fed.clients, strict=True):  # by hand: |fft2| of every training image, mean
        x = fed.dataset.x[torch.as_tensor(client.train_idx)]
        spec = torch.fft.fft2(x.double())
        amp = spec.abs()
        amp[..., 0, 0] = spec[..., 0, 0].real  # the zero frequency: the signed sum
        want = torch.fft.fftshift(amp, dim=(-2, -1)).mean(0)[:, 3 - radius : 4 + radius, 3 - radius : 4 + radius]
        np.testing.assert_allclose(reply["amp/mean"], want.numpy(), rtol=1e-5, atol=1e-4)
        if radius == 0:
            np.testing.assert_allclose(reply["amp/mean"].ravel(), x.sum(dim=(1, 2, 3)).mean(), rtol=1e-5, atol=1e-4)
    global_amp = np.mean([r["amp/mean"] for r in setup], axis=0)  # unweighted, as the code's 1/K
    np.testing.assert_allclose(server.state["weights"]["w/amp"], global_amp, rtol=1e-6)


def test_the_setup_upload_reads_the_training_images_without_augmentation(tmp_path, monkeypatch):
    """An "augmentation" that adds 100 to every pixel must not reach Ā_k: b = 0, A_g = (1/K) Σ_k mean_i Σx_i."""
    fed = toy_federation("method.name=harmofl")
    shift_training_batches(monkeypatch, fed.dataset)
    server = Server(fed, tmp_path)
    run_setup(server)
    sums = [fed.dataset.x[torch.as_tensor(c.train_idx)].double().sum(dim=(1, 2, 3)).mean() for c in fed.clients]
    np.testing.assert_allclose(server.state["weights"]["w/amp"].ravel(), np.mean(sums), rtol=1e-5, atol=1e-4)


def test_client_update_steps_with_the_configured_alpha_and_gradient_clip(tmp_path, monkeypatch):
    fed = toy_federation("method.name=harmofl", "method.params.alpha=0.2", "optim.grad_clip=0.5")
    server = Server(fed, tmp_path)
    run_setup(server)
    seen = []
    step = harmofl.perturbed_step

    def recording(params, loss_fn, opt, scaler, alpha, autocast, clip=None):
        seen.append((alpha, clip))
        return step(params, loss_fn, opt, scaler, alpha, autocast, clip)

    monkeypatch.setattr(harmofl, "perturbed_step", recording)
    msg = {**fed.method.client_config(server.state, 0, 1), "lr": 0.1, "round": 1}
    fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    assert seen and set(seen) == {(0.2, 0.5)}


def test_the_reported_loss_is_the_mean_over_the_batches_of_the_loss_at_w(tmp_path):
    """lr = 0: w stays w, so train_loss is the mean over the client's batches (drawn again from an equal stream) of
    the loss of the normalising network at w, not at w + δ."""
    fed = toy_federation("method.name=harmofl")
    server = Server(fed, tmp_path)
    run_setup(server)
    model = fed.model
    msg = {**fed.method.client_config(server.state, 0, 1), "lr": 0.0, "round": 1}
    reply, _ = fed.method.client_update(model, msg, {}, client_context(fed, 0, 1))
    with torch.no_grad():
        losses = [float(fed.task.loss(model(x), y)) for _, x, y in local_batches(model, client_context(fed, 0, 1))]
    assert len(losses) > 1 and reply["train_loss"] == pytest.approx(np.mean(losses), rel=1e-5)


def test_the_defaults_are_the_authors_code():
    """docs/methods/harmofl.md: α = 0.05 (--alpha), b = 0 (the code's L = 0), λ = 1 (the window replaced)."""
    p = harmofl.HarmoFLParams()
    assert (p.alpha, p.radius, p.strength) == (0.05, 0, 1.0)


def test_evaluation_and_training_see_the_normalised_images(tmp_path):
    fed = toy_federation("method.name=harmofl")
    server = Server(fed, tmp_path)
    run_setup(server)
    model = fed.model
    load_weights(model, fed.method.eval_weights(server.state))
    x = fed.dataset.x[:5]
    a_g = float(server.state["weights"]["w/amp"].ravel()[0])
    x_hat = model.normalise(x)
    np.testing.assert_allclose(x_hat.sum(dim=(1, 2, 3)).abs().numpy(), a_g, rtol=1e-4)  # every image's |Σx| = A_g
    model.eval()
    torch.testing.assert_close(fed.method.predict(model, x), model.net(x_hat))
    torch.testing.assert_close(model.features(x), model.net.features(x_hat))
    assert model.classifier is model.net.classifier
    assert not any(k.startswith("w/classifier") for k in server.state["weights"])  # the head is not stored twice


def test_client_update_trains_the_network_on_images_normalised_to_the_global_amplitude(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every input the wrapped network sees in training has A_g in its 3×3 low-frequency window (b = 1, |F| by hand,
    the zero frequency signed) and the raw batch's spectrum outside it: the normalised image, not the raw one."""
    fed = toy_federation("method.name=harmofl", "method.params.radius=1")
    server = Server(fed, tmp_path)
    run_setup(server)
    a_g = torch.as_tensor(server.state["weights"]["w/amp"]).double()  # [1, 3, 3]
    raw: list[torch.Tensor] = []

    def recording(model: torch.nn.Module, ctx: ClientContext) -> Iterator[tuple[int, Inputs, torch.Tensor]]:
        for epoch, x, y in local_batches(model, ctx):  # the batches client_update draws, as drawn
            raw.append(images(x).clone())
            yield epoch, x, y

    monkeypatch.setattr(harmofl, "local_batches", recording)
    seen: list[torch.Tensor] = []
    assert isinstance(fed.model, AmpNormNet)
    fed.model.net.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    msg = {**fed.method.client_config(server.state, 0, 1), "lr": 0.1, "round": 1}
    fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    assert raw and len(seen) == 2 * len(raw)  # α > 0: the loss at w, then at w + δ, on the same batch
    outside = torch.ones(6, 6, dtype=torch.bool)
    outside[[[5], [0], [1]], [5, 0, 1]] = False  # fft2 layout: frequencies −1, 0, 1 on both axes
    for j, x_hat in enumerate(seen):
        x = raw[j // 2]
        spec = torch.fft.fft2(x_hat.double())
        amp = spec.abs()
        amp[..., 0, 0] = spec[..., 0, 0].real
        window = torch.fft.fftshift(amp, dim=(-2, -1))[..., 2:5, 2:5]
        torch.testing.assert_close(window, a_g.expand_as(window), atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(spec[..., outside], torch.fft.fft2(x.double())[..., outside], atol=1e-4, rtol=1e-5)
        assert (x_hat - x).abs().max() > 0.1


def _run(tmp_path, *over):
    fed = toy_federation("federation.rounds=1", *over)
    return (fed, *run_recording_replies(fed, tmp_path))


def test_one_round_is_reproducible_and_sends_only_the_weights(tmp_path):
    fed, a, replies = _run(tmp_path / "a", "method.name=harmofl")
    _, b, _ = _run(tmp_path / "b", "method.name=harmofl")
    for k, v in a.state["weights"].items():
        np.testing.assert_array_equal(v, b.state["weights"][k], err_msg=k)
    weights = {f"w/{k}" for k in fed.model.state_dict()}
    assert "w/amp" in weights and len(replies) == 4
    for r in replies:
        assert set(r) == weights | {"num_examples", "train_loss"}
        np.testing.assert_array_equal(r["w/amp"], a.state["weights"]["w/amp"])  # A_g comes back as sent
    assert a.metrics[0]["time_amp_setup_s"] > 0 and math.isfinite(a.metrics[0]["train_loss"])


def test_without_perturbation_and_normalisation_a_round_is_fedavgs(tmp_path):
    fed, h, _ = _run(tmp_path / "h", "method.name=harmofl", "method.params.alpha=0", "method.params.strength=0")
    assert fed.method.setup_request({}) is None  # nothing to upload
    _, avg, _ = _run(tmp_path / "avg", "method.name=fedavg")
    for k, v in avg.state["weights"].items():
        np.testing.assert_allclose(h.state["weights"]["w/net." + k.removeprefix("w/")], v, rtol=1e-5, atol=1e-6)
    _, sam, _ = _run(tmp_path / "sam", "method.name=harmofl", "method.params.strength=0")  # α = 0.05 moves it
    assert not np.allclose(sam.state["weights"]["w/net.fc.weight"], avg.state["weights"]["w/fc.weight"], atol=1e-6)


def test_a_client_without_the_global_amplitude_is_refused():
    fed = toy_federation("method.name=harmofl")
    msg = {**fed.method.client_config(fed.method.server_init(fed.model, None), 0, 1), "lr": 0.1, "round": 1}
    # all-zero inputs give a zero amplitude too: the message named only a protocol failure
    with pytest.raises(ValueError, match="the setup exchange did not run, or every client's inputs are all zero"):
        fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))


def test_a_segmentation_round_on_the_pixel_task(tmp_path):
    """The same method on dense masks (tests/toy_pixels.py): it needs images only."""
    from toy_pixels import NAME, pixel_federation, registered

    from feddg.config import build_config

    cfg = {"data": {"dataset": NAME}, "model": {"name": "pixelnet"}, "split": {"target": "c"},
           "partition": {"kind": "by_domain", "num_clients": 4}, "optim": {"lr": 0.5}, "device": "cpu",
           "federation": {"rounds": 1, "batch_size": 16, "workers": 1}, "method": {"name": "harmofl"}}
    with registered():
        server = Server(pixel_federation(build_config(cfg)), tmp_path)
        run_inprocess(server)
    assert math.isfinite(server.metrics[0]["ood_pagree"]) and server.state["weights"]["w/amp"].shape == (1, 1, 1)
