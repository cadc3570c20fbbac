"""DAC's PCNorm / CCNorm / SCNorm (Lee, Bae & Kim, CVPR 2023) against hand-computed and closed-form values, the
DAC-SC ResNet's placement, and one FedAvg and one FedFA round with it (docs/methods/dac_sc.md)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy import ToyDomains, run_recording_replies

from feddg.algorithms import create_method
from feddg.config import build_config
from feddg.federation.setup import Federation, make_clients, make_split, make_topology
from feddg.models import create_model
from feddg.models.dac import CCNorm, PCNorm, SCNorm, amplitude, compose
from feddg.models.stages import conv_stages


def _x(seed: int = 0, shape: tuple[int, ...] = (4, 3, 6, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) + torch.tensor([0.3, -1.0, 0.8]).view(1, 3, 1, 1)


def _set_lambda(layer: CCNorm | SCNorm, lam: float) -> None:
    """h with softmax(h/τ)₀ = lam (0 and 1 exactly at CCNorm's τ = 1e-6)."""
    logit = {0.0: (-1.0, 1.0), 1.0: (1.0, -1.0)}.get(lam)
    h = logit if logit is not None else (layer.temperature * math.log(lam), layer.temperature * math.log(1 - lam))
    with torch.no_grad():
        layer.h.copy_(torch.tensor(h))
    assert layer.lam.item() == pytest.approx(lam, abs=1e-6)


def _pc_closed_form(x, mean, var, eps=1e-5, dc_sign_of=None):
    """(x − m)/σ + sign(m')·|m − μ|/σ: BN scales every non-DC bin by 1/σ > 0, so only the DC term (its sign
    taken from m', the per-sample channel mean of the phase source) differs from BatchNorm."""
    m = x.mean(dim=(2, 3), keepdim=True)
    sd = (var + eps).sqrt().view(1, -1, 1, 1)
    mu = mean.view(1, -1, 1, 1)
    sign = torch.sign(m if dc_sign_of is None else dc_sign_of)
    return (x - m) / sd + sign * (m - mu).abs() / sd


def _batch_stats(x):
    return x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False)


# --- PCNorm -------------------------------------------------------------------------------------


def test_pcnorm_keeps_the_phase_of_its_input_and_takes_batchnorms_amplitude():
    x = _x()
    y = PCNorm(3)(x)
    fx, fy, fb = torch.fft.fft2(x), torch.fft.fft2(y), torch.fft.fft2(F.batch_norm(x, None, None, training=True))
    present = fx.abs() > 1e-3
    assert present.float().mean() > 0.99
    turn = torch.angle(fy * fx.conj())[present]  # phase difference, wrapped to (−π, π]
    assert turn.abs().max() < 1e-4
    assert torch.allclose(fy.abs(), fb.abs(), atol=1e-4)


def test_pcnorm_by_hand_on_constant_images():
    """One channel, two constant 2×2 images. BN (μ = 2, σ = 1) maps 1, 3 to −1, +1; PCNorm keeps each input's
    DC phase (both positive: 0), so both become +1 (amplitude 4 = |2×2·(±1)| at DC, nothing elsewhere)."""
    layer = PCNorm(1, eps=1e-12)  # σ = 1 exactly in float32
    x = torch.tensor([1.0, 3.0]).view(2, 1, 1, 1).expand(2, 1, 2, 2).contiguous()
    assert torch.equal(F.batch_norm(x, None, None, training=True, eps=1e-12).flatten(), torch.tensor([-1.0] * 4 + [1.0] * 4))
    assert torch.allclose(layer(x), torch.ones(2, 1, 2, 2), atol=1e-6)
    assert torch.allclose(layer(-x), -torch.ones(2, 1, 2, 2), atol=1e-6)  # phase π for both: −1, −1 (BN: +1, −1)
    assert layer.running_mean.item() == pytest.approx(0.9 * (0.1 * 2) + 0.1 * -2)  # BatchNorm's update, twice


def test_pcnorm_matches_its_closed_form_in_training_and_in_eval():
    x = _x()
    layer = PCNorm(3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    gamma, beta = layer.weight.view(1, 3, 1, 1), layer.bias.view(1, 3, 1, 1)
    y = layer(x)
    assert torch.allclose(y, gamma * _pc_closed_form(x, *_batch_stats(x)) + beta, atol=1e-5)
    assert torch.allclose(layer.running_mean, 0.1 * _batch_stats(x)[0])  # BatchNorm2d's buffers, updated as it does
    layer.eval()
    with torch.no_grad():
        layer.running_mean.copy_(torch.tensor([0.5, -2.0, 0.0]))
        layer.running_var.copy_(torch.tensor([2.0, 0.5, 1.0]))
    expected = gamma * _pc_closed_form(x, layer.running_mean, layer.running_var) + beta
    assert torch.allclose(layer(x), expected, atol=1e-5)


def test_a_constant_shift_of_a_channel_changes_only_the_dc_bin():
    """x + c moves only F(x)'s DC term; BN removes it again, so the output keeps every amplitude and every phase
    but the DC one, which follows the sign of the shifted input's mean."""
    x = _x(1)
    c = torch.tensor([0.0, 3.0, -5.0]).view(1, 3, 1, 1)  # flips the sign of channels 1 and 2's means
    y, y_shift = PCNorm(3)(x), PCNorm(3)(x + c)
    fy, fs = torch.fft.fft2(y), torch.fft.fft2(y_shift)
    assert torch.allclose(fy.abs(), fs.abs(), atol=1e-4)
    not_dc = torch.ones(6, 5, dtype=torch.bool)
    not_dc[0, 0] = False
    assert torch.allclose(fy[..., not_dc], fs[..., not_dc], atol=1e-4)
    m, mu = x.mean(dim=(2, 3)), x.mean(dim=(0, 2, 3))
    sd = (x.var(dim=(0, 2, 3), unbiased=False) + 1e-5).sqrt()
    dc = 30 * torch.sign(m + c.view(1, 3)) * (m - mu).abs() / sd  # H·W = 30
    assert torch.allclose(fs[..., 0, 0].real, dc, atol=1e-4)
    assert (torch.sign(fs[..., 0, 0].real) != torch.sign(fy[..., 0, 0].real)).any()


def test_pcnorm_without_affine_is_the_closed_form_in_its_inputs_dtype():
    x = _x(9)
    layer = PCNorm(3, affine=False)
    assert torch.allclose(layer(x), _pc_closed_form(x, *_batch_stats(x)), atol=1e-5)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("momentum", [None, 0.5])
def test_the_running_mean_follows_batchnorms_momentum_or_cumulative_average(momentum):
    a, b = _x(12), _x(13)
    layer = PCNorm(3, momentum=momentum)
    layer(a)
    layer(b)
    ma, mb = a.mean(dim=(0, 2, 3)), b.mean(dim=(0, 2, 3))
    expected = (ma + mb) / 2 if momentum is None else 0.5 * (0.5 * ma) + 0.5 * mb
    assert torch.allclose(layer.running_mean, expected, atol=1e-6)


def test_compose_of_a_maps_own_amplitude_and_phase_is_the_map_even_when_it_is_small():
    z = _x(8) * 1e-3  # every frequency's |F| is ~5e-3: far above PHASE_EPS, so its phasor is exact
    torch.testing.assert_close(compose(amplitude(z), z), z, rtol=1e-4, atol=1e-7)


def test_pcnorm_refuses_what_batchnorm2d_refuses():
    with pytest.raises(ValueError, match="expected 4D input"):
        PCNorm(3)(torch.randn(2, 3, 5))


# --- CCNorm / SCNorm ------------------------------------------------------------------------------


def test_ccnorm_is_pcnorm_at_lambda_0_batchnorm_at_lambda_1_and_shifts_the_dc_sign_in_between():
    x = _x(2)
    pc = PCNorm(3)(x)
    bn = torch.nn.BatchNorm2d(3)(x)
    cc = CCNorm(3)
    assert cc.lam.item() == 0.5  # h = 0 at initialisation
    _set_lambda(cc, 0.0)
    assert torch.allclose(cc(x), pc, atol=1e-5)
    _set_lambda(cc, 1.0)
    assert torch.allclose(cc(x), bn, atol=1e-5)
    _set_lambda(cc, 0.5)
    mean, var = _batch_stats(x)
    half = _pc_closed_form(x, mean, var, dc_sign_of=x.mean(dim=(2, 3), keepdim=True) - 0.5 * mean.view(1, 3, 1, 1))
    assert torch.allclose(cc(x), half, atol=1e-5)
    assert cc.num_batches_tracked.item() == 3 and isinstance(cc, torch.nn.BatchNorm2d)


def test_ccnorm_in_eval_takes_the_dc_sign_from_the_running_mean():
    x = _x(10)  # channel means ≈ 0.3, −1, 0.8
    cc = CCNorm(3).eval()
    _set_lambda(cc, 0.5)
    mean, var = torch.tensor([2.0, -4.0, 0.0]), torch.tensor([2.0, 0.5, 1.0])
    with torch.no_grad():
        cc.running_mean.copy_(mean)
        cc.running_var.copy_(var)
    # m − μ/2 is < 0 for channel 0 and > 0 for channel 1 (the batch mean would give the other signs)
    sign_of = x.mean(dim=(2, 3), keepdim=True) - 0.5 * mean.view(1, 3, 1, 1)
    assert torch.allclose(cc(x), _pc_closed_form(x, mean, var, dc_sign_of=sign_of), atol=1e-5)


@pytest.mark.parametrize("layer", [PCNorm, CCNorm])
def test_without_running_statistics_eval_normalises_with_the_batchs(layer):
    x = _x(11)
    norm = layer(3, track_running_stats=False).eval()
    mean, var = _batch_stats(x)
    lam = 0.5 if layer is CCNorm else 0.0
    sign_of = x.mean(dim=(2, 3), keepdim=True) - lam * mean.view(1, 3, 1, 1)
    assert torch.allclose(norm(x), _pc_closed_form(x, mean, var, dc_sign_of=sign_of), atol=1e-5)


def test_scnorm_is_the_pcnorm_composition_with_instance_statistics_at_1_and_the_input_at_0():
    x = _x(3)
    sc = SCNorm(3)
    inorm = F.instance_norm(x, eps=1e-5)
    _set_lambda(sc, 1.0 - 1e-9)  # softmax never reaches 1 at τ = 0.1; λ = 1 − 1e-9
    pc_in = torch.fft.irfft2(torch.fft.rfft2(inorm).abs() * torch.sgn(torch.fft.rfft2(x)), s=(6, 5))
    assert torch.allclose(sc(x), pc_in, atol=1e-5)
    _set_lambda(sc, 1e-9)
    assert torch.allclose(sc(x), x, atol=1e-5)
    # in between, closed form: IN keeps every non-DC phase and zeroes the DC, so the mix is λ IN(x) + (1 − λ) x
    _set_lambda(sc, 0.3)
    with torch.no_grad():
        sc.weight.copy_(torch.tensor([2.0, 1.0, -1.0]))
        sc.bias.copy_(torch.tensor([0.0, 0.5, 1.0]))
    expected = (0.3 * inorm + 0.7 * x) * sc.weight.view(1, 3, 1, 1) + sc.bias.view(1, 3, 1, 1)
    assert torch.allclose(sc(x), expected, atol=1e-5)


def test_scnorm_instance_statistics_use_its_eps():
    x = _x(14) * 0.1  # per-map variance ≈ 0.01: eps = 0.5 dominates it
    sc = SCNorm(3, eps=0.5)
    _set_lambda(sc, 0.3)
    assert torch.allclose(sc(x), 0.3 * F.instance_norm(x, eps=0.5) + 0.7 * x, atol=1e-5)


def test_scnorm_lambda_and_affine_get_their_closed_form_gradients():
    """L = Σ w·SCNorm(x) = Σ w (γ(λ IN(x) + (1−λ) x) + β): ∂L/∂h₀ = −∂L/∂h₁ = λ(1−λ)/τ · Σ w γ (IN(x) − x)."""
    x, w = _x(4), _x(5)
    sc = SCNorm(3)  # λ = 0.5, τ = 0.1, γ = 1
    (sc(x) * w).sum().backward()
    inorm = F.instance_norm(x, eps=1e-5)
    dlam = (w * (inorm - x)).sum()
    assert sc.h.grad is not None and sc.weight.grad is not None and sc.bias.grad is not None
    assert torch.allclose(sc.h.grad, 2.5 * dlam * torch.tensor([1.0, -1.0]), rtol=1e-4)
    assert torch.allclose(sc.weight.grad, (w * (0.5 * inorm + 0.5 * x)).sum(dim=(0, 2, 3)), rtol=1e-4)
    assert torch.allclose(sc.bias.grad, w.sum(dim=(0, 2, 3)), rtol=1e-5)


def test_ccnorm_affine_and_input_get_gradients_and_lambda_c_gets_none():
    """Only the DC bin's sign depends on λ_c: ∂out/∂λ_c = 0, so h gets no gradient (not FFT rounding × 1/τ)."""
    x = torch.cat([_x(6), torch.full((1, 3, 6, 5), 2.0)]).requires_grad_()  # a constant image: zero non-DC bins
    w = _x(7, (5, 3, 6, 5))
    cc = CCNorm(3)
    out = cc(x)
    (out * w).sum().backward()
    assert cc.h.grad is None
    assert cc.weight.grad is not None and cc.bias.grad is not None
    assert torch.allclose(cc.weight.grad, (w * out).sum(dim=(0, 2, 3)), rtol=1e-4)  # γ = 1, β = 0: out = normalised
    assert x.grad is not None and bool(x.grad.isfinite().all()) and float(x.grad.abs().sum()) > 0


def test_bf16_autocast_keeps_the_ffts_in_float32_and_the_layers_dtype():
    model = create_model("resnet18", num_classes=3, image_size=8, normalization="dac_sc")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 3, 8, 8))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and bool(out.isfinite().all())
    assert all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
    x = _x().to(torch.bfloat16)
    assert PCNorm(3)(x).dtype == SCNorm(3)(x).dtype == CCNorm(3)(x).dtype == torch.bfloat16


def test_bad_temperature_and_normalization_fail_with_one_line():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SCNorm(3, temperature=0.0)
    with pytest.raises(ValueError, match="normalization must be one of batchnorm, dac_sc, got 'dac_p'"):
        create_model("resnet18", num_classes=3, normalization="dac_p")


# --- the DAC-SC ResNet -----------------------------------------------------------------------------


def _dac_modules(model: torch.nn.Module) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (CCNorm, SCNorm))}


def test_dac_sc_resnets_put_ccnorm_on_every_shortcut_and_scnorm_after_stages_1_to_3():
    r18 = create_model("resnet18", num_classes=7, in_channels=1, image_size=28, normalization="dac_sc").eval()
    assert _dac_modules(r18) == {"layer1.2": "SCNorm", "layer2.0.downsample.1": "CCNorm", "layer2.2": "SCNorm",
                                 "layer3.0.downsample.1": "CCNorm", "layer3.2": "SCNorm",
                                 "layer4.0.downsample.1": "CCNorm"}
    assert [r18.get_submodule(f"layer{k}.2").num_features for k in (1, 2, 3)] == [64, 128, 256]
    with torch.no_grad():
        assert r18(torch.randn(2, 1, 28, 28)).shape == (2, 7)
    plain = create_model("resnet18", num_classes=7, in_channels=1, image_size=28)
    assert _dac_modules(plain) == {} and conv_stages(r18) == conv_stages(plain)
    extra = {f"layer{k}.2.{p}" for k in (1, 2, 3) for p in ("weight", "bias", "h")}
    extra |= {f"layer{k}.0.downsample.1.h" for k in (2, 3, 4)}
    assert set(r18.state_dict()) == set(plain.state_dict()) | extra
    with torch.device("meta"):  # ResNet-50: layer1 has a shortcut too (64 → 256)
        r50 = create_model("resnet50", num_classes=7, image_size=224, normalization="dac_sc")
    assert _dac_modules(r50) == {"layer1.0.downsample.1": "CCNorm", "layer1.3": "SCNorm",
                                 "layer2.0.downsample.1": "CCNorm", "layer2.4": "SCNorm",
                                 "layer3.0.downsample.1": "CCNorm", "layer3.6": "SCNorm",
                                 "layer4.0.downsample.1": "CCNorm"}
    assert [r50.get_submodule(n).num_features for n in ("layer1.3", "layer2.4", "layer3.6")] == [256, 512, 1024]


def test_a_plain_resnet_checkpoint_loads_into_dac_sc_whose_own_parameters_keep_their_init(tmp_path):
    torch.manual_seed(0)
    plain = create_model("resnet18", num_classes=3, image_size=32)
    torch.save(plain.state_dict(), tmp_path / "r18.pth")
    dac = create_model("resnet18", num_classes=3, image_size=32, normalization="dac_sc", weights=tmp_path / "r18.pth")
    assert dac.added_keys == set(dac.state_dict()) - set(plain.state_dict()) and plain.added_keys == frozenset()
    state = dac.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    assert torch.equal(state["layer1.2.h"], torch.zeros(2)) and torch.equal(state["layer2.2.weight"], torch.ones(128))


def _dac_federation(method: str, **params: object) -> Federation:
    """The toy federation (tests/toy.py: 3 domains of 1×6×6 images, 4 classes) with the DAC-SC ResNet-18."""
    cfg = build_config({
        "partition": {"kind": "by_domain", "num_clients": 2}, "split": {"target": "c"},
        "model": {"name": "resnet18", "params": {"normalization": "dac_sc"}},
        "method": {"name": method, "params": params},
        "federation": {"rounds": 1, "batch_size": 16, "workers": 1}, "optim": {"lr": 0.1}, "device": "cpu"}, [])
    ds = ToyDomains(per_class_domain=8)
    split = make_split(ds, cfg)
    clients = make_clients(ds, split, cfg)
    torch.manual_seed(cfg.seed)
    fed_method = create_method(cfg.method.name, cfg.method.params)
    model = fed_method.prepare_model(create_model("resnet18", num_classes=4, in_channels=1, image_size=6,
                                                  normalization="dac_sc"))
    return Federation(cfg, ds, split, clients, fed_method, model, torch.device("cpu"),
                      make_topology(cfg, clients, model))


def test_one_fedavg_round_trains_and_averages_the_scnorm_mixing_weights(tmp_path):
    torch.set_num_threads(1)
    server, replies = run_recording_replies(_dac_federation("fedavg"), tmp_path / "run")
    weights = server.state["weights"]
    assert len(replies) == 2 and np.isfinite(server.metrics[0]["train_loss"])
    n = np.array([r["num_examples"] for r in replies], dtype=np.float64)
    for key in ("layer1.2.h", "layer3.2.h", "layer2.2.weight"):
        sent = [r[f"w/{key}"] for r in replies]
        assert np.abs(sent[0]).max() > 0  # trained away from h = 0 / γ = 1 ...
        assert np.allclose(weights[f"w/{key}"], (n[0] * sent[0] + n[1] * sent[1]) / n.sum(), atol=1e-6)  # ... and averaged
    assert all(np.array_equal(weights[f"w/layer{k}.0.downsample.1.h"], [0.0, 0.0]) for k in (2, 3, 4))  # no gradient


def test_fedfa_with_dac_sc_puts_each_ffa_layer_after_the_stages_scnorm(tmp_path):
    torch.set_num_threads(1)
    fed = _dac_federation("fedfa", variant="full", lambda_h=0.0)
    assert fed.model.fedfa.stage_names == ["maxpool", "layer1", "layer2", "layer3", "layer4"]
    assert [type(fed.model.get_submodule(f"layer{k}")[-1]).__name__ for k in (1, 2, 3)] == ["SCNorm"] * 3
    server, replies = run_recording_replies(fed, tmp_path / "run")
    assert sorted({k.split("/")[1] for r in replies for k in r if k.startswith("stat/")}) == ["1", "2", "3", "4", "5"]
    assert all(np.isfinite(v).all() for v in server.state["weights"].values())
    assert np.abs(replies[0]["w/layer2.2.h"]).max() > 0
