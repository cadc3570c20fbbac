"""VGG-11 (Simonyan & Zisserman, 2015; configuration "A"), optionally with BatchNorm, with torchvision's
state_dict keys (``features.N.*``, ``classifier.N.*``) and initialisation.

Name clash: torchvision keeps the convolutional trunk in a submodule called ``features``, while
``FedModel.features(x)`` is the method returning the flat representation. Both live here. The trunk
is registered directly in ``self._modules["features"]`` (``add_module`` refuses a name the class
already defines). Attribute lookup finds the method on the class before ``nn.Module.__getattr__``
would look in ``_modules``, so ``model.features(x)`` is the FedModel method, while ``state_dict``,
``named_parameters``, ``to``/``apply`` and parameter aggregation all see the trunk as ``features.*``.
Code that needs the trunk module uses :attr:`VGG.trunk`.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel

# Configuration "A": output widths of the 3×3 convolutions, "M" a 2×2 max-pool.
VGG11_CFG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def _make_trunk(cfg: tuple[int | str, ...], in_channels: int, batch_norm: bool, ceil_mode: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = in_channels
    for item in cfg:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=ceil_mode))
            continue
        width = int(item)
        layers.append(nn.Conv2d(channels, width, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(width))
        layers.append(nn.ReLU(inplace=True))
        channels = width
    return nn.Sequential(*layers)


class VGG(FedModel):
    """torchvision's VGG: trunk ``features`` → adaptive avg-pool → flatten (``features(x)``) →
    ``classifier`` = Linear → ReLU → Dropout → Linear → ReLU → Dropout → Linear.

    * ``small_input`` (default: ``image_size <= 64``) makes the five max-pools round up
      (``ceil_mode``), so 28 px inputs keep a 1×1 map instead of vanishing; it changes no
      parameter and is a no-op for sizes divisible by 32.
    * ``reduced_head`` (default off) pools to 1×1 and uses 512-wide hidden layers: ``feature_dim``
      512 instead of 25088 and ~1 M instead of ~120 M head parameters. Keys are unchanged but the
      head's shapes differ from torchvision's.
    """

    def __init__(
        self,
        cfg: tuple[int | str, ...],
        num_classes: int,
        in_channels: int = 3,
        image_size: int = 28,
        batch_norm: bool = False,
        small_input: bool | None = None,
        reduced_head: bool = False,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        small = image_size <= 64 if small_input is None else small_input
        self._modules["features"] = _make_trunk(cfg, in_channels, batch_norm, ceil_mode=small)
        pooled = 1 if reduced_head else 7
        hidden = 512 if reduced_head else 4096
        self.avgpool = nn.AdaptiveAvgPool2d((pooled, pooled))
        self.feature_dim = 512 * pooled * pooled
        self.classifier = nn.Sequential(
            nn.Linear(self.feature_dim, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:  # every trunk convolution has a bias
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    @property
    def trunk(self) -> nn.Sequential:
        """The convolutional trunk (torchvision's ``features`` submodule)."""
        return cast(nn.Sequential, self._modules["features"])

    def features(self, x: Tensor) -> Tensor:
        return torch.flatten(self.avgpool(self.trunk(x)), 1)


def vgg11(
    num_classes: int,
    in_channels: int = 3,
    image_size: int = 28,
    small_input: bool | None = None,
    reduced_head: bool = False,
) -> VGG:
    """VGG-11 without BatchNorm (torchvision ``vgg11``)."""
    return VGG(VGG11_CFG, num_classes, in_channels, image_size, False, small_input, reduced_head)


def vgg11_bn(
    num_classes: int,
    in_channels: int = 3,
    image_size: int = 28,
    small_input: bool | None = None,
    reduced_head: bool = False,
) -> VGG:
    """VGG-11 with BatchNorm after every convolution (torchvision ``vgg11_bn``)."""
    return VGG(VGG11_CFG, num_classes, in_channels, image_size, True, small_input, reduced_head)
