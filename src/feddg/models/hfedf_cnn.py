"""The hFedF client model: the Inception-style CNN of Bartholet et al., "Hypernetwork-Driven Model
Fusion for Federated Domain Generalization", Appendix C.7, Table 9.

Table 9, for a 3×32×32 input (the shapes in brackets are the table's output shapes):

=================  ===============  =============================  ==========
Layer              Output shape     Configuration                  Activation
=================  ===============  =============================  ==========
Convolutional      [32, 32, 32]     k=3, s=1, p=1                  -
MaxPool            [32, 16, 16]     k=2, s=2, p=0                  ReLU
Convolutional      [32, 16, 16]     k=1, s=1, p=0                  -
Convolutional      [64, 16, 16]     k=3, s=1, p=1                  -
MaxPool            [64, 8, 8]       k=2, s=2, p=0                  ReLU
Inception module   [176, 8, 8]      int. channels = [32, 64, 16]   ReLU
Inception module   [288, 8, 8]      int. channels = [32, 64, 16]   ReLU
AdaptiveAvgPool    [288, 3, 3]      output size = 3                -
Flatten            [2592]
Dropout            [2592]           ratio = 0.2                    -
Linear             [256]                                           -
Linear             [n_classes]                                     -
=================  ===============  =============================  ==========

How the table's ambiguities are settled:

* **Inception module.** The table gives only "int. channels = [32, 64, 16]" and the output widths
  176 = 64 + 112 and 288 = 176 + 112, with 112 = 32 + 64 + 16. The only reading that fits both
  modules is the *naïve* Inception module of Szegedy et al. (2015, Fig. 2a), which the paper cites:
  parallel 1×1 (32), 3×3 (64) and 5×5 (16) convolutions on the module input, concatenated with a
  3×3/stride-1 max-pool of the input that keeps its channels. The dimension-reduced variant
  (Fig. 2b) would project the pooled branch and so could not reach 176 and 288.
* **Where the ReLU goes.** The activation column puts one ReLU on each module; it is applied to the
  concatenation. That equals a ReLU on every branch, because the pooled branch's input is already
  non-negative (it follows a ReLU).
* **Activations left out by the table** are left out here too: none between the 1×1 and the 3×3
  convolution (both linear, between the two pooling stages) and none between the two final Linear
  layers. A ReLU listed after a MaxPool is applied after it (the two commute).
* **Bias and normalisation.** The table lists no normalisation, so there is none; every convolution
  and Linear layer has a bias (PyTorch's default). Having no BatchNorm buffers, all of the model's
  state is parameters, which a hypernetwork can generate.
* **Feature split.** ``features`` runs up to and including the 256-d Linear (so dropout is part of
  it); ``classifier`` is the last Linear. ``feature_dim`` is 256.
* **Other inputs.** The adaptive pool makes 28 px inputs work too (8×8 becomes 7×7 before it);
  ``in_channels`` sets the first convolution's input width.

With 3 input channels the model has 926,400 + 257·n_classes parameters (928,199 for PACS' 7 classes).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from feddg.models.base import FedModel

INCEPTION_CHANNELS: tuple[int, int, int] = (32, 64, 16)


class NaiveInception(nn.Module):
    """Naïve Inception module (Szegedy et al., 2015, Fig. 2a) with a ReLU on the concatenation.

    Output channels: ``in_channels + sum(channels)``.
    """

    def __init__(self, in_channels: int, channels: tuple[int, int, int] = INCEPTION_CHANNELS) -> None:
        super().__init__()
        c1, c3, c5 = channels
        self.branch1 = nn.Conv2d(in_channels, c1, kernel_size=1)
        self.branch3 = nn.Conv2d(in_channels, c3, kernel_size=3, padding=1)
        self.branch5 = nn.Conv2d(in_channels, c5, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(kernel_size=3, stride=1, padding=1)
        self.out_channels = in_channels + c1 + c3 + c5

    def forward(self, x: Tensor) -> Tensor:
        branches = [self.branch1(x), self.branch3(x), self.branch5(x), self.pool(x)]
        return torch.relu(torch.cat(branches, dim=1))


class HFedFCNN(FedModel):
    """The hFedF client CNN (Table 9 of the hFedF paper); see the module docstring."""

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 28) -> None:
        super().__init__()
        del image_size  # the adaptive pool makes the network size-agnostic
        inception1 = NaiveInception(64)
        inception2 = NaiveInception(inception1.out_channels)
        self.trunk = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3, stride=1, padding=1),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, kernel_size=1),
            nn.Conv2d(32, 64, kernel_size=3, stride=1, padding=1),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.ReLU(inplace=True),
            inception1,
            inception2,
            nn.AdaptiveAvgPool2d(3),
            nn.Flatten(),
            nn.Dropout(0.2),
            nn.Linear(inception2.out_channels * 3 * 3, 256),
        )
        self.feature_dim = 256
        self.classifier = nn.Linear(256, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.trunk(x)
