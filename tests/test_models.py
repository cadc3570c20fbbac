"""The model zoo: shapes, the features/classifier split, torchvision key compatibility, weight loading."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddg.models import MODELS, FedModel, create_model, list_models, model_targets
from feddg.models.cnn import SmallCNN
from feddg.models.resnet import Bottleneck, ResNet
from feddg.models.vgg import VGG

# torchvision.models.resnet18(num_classes=1000).state_dict(), in order: "key dim dim ..." (no dims: a scalar).
RESNET18_TORCHVISION = """
conv1.weight 64 3 7 7
bn1.weight 64
bn1.bias 64
bn1.running_mean 64
bn1.running_var 64
bn1.num_batches_tracked
layer1.0.conv1.weight 64 64 3 3
layer1.0.bn1.weight 64
layer1.0.bn1.bias 64
layer1.0.bn1.running_mean 64
layer1.0.bn1.running_var 64
layer1.0.bn1.num_batches_tracked
layer1.0.conv2.weight 64 64 3 3
layer1.0.bn2.weight 64
layer1.0.bn2.bias 64
layer1.0.bn2.running_mean 64
layer1.0.bn2.running_var 64
layer1.0.bn2.num_batches_tracked
layer1.1.conv1.weight 64 64 3 3
layer1.1.bn1.weight 64
layer1.1.bn1.bias 64
layer1.1.bn1.running_mean 64
layer1.1.bn1.running_var 64
layer1.1.bn1.num_batches_tracked
layer1.1.conv2.weight 64 64 3 3
layer1.1.bn2.weight 64
layer1.1.bn2.bias 64
layer1.1.bn2.running_mean 64
layer1.1.bn2.running_var 64
layer1.1.bn2.num_batches_tracked
layer2.0.conv1.weight 128 64 3 3
layer2.0.bn1.weight 128
layer2.0.bn1.bias 128
layer2.0.bn1.running_mean 128
layer2.0.bn1.running_var 128
layer2.0.bn1.num_batches_tracked
layer2.0.conv2.weight 128 128 3 3
layer2.0.bn2.weight 128
layer2.0.bn2.bias 128
layer2.0.bn2.running_mean 128
layer2.0.bn2.running_var 128
layer2.0.bn2.num_batches_tracked
layer2.0.downsample.0.weight 128 64 1 1
layer2.0.downsample.1.weight 128
layer2.0.downsample.1.bias 128
layer2.0.downsample.1.running_mean 128
layer2.0.downsample.1.running_var 128
layer2.0.downsample.1.num_batches_tracked
layer2.1.conv1.weight 128 128 3 3
layer2.1.bn1.weight 128
layer2.1.bn1.bias 128
layer2.1.bn1.running_mean 128
layer2.1.bn1.running_var 128
layer2.1.bn1.num_batches_tracked
layer2.1.conv2.weight 128 128 3 3
layer2.1.bn2.weight 128
layer2.1.bn2.bias 128
layer2.1.bn2.running_mean 128
layer2.1.bn2.running_var 128
layer2.1.bn2.num_batches_tracked
layer3.0.conv1.weight 256 128 3 3
layer3.0.bn1.weight 256
layer3.0.bn1.bias 256
layer3.0.bn1.running_mean 256
layer3.0.bn1.running_var 256
layer3.0.bn1.num_batches_tracked
layer3.0.conv2.weight 256 256 3 3
layer3.0.bn2.weight 256
layer3.0.bn2.bias 256
layer3.0.bn2.running_mean 256
layer3.0.bn2.running_var 256
layer3.0.bn2.num_batches_tracked
layer3.0.downsample.0.weight 256 128 1 1
layer3.0.downsample.1.weight 256
layer3.0.downsample.1.bias 256
layer3.0.downsample.1.running_mean 256
layer3.0.downsample.1.running_var 256
layer3.0.downsample.1.num_batches_tracked
layer3.1.conv1.weight 256 256 3 3
layer3.1.bn1.weight 256
layer3.1.bn1.bias 256
layer3.1.bn1.running_mean 256
layer3.1.bn1.running_var 256
layer3.1.bn1.num_batches_tracked
layer3.1.conv2.weight 256 256 3 3
layer3.1.bn2.weight 256
layer3.1.bn2.bias 256
layer3.1.bn2.running_mean 256
layer3.1.bn2.running_var 256
layer3.1.bn2.num_batches_tracked
layer4.0.conv1.weight 512 256 3 3
layer4.0.bn1.weight 512
layer4.0.bn1.bias 512
layer4.0.bn1.running_mean 512
layer4.0.bn1.running_var 512
layer4.0.bn1.num_batches_tracked
layer4.0.conv2.weight 512 512 3 3
layer4.0.bn2.weight 512
layer4.0.bn2.bias 512
layer4.0.bn2.running_mean 512
layer4.0.bn2.running_var 512
layer4.0.bn2.num_batches_tracked
layer4.0.downsample.0.weight 512 256 1 1
layer4.0.downsample.1.weight 512
layer4.0.downsample.1.bias 512
layer4.0.downsample.1.running_mean 512
layer4.0.downsample.1.running_var 512
layer4.0.downsample.1.num_batches_tracked
layer4.1.conv1.weight 512 512 3 3
layer4.1.bn1.weight 512
layer4.1.bn1.bias 512
layer4.1.bn1.running_mean 512
layer4.1.bn1.running_var 512
layer4.1.bn1.num_batches_tracked
layer4.1.conv2.weight 512 512 3 3
layer4.1.bn2.weight 512
layer4.1.bn2.bias 512
layer4.1.bn2.running_mean 512
layer4.1.bn2.running_var 512
layer4.1.bn2.num_batches_tracked
fc.weight 1000 512
fc.bias 1000
"""

# torchvision.models.vgg11(num_classes=1000).state_dict(), in order.
VGG11_TORCHVISION = """
features.0.weight 64 3 3 3
features.0.bias 64
features.3.weight 128 64 3 3
features.3.bias 128
features.6.weight 256 128 3 3
features.6.bias 256
features.8.weight 256 256 3 3
features.8.bias 256
features.11.weight 512 256 3 3
features.11.bias 512
features.13.weight 512 512 3 3
features.13.bias 512
features.16.weight 512 512 3 3
features.16.bias 512
features.18.weight 512 512 3 3
features.18.bias 512
classifier.0.weight 4096 25088
classifier.0.bias 4096
classifier.3.weight 4096 4096
classifier.3.bias 4096
classifier.6.weight 1000 4096
classifier.6.bias 1000
"""


def _parse(table: str) -> list[tuple[str, list[int]]]:
    rows = [line.split() for line in table.strip().splitlines()]
    return [(row[0], [int(d) for d in row[1:]]) for row in rows]


def _keys_and_shapes(model: nn.Module) -> list[tuple[str, list[int]]]:
    return [(k, list(v.shape)) for k, v in model.state_dict().items()]


def _on_meta(name: str, **kwargs: Any) -> FedModel:
    """Build a model without allocating or initialising its weights (enough for keys and shapes)."""
    with torch.device("meta"):
        return create_model(name, **kwargs)


# (name, image size, channels, options): every model at 28 and 32 px; 1 and 3 channels where sensible.
# VGG's 25088→4096 head is built once (it is 100 M parameters); the other VGG cases use the reduced head.
SHAPE_CASES: list[tuple[str, int, int, dict[str, Any]]] = [
    *[(name, size, c, {}) for name in ("lenet", "cnn", "cnn4", "cnn_gn", "hfedf-cnn") for size in (28, 32) for c in (1, 3)],
    ("alexnet", 28, 1, {}),
    ("alexnet", 32, 3, {}),
    ("resnet18", 28, 1, {}),
    ("resnet18", 32, 3, {}),
    ("resnet50", 28, 3, {}),
    ("resnet50", 32, 1, {}),
    ("vgg11", 32, 3, {}),
    ("vgg11", 28, 1, {"reduced_head": True}),
    ("vgg11_bn", 28, 3, {"reduced_head": True}),
    ("vgg11_bn", 32, 1, {"reduced_head": True}),
    ("efficientnet_lite0", 28, 1, {}),
    ("efficientnet_lite0", 32, 3, {}),
    ("swin_t", 32, 3, {}),  # more Swin cases: tests/test_swin.py
    ("swin_tiny_test", 64, 1, {}),
]


#: token and bag-of-words models: tests/test_transformer.py
TEXT_MODELS = {"mlp", "tiny-deberta", "tiny-roberta", "transformer"}


def test_registry_lists_every_model() -> None:
    assert list_models() == [
        "alexnet", "cnn", "cnn4", "cnn_gn", "efficientnet_lite0", "hfedf-cnn", "lenet", "mlp", "resnet18", "resnet50",
        "swin_t", "swin_tiny_test", "tiny-deberta", "tiny-roberta", "transformer", "unet", "vgg11", "vgg11_bn",
    ]
    assert {name for name, *_ in SHAPE_CASES} | {"unet"} | TEXT_MODELS == set(list_models())  # dense outputs: tests/test_unet.py


@pytest.mark.parametrize(
    ("name", "size", "channels", "options"),
    SHAPE_CASES,
    ids=[f"{n}-{s}px-{c}ch{'-reduced' if o else ''}" for n, s, c, o in SHAPE_CASES],
)
def test_shapes_and_feature_split(name: str, size: int, channels: int, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = create_model(name, num_classes=7, in_channels=channels, image_size=size, **options).eval()
    x = torch.randn(2, channels, size, size)
    with torch.no_grad():
        feats = model.features(x)
        out = model(x)
    assert isinstance(model, FedModel)
    assert feats.shape == (2, model.feature_dim)
    assert out.shape == (2, 7)
    assert torch.equal(out, model.classifier(feats))


def test_the_cnns_norm_is_what_its_name_and_capabilities_say() -> None:
    # a mistyped norm built GroupNorm silently, and cnn with norm=group still claimed BatchNorm's capability
    assert isinstance(create_model("cnn", 10).blocks[0][1], torch.nn.BatchNorm2d)
    assert isinstance(create_model("cnn_gn", 10).blocks[0][1], torch.nn.GroupNorm)
    with pytest.raises(ValueError, match=r"^model\.params\.norm: model cnn has no such option; it takes block_widths$"):
        create_model("cnn", 10, norm="group")
    with pytest.raises(ValueError, match=r"^cnn norm must be 'batch' or 'group', got 'batchnorm'$"):
        SmallCNN(10, norm="batchnorm")  # type: ignore[arg-type]


def test_resnet18_at_224_px() -> None:
    model = create_model("resnet18", num_classes=10, image_size=224).eval()
    assert model.conv1.kernel_size == (7, 7) and isinstance(model.maxpool, nn.MaxPool2d)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 10)


def test_resnet18_state_dict_is_torchvision() -> None:
    model = _on_meta("resnet18", num_classes=1000, image_size=224)
    assert _keys_and_shapes(model) == _parse(RESNET18_TORCHVISION)
    assert sum(p.numel() for p in model.parameters()) == 11_689_512  # torchvision's count
    small = _on_meta("resnet18", num_classes=1000, image_size=32)  # CIFAR stem: same keys
    assert list(small.state_dict()) == list(model.state_dict())
    assert list(small.conv1.weight.shape) == [64, 3, 3, 3] and isinstance(small.maxpool, nn.Identity)


def test_resnet50_state_dict_is_torchvision() -> None:
    model = _on_meta("resnet50", num_classes=1000, image_size=224)
    state = model.state_dict()
    assert len(state) == 320  # 161 parameters + 159 BatchNorm buffers (3 per BN layer, 53 layers)
    assert len(list(model.parameters())) == 161
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's count
    expected = {
        "conv1.weight": [64, 3, 7, 7],
        "layer1.0.conv1.weight": [64, 64, 1, 1],
        "layer1.0.conv3.weight": [256, 64, 1, 1],
        "layer1.0.downsample.0.weight": [256, 64, 1, 1],
        "layer1.0.downsample.1.running_var": [256],
        "layer2.0.conv2.weight": [128, 128, 3, 3],
        "layer3.5.bn3.running_mean": [1024],
        "layer4.0.downsample.0.weight": [2048, 1024, 1, 1],
        "layer4.2.conv3.weight": [2048, 512, 1, 1],
        "layer4.2.bn3.num_batches_tracked": [],
        "fc.weight": [1000, 2048],
        "fc.bias": [1000],
    }
    assert {k: list(state[k].shape) for k in expected} == expected
    assert (next(iter(state)), list(state)[-1]) == ("conv1.weight", "fc.bias")
    # v1.5: the stride of a downsampling bottleneck sits on its 3×3 convolution.
    assert model.layer2[0].conv1.stride == (1, 1) and model.layer2[0].conv2.stride == (2, 2)


def test_resnet_classifier_is_a_read_only_alias_of_fc() -> None:
    model = _on_meta("resnet18", num_classes=10)
    assert model.classifier is model.fc
    assert not any(k.startswith("classifier") for k in model.state_dict())
    with pytest.raises(AttributeError, match="read-only"):
        model.classifier = nn.Linear(512, 3)


def test_vgg11_state_dict_is_torchvision() -> None:
    model = _on_meta("vgg11", num_classes=1000, image_size=224)
    assert _keys_and_shapes(model) == _parse(VGG11_TORCHVISION)
    assert sum(p.numel() for p in model.parameters()) == 132_863_336  # torchvision's count
    # vgg11_bn: BatchNorm after each of the 8 convolutions shifts the trunk indices (conv 0, bn 1, ...).
    bn = _on_meta("vgg11_bn", num_classes=1000, image_size=224).state_dict()
    assert len(bn) == 22 + 8 * 5
    assert list(bn["features.1.running_var"].shape) == [64]
    assert list(bn["features.25.weight"].shape) == [512, 512, 3, 3]
    assert sum(v.numel() for k, v in bn.items() if "running" not in k and "num_batches" not in k) == 132_868_840


def test_vgg_features_is_the_method_and_the_trunk_keeps_torchvision_name() -> None:
    model = create_model("vgg11", num_classes=5, image_size=32, reduced_head=True).eval()
    assert isinstance(model, VGG)
    assert model._modules["features"] is model.trunk and isinstance(model.trunk, nn.Sequential)
    assert [name for name, _ in model.named_parameters()] == [k for k in model.state_dict() if "running" not in k]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model.features(x)
        assert torch.equal(feats, torch.flatten(model.avgpool(model.trunk(x)), 1))
    assert feats.shape == (2, 512)


def test_hfedf_cnn_parameter_count_follows_table_9() -> None:
    # hFedF paper, Table 9, 3×32×32 input, 7 classes (PACS). Conv/Linear: in·out·k² weights + out biases.
    stem = (3 * 32 * 9 + 32) + (32 * 32 * 1 + 32) + (32 * 64 * 9 + 64)  # conv 3×3 → 32, conv 1×1 → 32, conv 3×3 → 64

    def inception(c_in: int) -> int:  # naïve module: 1×1 → 32, 3×3 → 64, 5×5 → 16 (+ parameter-free max-pool)
        return (c_in * 32 * 1 + 32) + (c_in * 64 * 9 + 64) + (c_in * 16 * 25 + 16)

    blocks = inception(64) + inception(64 + 112)  # 64 → 176 → 288 channels
    head = (288 * 3 * 3 * 256 + 256) + (256 * 7 + 7)  # Linear 2592 → 256, Linear 256 → 7
    assert stem + blocks + head == 928_199
    model = create_model("hfedf-cnn", num_classes=7, in_channels=3, image_size=32)
    assert sum(p.numel() for p in model.parameters()) == 928_199
    assert not list(model.buffers())  # no BatchNorm: a hypernetwork generates the whole state


def _bn_by_hand(x: Tensor, bn: nn.Module) -> Tensor:
    """BatchNorm in eval mode: (x − running mean) / √(running var + eps) · γ + β."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return (x - bn.running_mean[:, None, None]) * scale[:, None, None] + bn.bias[:, None, None]


def _randomize_batchnorm(model: nn.Module) -> None:
    """Non-trivial BatchNorm parameters and statistics, so a dropped or misplaced norm is visible."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0.0, 0.1)
            m.running_mean.normal_(0.0, 0.1)
            m.running_var.uniform_(0.5, 2.0)


def _resnet_by_hand(model: ResNet, x: Tensor, small: bool) -> Tensor:
    """He et al.'s ResNet as torchvision builds it: stem (3×3/1 for small inputs, else 7×7/2 + 3×3/2 max-pool), four
    stages whose first block strides by 2 (but stage 1's) on its 3×3 conv (v1.5) and, when its shape changes, has a
    1×1 conv + BN shortcut; out = relu(residual + shortcut); global average pool; ``fc``."""
    conv = model.conv1.weight
    h = F.conv2d(x, conv, padding=1) if small else F.conv2d(x, conv, stride=2, padding=3)
    h = _bn_by_hand(h, model.bn1).clamp(min=0)
    if not small:
        h = F.max_pool2d(h, kernel_size=3, stride=2, padding=1)
    for k, layer in enumerate((model.layer1, model.layer2, model.layer3, model.layer4)):
        for i, block in enumerate(layer):
            stride = 2 if k > 0 and i == 0 else 1
            bottleneck = isinstance(block, Bottleneck)
            assert (block.downsample is not None) == (i == 0 and (k > 0 or bottleneck)), (k, i)
            if bottleneck:
                out = _bn_by_hand(F.conv2d(h, block.conv1.weight), block.bn1).clamp(min=0)
                out = _bn_by_hand(F.conv2d(out, block.conv2.weight, stride=stride, padding=1), block.bn2).clamp(min=0)
                out = _bn_by_hand(F.conv2d(out, block.conv3.weight), block.bn3)
            else:
                out = _bn_by_hand(F.conv2d(h, block.conv1.weight, stride=stride, padding=1), block.bn1).clamp(min=0)
                out = _bn_by_hand(F.conv2d(out, block.conv2.weight, padding=1), block.bn2)
            shortcut = h
            if block.downsample is not None:
                shortcut = _bn_by_hand(F.conv2d(h, block.downsample[0].weight, stride=stride), block.downsample[1])
            h = (out + shortcut).clamp(min=0)
    return h.mean(dim=(2, 3)) @ model.fc.weight.T + model.fc.bias


@pytest.mark.parametrize(("name", "size", "small"), [("resnet18", 16, True), ("resnet18", 32, False),
                                                     ("resnet50", 16, True)])
def test_resnet_forward_is_rebuilt_from_its_weights(name: str, size: int, small: bool) -> None:
    torch.manual_seed(0)
    model = create_model(name, num_classes=3, image_size=size, small_input=small)
    assert isinstance(model, ResNet)
    _randomize_batchnorm(model)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), _resnet_by_hand(model, x, small), rtol=1e-4, atol=1e-4)


def test_hfedf_cnn_forward_follows_table_9_by_hand() -> None:
    """Table 9 at 24 px (so the adaptive pool is an exact 2×2 mean): conv 3×3 → max-pool → ReLU → conv 1×1 → conv
    3×3 → max-pool → ReLU → two naïve Inception modules, ReLU([1×1, 3×3, 5×5, 3×3/1 max-pool]) → 3×3 average pool →
    dropout 0.2 → Linear → Linear."""
    torch.manual_seed(0)
    model = create_model("hfedf-cnn", num_classes=4, in_channels=3, image_size=24).eval()
    x = torch.randn(2, 3, 24, 24)
    conv0, _, _, conv1, conv2, _, _, inc1, inc2, *_, linear = model.trunk
    with torch.no_grad():
        h = F.max_pool2d(F.conv2d(x, conv0.weight, conv0.bias, padding=1), 2).clamp(min=0)
        h = F.conv2d(F.conv2d(h, conv1.weight, conv1.bias), conv2.weight, conv2.bias, padding=1)
        h = F.max_pool2d(h, 2).clamp(min=0)
        for inc in (inc1, inc2):
            h = torch.cat((F.conv2d(h, inc.branch1.weight, inc.branch1.bias),
                           F.conv2d(h, inc.branch3.weight, inc.branch3.bias, padding=1),
                           F.conv2d(h, inc.branch5.weight, inc.branch5.bias, padding=2),
                           F.max_pool2d(h, 3, stride=1, padding=1)), dim=1).clamp(min=0)
        n, c = h.shape[:2]
        h = h.reshape(n, c, 3, 2, 3, 2).mean(dim=(3, 5)).flatten(1)  # 6×6 → 3×3
        feats = h @ linear.weight.T + linear.bias
        torch.testing.assert_close(model.features(x), feats, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), feats @ model.classifier.weight.T + model.classifier.bias,
                                   rtol=1e-5, atol=1e-5)
        torch.manual_seed(3)  # training: the same dropout draws as F.dropout(p = 0.2) on the pooled features
        trained = model.train().features(x)
        torch.manual_seed(3)
        dropped = F.dropout(h, p=0.2, training=True) @ linear.weight.T + linear.bias
        torch.testing.assert_close(trained, dropped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["lenet", "cnn", "hfedf-cnn", "alexnet", "resnet18", "efficientnet_lite0"])
def test_save_and_load_round_trip(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = create_model(name, num_classes=4, in_channels=3, image_size=32)
    x = torch.randn(2, 3, 32, 32)
    source.train()(x)  # move the BatchNorm running statistics away from their initial values
    path = tmp_path / f"{name}.pth"
    torch.save(source.state_dict(), path)
    torch.manual_seed(1)
    loaded = create_model(name, num_classes=4, in_channels=3, image_size=32, weights=str(path))
    with torch.no_grad():
        assert torch.equal(source.eval()(x), loaded.eval()(x))


@pytest.mark.parametrize(
    ("name", "head"),
    [("resnet18", ["fc.weight", "fc.bias"]), ("alexnet", ["classifier.fc3"]), ("efficientnet_lite0", ["_fc."])],
)
def test_head_size_mismatch_loads_trunk_and_keeps_a_fresh_head(
    name: str, head: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    path = tmp_path / "ten.pth"
    saved = create_model(name, num_classes=10, image_size=32).state_dict()
    torch.save(saved, path)
    torch.manual_seed(1)
    fresh = create_model(name, num_classes=3, image_size=32).state_dict()
    torch.manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="feddg.models.registry"):
        loaded = create_model(name, num_classes=3, image_size=32, weights=path).state_dict()
    assert "head shape differs" in caplog.text and str(path) in caplog.text
    for key, value in loaded.items():
        is_head = any(key.startswith(h) for h in head)
        assert torch.equal(value, fresh[key] if is_head else saved[key]), key


def test_a_checkpoint_without_num_batches_tracked_loads(tmp_path: Path) -> None:
    """torchvision's checkpoints predate BatchNorm's ``num_batches_tracked``: every other tensor loads, the counters
    stay at their initial 0."""
    torch.manual_seed(0)
    source = create_model("cnn", num_classes=3, image_size=28)
    source.train()(torch.randn(2, 3, 28, 28))  # running statistics and counters away from their initial values
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert len(state) < len(source.state_dict())
    torch.save(state, tmp_path / "old.pth")
    loaded = create_model("cnn", num_classes=3, image_size=28, weights=tmp_path / "old.pth").state_dict()
    for key, value in loaded.items():
        assert torch.equal(value, state.get(key, torch.tensor(0))), key


def test_missing_weights_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.pth"
    with pytest.raises(FileNotFoundError) as err:
        create_model("cnn", num_classes=3, weights=str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_unexpected_and_missing_keys_name_the_first_keys_and_the_file(tmp_path: Path) -> None:
    state = create_model("cnn", num_classes=3).state_dict()
    state["bogus.weight"] = torch.zeros(1)
    del state["blocks.0.0.weight"]
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    with pytest.raises(ValueError) as err:
        create_model("cnn", num_classes=3, weights=path)
    message = str(err.value)
    assert str(path) in message and "blocks.0.0.weight" in message and "bogus.weight" in message
    assert "\n" not in message


def test_trunk_shape_mismatch_and_non_state_dict_files_are_errors(tmp_path: Path) -> None:
    grey = tmp_path / "grey.pth"
    torch.save(create_model("cnn", num_classes=3, in_channels=1).state_dict(), grey)
    with pytest.raises(ValueError, match=r"shape mismatch .*blocks\.0\.0\.weight \[32, 1, 3, 3\] vs \[32, 3, 3, 3\]"):
        create_model("cnn", num_classes=3, in_channels=3, weights=grey)
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        create_model("cnn", num_classes=3, weights=junk)
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"epoch": 3, "state_dict": {}}, wrapped)
    with pytest.raises(ValueError, match="not a state_dict"):
        create_model("cnn", num_classes=3, weights=wrapped)


def test_unknown_model_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet19'.*resnet18.*vgg11"):
        create_model("resnet19", num_classes=3)


@pytest.mark.parametrize("name", sorted(set(MODELS) - TEXT_MODELS))
def test_declared_capabilities_are_the_built_models(name: str) -> None:
    """What configs are checked against (models/registry.py: CAPABILITIES) is what the model has."""
    from feddg.models.registry import CAPABILITIES
    from feddg.models.stages import conv_stages

    model = create_model(name, num_classes=3, in_channels=3, image_size=32)
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    try:
        staged = bool(conv_stages(model))
    except TypeError:
        staged = False
    with torch.no_grad():
        shape = tuple(model.eval()(torch.zeros(2, 3, 32, 32)).shape)
    dense = {(2, 3): False, (2, 3, 32, 32): True}[shape]  # one class score per sample, or per pixel
    assert CAPABILITIES[name] == {c for c, on in (("batchnorm", has_bn), ("conv_stages", staged),
                                                  ("dense_masks", dense)) if on}
    assert model_targets(name) == ("dense_masks" if dense else "class_labels")
