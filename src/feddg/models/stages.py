"""Where each zoo model's convolutional stages end.

Methods that act between stages — FedFA's FFA layers (after every stage, the paper's
"{1,…,5}"), PARDON's feature-space style transfer (after the first stage) — hook the modules
named here. A stage ends where a block of convolutions hands its feature map on, before the
next spatial reduction or block.
"""

from __future__ import annotations

from torch import nn

from feddg.models.alexnet import AlexNet
from feddg.models.cnn import SmallCNN
from feddg.models.efficientnet import EfficientNetLite, MBConv
from feddg.models.hfedf_cnn import HFedFCNN
from feddg.models.lenet import LeNet
from feddg.models.resnet import ResNet
from feddg.models.swin import SwinClassifier
from feddg.models.unet import UNet
from feddg.models.vgg import VGG


def conv_stages(model: nn.Module) -> list[str]:
    """Names of the modules (in forward order) whose output ends a conv stage of ``model``.

    Each named module is called exactly once per forward pass, so a forward hook on it sees
    the stage's output feature map ``[B, C, H, W]``.
    """
    if isinstance(inner := getattr(model, "stages_in", None), str):  # a method's wrapper names the model it wraps
        return [f"{inner}.{name}" for name in conv_stages(model.get_submodule(inner))]
    if isinstance(model, SmallCNN):  # CNN4 too
        return [f"blocks.{i}" for i in range(len(model.blocks))]
    if isinstance(model, LeNet):
        return ["conv.2", "conv.5"]
    if isinstance(model, HFedFCNN):
        return ["trunk.2", "trunk.6", "trunk.7", "trunk.8"]
    if isinstance(model, AlexNet):
        return [f"layer{i}" for i in range(1, 6)]
    if isinstance(model, ResNet):
        return ["maxpool", "layer1", "layer2", "layer3", "layer4"]
    if isinstance(model, EfficientNetLite):  # the last block at each resolution: _blocks.0, 2, 4, 10, 15
        blocks = model._blocks
        return [f"_blocks.{i}" for i in range(len(blocks)) if i + 1 == len(blocks) or _strided(blocks[i + 1])]
    if isinstance(model, VGG):
        return [f"features.{i}" for i, m in enumerate(model.trunk) if isinstance(m, nn.MaxPool2d)]
    if isinstance(model, SwinClassifier):  # each stage's tokens as a grid, before the next patch merging
        return [f"stage_ends.{i}" for i in range(len(model.stage_ends))]
    if isinstance(model, UNet):  # each encoder block (before its max-pool) and the bottleneck: FedFA's U-Net stages
        return [f"encoders.{i}" for i in range(len(model.encoders))] + ["bottleneck"]
    raise TypeError(f"no conv-stage map for {type(model).__name__}; add one in feddg/models/stages.py")


def stem_stages(model: nn.Module) -> int:
    """How many of ``conv_stages(model)`` belong to the stem: 1 for ResNets (``maxpool``, the output of the first
    convolution), 0 for models whose first stage is already a block. Placements that the papers give as "after the
    first residual stage" (MixStyle, Manifold Mixup) start after the stem."""
    if isinstance(inner := getattr(model, "stages_in", None), str):
        return stem_stages(model.get_submodule(inner))
    return 1 if isinstance(model, ResNet) else 0


def _strided(block: nn.Module) -> bool:
    return isinstance(block, MBConv) and block._depthwise_conv.stride != (1, 1)
