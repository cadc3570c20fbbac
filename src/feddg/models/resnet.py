"""ResNet-18/50 (He et al., 2016) with torchvision's architecture and state_dict keys.

The modules carry torchvision's names (``conv1``, ``bn1``, ``layer1.0.conv1``,
``layer1.0.downsample.0``, ``fc``, ...) and torchvision's initialisation, so torchvision
checkpoints load with ``create_model(..., weights=path)``. ResNet-50 is torchvision's v1.5 (the
stride sits on the 3×3 convolution of a bottleneck).

``small_input`` (default: ``image_size <= 64``) is the CIFAR-style stem: conv1 3×3 stride 1 and no
max-pool, for 28/32 px inputs. Keys are unchanged; only ``conv1.weight``'s shape differs
(``[64, C, 3, 3]`` instead of ``[64, C, 7, 7]``), so an ImageNet checkpoint needs ``small_input=False``.

``normalization="dac_sc"`` is DAC-SC (Lee et al., CVPR 2023; models/dac.py, docs/methods/dac_sc.md): every
shortcut BatchNorm (``layerK.0.downsample.1``) becomes a CCNorm (same keys, plus ``h``) and an SCNorm closes stages
1–3 (the last module of ``layer1``–``layer3``, so a stage's output, where FFA layers and augmentations hook, is
after it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel
from feddg.models.dac import CCNorm, SCNorm

#: ``normalization`` options: torchvision's BatchNorm everywhere, or DAC-SC's CCNorm / SCNorm placement
NORMALIZATIONS = ("batchnorm", "dac_sc")


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1×1 → 3×3 (strided) → 1×1 convolutions with a residual connection (ResNet-50 v1.5)."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(in_channels, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(FedModel):
    """torchvision's ResNet: ``features`` is the globally pooled ``layer4`` output, the head is ``fc``.

    ``classifier`` is a read-only alias of ``fc`` (a property, so the head is registered once and the
    state_dict has ``fc.*`` only); replace the head by assigning ``model.fc``.
    """

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        layers: tuple[int, int, int, int],
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 28,
        small_input: bool | None = None,
        normalization: str = "batchnorm",
    ) -> None:
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"resnet normalization must be one of {', '.join(NORMALIZATIONS)}, got {normalization!r}")
        self.normalization = normalization
        small = image_size <= 64 if small_input is None else small_input
        self._in_channels = 64
        if small:
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool: nn.Module = nn.Identity() if small else nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0], stride=1)
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.feature_dim = 512 * block.expansion
        self.fc = nn.Linear(self.feature_dim, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if normalization == "dac_sc":
            self._dac_sc()

    def _dac_sc(self) -> None:
        """DAC-SC's placement: CCNorm on every downsampling shortcut, SCNorm after stages 1–3."""
        for k in range(1, 5):
            layer = getattr(self, f"layer{k}")
            for block in layer:
                if block.downsample is not None:
                    block.downsample[1] = CCNorm(block.downsample[1].num_features)
            if k < 4:
                last = layer[-1]
                layer.append(SCNorm((last.bn3 if isinstance(last, Bottleneck) else last.bn2).num_features))

    @property
    def added_keys(self) -> frozenset[str]:
        """The state_dict keys a torchvision checkpoint lacks (``load_weights`` leaves them initialised): DAC-SC's
        λ logits ``h`` and SCNorm's γ, β; none for the BatchNorm ResNet."""
        keys = set()
        for name, m in self.named_modules():
            if isinstance(m, (CCNorm, SCNorm)):
                keys |= {f"{name}.{k}" for k in (m.state_dict() if isinstance(m, SCNorm) else ("h",))}
        return frozenset(keys)

    def _make_layer(self, block: type[BasicBlock | Bottleneck], width: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self._in_channels != width * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self._in_channels, width * block.expansion, stride),
                nn.BatchNorm2d(width * block.expansion),
            )
        layers = [block(self._in_channels, width, stride, downsample)]
        self._in_channels = width * block.expansion
        layers += [block(self._in_channels, width) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    @property
    def classifier(self) -> nn.Module:  # type: ignore[override]
        return self.fc

    def __setattr__(self, name: str, value: Any) -> None:
        # nn.Module.__setattr__ registers modules without consulting properties, so assigning
        # ``classifier`` would silently add a second, unused head to the state_dict.
        if name == "classifier":
            raise AttributeError("ResNet.classifier is a read-only alias of ResNet.fc; assign model.fc instead")
        super().__setattr__(name, value)

    def features(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)


def resnet18(num_classes: int, in_channels: int = 3, image_size: int = 28, small_input: bool | None = None,
             normalization: str = "batchnorm") -> ResNet:
    """ResNet-18: basic blocks [2, 2, 2, 2], ``feature_dim`` 512."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, in_channels, image_size, small_input, normalization)


def resnet50(num_classes: int, in_channels: int = 3, image_size: int = 28, small_input: bool | None = None,
             normalization: str = "batchnorm") -> ResNet:
    """ResNet-50 (v1.5): bottleneck blocks [3, 4, 6, 3], ``feature_dim`` 2048."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, in_channels, image_size, small_input, normalization)
