"""Style machinery: AdaIN (eq. 6), style statistics (eq. 2), FINCH through finch-clust, the three codecs."""

import math
from pathlib import Path

import finch
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy import ToyDomains

from feddg.algorithms.base import ClientContext, OptimSettings
from feddg.algorithms.components import style
from feddg.algorithms.components.style import (
    AdainVGGStyle,
    FeatureStyle,
    PixelStyle,
    StyleParams,
    adain,
    adain_vgg_decoder,
    adain_vgg_encoder,
    blend,
    channel_moments,
    channel_stats,
    encoder_state,
    finch_labels,
    local_moments,
    make_codec,
    pooled_style,
    resolve_layer,
    setup_codec,
    style_setup_request,
    style_vectors,
)
from feddg.federation.setup import task_of
from feddg.messages import Message
from feddg.models import create_model


def test_channel_stats_hand_value():
    feat = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 2.0]]]])  # [1, 2, 2, 2]
    mean, std = channel_stats(feat)
    assert torch.allclose(mean, torch.tensor([[2.5, 0.5]]))
    # population variances: 1.25 and 0.75
    assert torch.allclose(std, torch.tensor([[math.sqrt(1.25 + 1e-5), math.sqrt(0.75 + 1e-5)]]))


@pytest.mark.parametrize("per_sample", [False, True])
def test_adain_output_has_the_target_statistics_per_channel(per_sample):
    g = torch.Generator().manual_seed(0)
    feat = 3.0 * torch.randn(4, 5, 6, 7, generator=g) + 2.0
    shape = (4, 5) if per_sample else (5,)
    target_mean = torch.randn(shape, generator=g)
    target_std = torch.rand(shape, generator=g) + 0.5
    out = adain(feat, target_mean, target_std)
    mean, std = channel_stats(out, eps=0.0)
    assert torch.allclose(mean, target_mean.expand(4, 5), atol=1e-5)
    assert torch.allclose(std, target_std.expand(4, 5), atol=1e-4)
    # the content is kept: the normalised maps are identical
    mu, sigma = channel_stats(feat)
    assert torch.allclose((out - mean[..., None, None]) / std[..., None, None],
                          (feat - mu[..., None, None]) / sigma[..., None, None], atol=1e-3)


def test_blend_interpolates_between_content_and_adain():
    feat = torch.randn(2, 3, 4, 4)
    m, s = torch.zeros(3), torch.ones(3)
    assert torch.equal(blend(feat, m, s, 0.0), feat)
    assert torch.allclose(blend(feat, m, s, 1.0), adain(feat, m, s))
    assert torch.allclose(blend(feat, m, s, 0.5), 0.5 * feat + 0.5 * adain(feat, m, s))


def test_pooled_style_is_eq2_over_all_samples_and_pixels():
    feats = torch.randn(6, 3, 5, 5) * torch.arange(1.0, 7.0).view(6, 1, 1, 1)
    mean, second = channel_moments(feats)
    mu, sigma = pooled_style(mean, second)
    flat = feats.permute(1, 0, 2, 3).reshape(3, -1)  # every sample and pixel of a channel
    assert torch.allclose(mu, flat.mean(1), atol=1e-5)
    assert torch.allclose(sigma, (flat.var(1, unbiased=False) + 1e-5).sqrt(), atol=1e-4)
    # it is not the mean of per-sample stds (samples differ in scale)
    assert not torch.allclose(sigma, channel_stats(feats)[1].mean(0), atol=1e-2)


def test_style_vectors_are_mean_then_std() -> None:
    vec = style_vectors(np.array([[1.0, 2.0]]), np.array([[3.0, 4.0]]))  # rows [μ ‖ σ]
    assert vec.dtype == np.float32 and np.array_equal(vec, [[1.0, 2.0, 3.0, 4.0]])


def _three_directions(rng, sizes=(4, 3, 5)):
    axes = np.eye(3, dtype=np.float32) * 10
    return np.concatenate([axes[i] + 0.1 * rng.random((n, 3), dtype=np.float32) for i, n in enumerate(sizes)])


def test_finch_labels_calls_finch_clust(monkeypatch):
    assert style.FINCH is finch.FINCH  # the library's function, not a re-implementation
    calls = []

    def spy(data, **kw):
        calls.append(kw)
        return finch.FINCH(data, **kw)

    monkeypatch.setattr(style, "FINCH", spy)
    data = _three_directions(np.random.default_rng(0))
    ref, _, _ = finch.FINCH(data, distance="cosine", ensure_early_exit=False)
    coarsest, finest = finch_labels(data, "coarsest"), finch_labels(data, "finest")
    assert len(calls) == 2 and all(c["distance"] == "cosine" for c in calls)
    assert np.array_equal(coarsest, ref[:, -1]) and np.array_equal(finest, ref[:, 0])
    # cosine clusters never split a direction, and the coarsest partition has fewer clusters than the finest
    assert all(len(np.unique(coarsest[s])) == 1 for s in (slice(0, 4), slice(4, 7), slice(7, 12)))
    assert 1 < len(np.unique(coarsest)) < len(np.unique(finest))
    assert np.array_equal(finch_labels(data[:1], "coarsest"), [0])


def test_pixel_codec_transfers_image_channel_statistics():
    x = torch.randn(3, 3, 8, 8)
    m, s = torch.tensor([0.1, -0.2, 0.3]), torch.tensor([0.5, 1.0, 2.0])
    out = PixelStyle().transfer(x, m, s, alpha=1.0)
    mean, std = channel_stats(out, eps=0.0)
    assert torch.allclose(mean, m.expand(3, 3), atol=1e-5) and torch.allclose(std, s.expand(3, 3), atol=1e-4)


def test_feature_codec_is_the_frozen_first_stage_and_feeds_the_rest_of_the_network():
    torch.manual_seed(0)
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=16).eval()
    x = torch.randn(4, 3, 16, 16)
    codec, state = setup_codec(StyleParams(style_path="feature"), model, x)
    assert codec.layer == "blocks.0"
    assert set(state) == {f"enc/{k}" for k in model.state_dict() if k.startswith("blocks.0.")}
    with torch.no_grad():
        stage = model.blocks[0](x)
        assert torch.allclose(codec.encode(x), stage)
        # identity transfer (x̃ = E(x)) through the rest of the network = the plain forward pass
        assert torch.allclose(codec.features(model, x, stage), model.features(x), atol=1e-5)
        # the model trains on: a codec rebuilt from the saved state still encodes with the initial weights
        for p in model.parameters():
            p.add_(0.5)
    rebuilt = make_codec(StyleParams(style_path="feature"), model, state)
    assert torch.allclose(rebuilt.encode(x), stage, atol=1e-6)
    assert not torch.allclose(FeatureStyle(model, "blocks.0").encode(x), stage, atol=1e-3)


def test_feature_codec_sends_no_gradient_into_the_stage_it_replaces():
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=16).train()
    x = torch.randn(4, 3, 16, 16)
    codec = make_codec(StyleParams(style_path="feature"), model)
    x_tilde = codec.transfer(x, torch.zeros(32), torch.ones(32), alpha=0.5)
    codec.features(model, x, x_tilde).sum().backward()
    assert model.blocks[0][0].weight.grad is None or not model.blocks[0][0].weight.grad.any()
    assert model.blocks[1][0].weight.grad.abs().sum() > 0


def test_local_moments_encode_with_the_initial_weights_of_the_setup_request() -> None:
    ds = ToyDomains(per_class_domain=2)  # 24 images 1×6×6
    ctx = ClientContext(0, 0, ds, np.arange(10), 4, 1, OptimSettings(), torch.Generator().manual_seed(0), task_of(ds))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1))  # the shared model, trained by other clients
    w0, b0 = torch.randn(2, 1, 3, 3), torch.randn(2)  # the initial global weights
    msg: Message = {"w/0.weight": w0.numpy(), "w/0.bias": b0.numpy()}
    _, enc, mean, second = local_moments(StyleParams(style_path="feature", style_layer="0"), model, msg, ctx, "pardon")
    feat = F.conv2d(ds.x[:10], w0, b0, padding=1)  # E(x) of every local sample, in order
    assert torch.allclose(mean, feat.mean(dim=(2, 3)), atol=1e-5)
    assert torch.allclose(second, feat.pow(2).mean(dim=(2, 3)), atol=1e-5)
    assert np.array_equal(enc["enc/0.weight"], w0.numpy()) and np.array_equal(enc["enc/0.bias"], b0.numpy())


def test_encoder_state_follows_an_explicit_layer():
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=16)
    state = encoder_state(model, "blocks.1", torch.randn(2, 3, 16, 16))
    assert {k.split(".")[2] for k in state} == {"0", "1"}  # blocks.0.* and blocks.1.*
    assert model.training  # restored after tracing in eval mode


def test_encoder_state_leaves_batchnorm_running_statistics_alone() -> None:
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=16).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = encoder_state(model, "blocks.0", 3.0 * torch.randn(4, 3, 16, 16) + 1.0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # traced in eval mode
    assert np.array_equal(state["enc/blocks.0.1.running_mean"], before["blocks.0.1.running_mean"].numpy())


def test_resolve_layer_accepts_the_last_conv_stage_and_refuses_the_next() -> None:
    model = create_model("cnn", num_classes=10, in_channels=3, image_size=16)  # conv stages blocks.0 .. blocks.3
    assert resolve_layer(model, StyleParams(style_path="feature", style_stage=4)) == "blocks.3"
    with pytest.raises(ValueError, match="style_stage=5 but SmallCNN has 4 conv stages"):
        resolve_layer(model, StyleParams(style_path="feature", style_stage=5))


def test_setup_request_carries_weights_only_on_the_feature_path() -> None:
    weights: Message = {"w/a": np.zeros(2)}
    assert style_setup_request(StyleParams(style_path="feature"), weights) == weights
    for path in ("pixel", "adain-vgg"):
        assert style_setup_request(StyleParams(style_path=path), weights) == {"style/path": path}


def test_adain_vgg_missing_weights_name_the_option_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"vgg_weights.*vgg_normalised\.pth.*decoder_weights.*decoder\.pth"):
        make_codec(StyleParams(style_path="adain-vgg"), torch.nn.Identity())
    with pytest.raises(FileNotFoundError, match="style_path=feature or pixel"):
        make_codec(StyleParams(style_path="adain-vgg", vgg_weights=str(tmp_path / "vgg_normalised.pth"),
                               decoder_weights=str(tmp_path / "decoder.pth")), torch.nn.Identity())


def test_adain_vgg_loads_the_published_layout_and_round_trips_shapes(tmp_path):
    enc, dec = adain_vgg_encoder(), adain_vgg_decoder()
    assert len(enc) == 53 and isinstance(enc[30], torch.nn.ReLU)  # relu4_1 is module 30
    assert [k for k in enc.state_dict()][:4] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    torch.save(enc.state_dict(), tmp_path / "vgg_normalised.pth")
    torch.save(dec.state_dict(), tmp_path / "decoder.pth")
    codec = AdainVGGStyle(str(tmp_path / "vgg_normalised.pth"), str(tmp_path / "decoder.pth"), (0.5,) * 3, (0.5,) * 3)
    x = torch.randn(2, 3, 28, 28)
    assert codec.encode(x).shape == (2, 512, 4, 4)  # relu4_1 at 1/8 resolution, ceil-mode pools
    assert codec.transfer(x, torch.zeros(512), torch.ones(512), 0.5).shape == (2, 3, 28, 28)
    grey_codec = AdainVGGStyle(str(tmp_path / "vgg_normalised.pth"), str(tmp_path / "decoder.pth"), (0.5,), (0.5,))
    grey = torch.randn(2, 1, 28, 28)
    assert grey_codec.transfer(grey, torch.zeros(512), torch.ones(512), 0.5).shape == (2, 1, 28, 28)


def test_adain_vgg_encodes_at_relu4_1_of_the_denormalised_image_and_decodes_back_to_the_normalisation(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    enc, dec = adain_vgg_encoder(), adain_vgg_decoder()
    last = dec[-1]
    assert isinstance(last, torch.nn.Conv2d) and last.bias is not None
    with torch.no_grad():
        last.bias.copy_(torch.tensor([-0.5, 0.5, 1.5]))  # red below 0, blue above 1: the clamp acts
    torch.save(enc.state_dict(), tmp_path / "vgg_normalised.pth")
    torch.save(dec.state_dict(), tmp_path / "decoder.pth")
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    codec = AdainVGGStyle(str(tmp_path / "vgg_normalised.pth"), str(tmp_path / "decoder.pth"), mean, std)
    x = torch.randn(2, 3, 24, 24)
    with torch.no_grad():
        # E: modules 0..30 (relu4_1 included) of VGG on the [0, 1] image x·std + mean
        feat = codec.encode(x)
        assert torch.allclose(feat, enc[:31](x * s + m), atol=1e-5)
        assert (feat >= 0).all() and (feat == 0).any()  # after the ReLU
        # D: decoder output resized to the input, clamped to [0, 1], normalised again
        t = torch.randn(2, 512, 4, 4)  # decoded at 32 px, resized to 24
        raw = F.interpolate(dec(t), size=(24, 24), mode="bilinear", align_corners=False)
        assert raw.min() < 0 and raw.max() > 1
        assert torch.allclose(codec.decode(t, x), (raw.clamp(0, 1) - m) / s, atol=1e-5)
        # a grey image gets the mean of the decoded colours
        grey_codec = AdainVGGStyle(str(tmp_path / "vgg_normalised.pth"), str(tmp_path / "decoder.pth"), (0.5,), (0.5,))
        grey = grey_codec.decode(t, torch.zeros(2, 1, 24, 24))
        assert torch.allclose(grey, (raw.clamp(0, 1).mean(1, keepdim=True) - 0.5) / 0.5, atol=1e-5)
