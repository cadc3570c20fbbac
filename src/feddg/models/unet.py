"""The U-Net of FedHarmo / FedFA for prostate MRI segmentation (Ronneberger et al., 2015, as in Buda et al.'s
``brain-segmentation-pytorch``, which HarmoFL's and FedFA's code use).

``depth`` encoder blocks of widths ``width × 2^k`` (each two 3×3 conv – BatchNorm – ReLU, a 2×2 max-pool
between blocks), a bottleneck block of ``width × 2^depth`` channels, and ``depth`` decoder levels, each a 2×2
transposed convolution (stride 2) that halves the channels and doubles the resolution, the concatenation
``[up-sampled, encoder block output]`` (the skip connection) and a block; ``classifier`` is a 1×1 convolution to
``num_classes``. ``width=32, depth=4`` with 3 input channels is the papers' network: 7.76 M parameters, the
"2 × 29.6 MB" per round of FedFA §6.1; widths 8–16 suit CPU runs.

The representation is dense: ``features(x)`` is the last decoder map ``[B, width, H, W]`` (``feature_dim =
width``) and ``forward`` gives ``[B, num_classes, H, W]``, what the segmentation task expects. Inputs must have
sides divisible by ``2^depth``.

:class:`UpConv2x2` keeps its weight in convolution layout ``[out, in, 2, 2]`` (``nn.ConvTranspose2d`` keeps
``[in, out, 2, 2]``), so HFedATM's filter-wise alignment, which matches filters along dim 0, aligns its output
channels like any convolution's. A checkpoint of an ``nn.ConvTranspose2d`` U-Net loads with that weight
transposed (``w.transpose(0, 1)``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddg.models.base import FedModel


class UpConv2x2(nn.Module):
    """A 2×2 transposed convolution with stride 2: ``out[o, 2i+a, 2j+b] = Σ_c W[o, c, a, b] x[c, i, j] + bias[o]``.

    Computes what ``nn.ConvTranspose2d(in_channels, out_channels, 2, stride=2)`` computes, with the weight stored
    transposed, ``[out, in, 2, 2]``; initialised as ``nn.ConvTranspose2d`` is (same distribution, same draws).
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, 2, 2))
        self.bias = nn.Parameter(torch.empty(out_channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.ConvTranspose2d's: kaiming_uniform_(a=√5) of its [in, out, 2, 2] weight, whose fan_in is out·2·2
        w = torch.empty(self.in_channels, self.out_channels, 2, 2, device=self.weight.device)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        bound = 1.0 / math.sqrt(self.out_channels * 4)
        with torch.no_grad():
            self.weight.copy_(w.transpose(0, 1))
            self.bias.uniform_(-bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv_transpose2d(x, self.weight.transpose(0, 1), self.bias, stride=2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size=(2, 2), stride=(2, 2)"


def conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    """conv 3×3 → BN → ReLU → conv 3×3 → BN → ReLU (convs without bias: BatchNorm follows)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class UNet(FedModel):
    """``encoders.k`` (k < depth) → ``bottleneck`` → (``upconvs.j``, concatenation with ``encoders.{depth−1−j}``,
    ``decoders.j``) for j < depth → ``classifier`` (1×1 conv). ``image_size`` is only checked: the network is
    fully convolutional."""

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 64, width: int = 32,
                 depth: int = 4) -> None:
        super().__init__()
        if depth < 1 or width < 1:
            raise ValueError(f"U-Net needs depth >= 1 and width >= 1, got depth {depth}, width {width}")
        if image_size % 2**depth:
            raise ValueError(f"U-Net of depth {depth} needs an image size divisible by {2**depth}, got {image_size}")
        widths = [width * 2**k for k in range(depth)]
        self.encoders = nn.ModuleList(conv_block(c, w) for c, w in zip([in_channels, *widths[:-1]], widths))
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = conv_block(widths[-1], 2 * widths[-1])
        self.upconvs = nn.ModuleList(UpConv2x2(2 * w, w) for w in reversed(widths))
        self.decoders = nn.ModuleList(conv_block(2 * w, w) for w in reversed(widths))
        self.feature_dim = width
        self.classifier = nn.Conv2d(width, num_classes, kernel_size=1)

    def features(self, x: Tensor) -> Tensor:
        skips = []
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, decoder, skip in zip(self.upconvs, self.decoders, reversed(skips), strict=True):
            x = decoder(torch.cat((up(x), skip), dim=1))
        return x
