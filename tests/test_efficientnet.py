"""EfficientNet-Lite0: offline ImageNet weights, TensorFlow "SAME" padding, stages for FedFA / PARDON."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_sample_image
from torch import nn

from feddg.algorithms.components.style import StyleParams, resolve_layer
from feddg.algorithms.registry import create_method
from feddg.models import create_model, efficientnet
from feddg.models.efficientnet import MBConv, SameConv2d, efficientnet_lite0, imagenet_normalise, pretrained_path
from feddg.models.stages import conv_stages

# ImageNet-1k indices (imagenet_class_index.json)
BUILDINGS = {442: "bell cote", 449: "boathouse", 483: "castle", 497: "church", 538: "dome", 663: "monastery",
             668: "mosque", 698: "palace", 832: "stupa", 858: "tile roof", 884: "vault"}
FLOWERS = {309: "bee", 738: "pot", 947: "mushroom", 985: "daisy", 989: "hip", 996: "hen-of-the-woods"}


def _photo(name: str) -> torch.Tensor:
    """scikit-learn's sample photo, centre-cropped to a square and resized to 224 px, values in [0, 1]."""
    img = torch.from_numpy(np.array(load_sample_image(name))).permute(2, 0, 1).float()[None] / 255.0
    h, w = img.shape[-2:]
    s = min(h, w)
    crop = img[..., (h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
    return F.interpolate(crop, size=(224, 224), mode="bilinear", antialias=True, align_corners=False)


def test_imagenet_weights_classify_the_sample_photos():
    model = create_model("efficientnet_lite0", num_classes=1000, image_size=224, pretrained=True).eval()
    x = imagenet_normalise(torch.cat([_photo("china.jpg"), _photo("flower.jpg")]))
    with torch.no_grad():
        top5 = model(x).topk(5).indices.tolist()
    china, flower = top5
    assert china[0] in BUILDINGS and len(set(china) & set(BUILDINGS)) >= 3, china  # palace, bell cote, ...
    assert flower[0] == 985 and len(set(flower) & set(FLOWERS)) >= 3, flower  # daisy


def test_another_head_size_keeps_the_imagenet_trunk_and_runs_at_224_px():
    torch.manual_seed(0)
    model = create_model("efficientnet_lite0", num_classes=7, image_size=224, pretrained=True).eval()
    checkpoint = torch.load(pretrained_path(), weights_only=True)
    state = model.state_dict()
    assert list(state) == list(checkpoint)  # the checkpoint's keys, in its order
    assert all(torch.equal(v, checkpoint[k]) for k, v in state.items() if not k.startswith("_fc."))
    assert state["_fc.weight"].shape == (7, 1280) and model.classifier is model._fc
    with torch.no_grad():
        feats = model.features(torch.randn(2, 3, 224, 224))
    assert feats.shape == (2, model.feature_dim) == (2, 1280)
    assert model.classifier(feats).shape == (2, 7)


def test_the_checkpoint_also_loads_as_plain_weights_and_rgb_is_required():
    torch.manual_seed(0)
    loaded = create_model("efficientnet_lite0", num_classes=1000, weights=pretrained_path()).state_dict()
    pretrained = create_model("efficientnet_lite0", num_classes=1000, pretrained=True).state_dict()
    assert all(torch.equal(v, pretrained[k]) for k, v in loaded.items())
    with pytest.raises(ValueError, match="in_channels=1") as err:
        create_model("efficientnet_lite0", num_classes=10, in_channels=1, pretrained=True)
    assert "\n" not in str(err.value)


def test_strided_convolutions_pad_like_tensorflow_same():
    x = torch.randn(1, 1, 4, 5)
    conv = SameConv2d(1, 1, 3, stride=2)
    # out = ceil(in / 2); TF puts the odd padding pixel at the bottom/right: H pads (0, 1), W pads (1, 1)
    expected = F.conv2d(F.pad(x, (1, 1, 0, 1)), conv.weight, stride=2)
    torch.testing.assert_close(conv(x), expected)
    assert conv(x).shape == (1, 1, 2, 3)
    same = SameConv2d(1, 1, 5)
    torch.testing.assert_close(same(x), F.conv2d(x, same.weight, padding=2))
    one = SameConv2d(1, 1, 1, stride=2)  # kernel < stride: TF pads nothing (never a negative pad, a crop)
    torch.testing.assert_close(one(x), x[..., ::2, ::2] * one.weight.view(()))


def test_an_even_kernel_at_stride_1_keeps_the_size_like_tensorflow_same():
    x = torch.randn(1, 1, 4, 5)
    conv = SameConv2d(1, 1, 2)  # TF SAME: one padding pixel, at the bottom/right
    torch.testing.assert_close(conv(x), F.conv2d(F.pad(x, (0, 1, 0, 1)), conv.weight))


def test_inverted_residual_adds_its_input_only_when_stride_and_width_allow():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 6, 6) * 10  # activations beyond ReLU6's cap
    skip = MBConv(8, 8, expand=6, kernel=3, stride=1).eval()
    with torch.no_grad():
        expanded = skip._bn0(skip._expand_conv(x))
        hidden = expanded.clamp(0, 6)
        body = skip._bn2(skip._project_conv(skip._bn1(skip._depthwise_conv(hidden)).clamp(0, 6)))
        torch.testing.assert_close(skip(x), body + x)
    assert bool((expanded > 6).any())
    assert not MBConv(8, 16, 6, 3, 1).skip and not MBConv(8, 8, 6, 3, 2).skip
    assert MBConv(32, 16, 1, 3, 1)._expand_conv is None  # block 0: no expansion


def test_conv_stages_end_each_resolution_and_feed_fedfa_and_pardon():
    model = create_model("efficientnet_lite0", num_classes=10, image_size=64).eval()
    names = conv_stages(model)
    assert names == ["_blocks.0", "_blocks.2", "_blocks.4", "_blocks.10", "_blocks.15"]
    modules = dict(model.named_modules())
    shapes: dict[str, list[tuple[int, ...]]] = {n: [] for n in names}
    hooks = [modules[n].register_forward_hook(lambda m, i, o, n=n: shapes[n].append(tuple(o.shape))) for n in names]
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    for h in hooks:
        h.remove()
    assert [s for (s,) in shapes.values()] == [(2, 16, 32, 32), (2, 24, 16, 16), (2, 40, 8, 8), (2, 112, 4, 4),
                                               (2, 320, 2, 2)]
    assert resolve_layer(model, StyleParams()) == "_blocks.0"  # PARDON's feature-space style path: stage 1
    fedfa = create_method("fedfa", {}).prepare_model(model).train()
    with torch.no_grad():
        fedfa(torch.randn(2, 3, 64, 64))
    assert fedfa.fedfa.channels() == {1: 16, 2: 24, 3: 40, 4: 112, 5: 320}


def test_normalisation_maps_0_and_1_to_the_checkpoints_range():
    torch.testing.assert_close(imagenet_normalise(torch.tensor([0.0, 1.0])), torch.tensor([-127 / 128, 1.0]))


def test_features_are_the_spatial_mean_of_the_relu6_head():
    torch.manual_seed(0)
    model = create_model("efficientnet_lite0", num_classes=10)  # batch statistics: the head's BN output is N(0, 1)
    with torch.no_grad():
        model._bn1.weight.fill_(8.0)  # head activations on both sides of ReLU6's [0, 6]
    seen = {}
    model._bn1.register_forward_hook(lambda m, i, o: seen.update(head=o))
    with torch.no_grad():
        feats = model.features(torch.randn(2, 3, 64, 64))
    head = seen["head"]
    assert bool((head > 6).any()) and bool((head < 0).any())
    torch.testing.assert_close(feats, head.clamp(0, 6).mean(dim=(2, 3)))


def test_batchnorm_has_tensorflows_eps_and_momentum_and_convs_start_kaiming_fan_out():
    torch.manual_seed(0)
    model = create_model("efficientnet_lite0", num_classes=10)
    assert {(m.eps, m.momentum) for m in model.modules() if isinstance(m, nn.BatchNorm2d)} == {(1e-3, 0.01)}
    head = model._conv_head.weight  # 1280 × 320 × 1 × 1: fan_out 1280, fan_in 320
    assert float(head.detach().std()) == pytest.approx(math.sqrt(2 / 1280), rel=0.02)


def test_classifier_is_a_read_only_alias():
    model = create_model("efficientnet_lite0", num_classes=10)
    with pytest.raises(AttributeError, match="read-only alias of _fc"):
        model.classifier = nn.Linear(1280, 3)


@pytest.mark.parametrize("num_classes", [1000, 10])
def test_a_checkpoint_without_a_trunk_weight_is_refused(tmp_path, monkeypatch, num_classes):
    state = torch.load(pretrained_path(), weights_only=True)
    del state["_bn0.weight"]
    torch.save(state, tmp_path / "partial.pth")
    monkeypatch.setattr(efficientnet, "pretrained_path", lambda: tmp_path / "partial.pth")
    with pytest.raises(ValueError, match="does not fit EfficientNetLite"):
        efficientnet_lite0(num_classes, pretrained=True)
