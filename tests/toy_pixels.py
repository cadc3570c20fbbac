"""A task that is not classification, for the task seam's tests: a per-pixel label on tiny images (a stand-in for
segmentation), with its dataset and model. :func:`registered` makes them reachable by name, as a plug-in would, so
configs, sweeps and reports reach them as they reach a built-in, and removes them after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddg.config import ExperimentConfig, build_config
from feddg.data.base import DomainDataset
from feddg.data.registry import PLUGINS, Plugin
from feddg.federation.setup import Federation, build_federation
from feddg.models.base import FedModel
from feddg.models.registry import CAPABILITIES, MODELS
from feddg.tasks import DENSE_MASKS, TASKS, Task

NAME = "toy-pixels"


class PixelAgreement(Task):
    """Per-pixel cross-entropy; the metric is the share of pixels labelled right (pooled per domain)."""

    name = "pixel-agreement"
    metric = "pagree"
    label = "pixel agreement"
    targets: ClassVar[frozenset[str]] = frozenset({DENSE_MASKS})

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)

    def tally_zeros(self, num_domains: int) -> np.ndarray:
        return np.zeros((num_domains, 2), dtype=np.int64)

    def tally(self, output: Tensor, target: Tensor, domains: np.ndarray, num_domains: int) -> np.ndarray:
        hit = (output.argmax(1).cpu() == target.cpu()).flatten(1).sum(1).numpy()
        out = self.tally_zeros(num_domains)
        np.add.at(out[:, 0], domains, hit)
        np.add.at(out[:, 1], domains, target[0].numel())
        return out

    def score(self, tally: np.ndarray) -> float:
        return 100.0 * int(tally[0]) / int(tally[1])

    def count(self, tally: np.ndarray) -> int:
        return int(tally[1]) // 36  # images of 6 x 6 pixels

    def chance(self) -> float:
        return 100.0 / self.num_classes


class ToyPixels(DomainDataset):
    """3 domains of 1×6×6 images; each pixel's label is whether a smooth pattern exceeds a domain's threshold."""

    name = NAME
    task = PixelAgreement.name

    def __init__(self, per_domain: int = 40, seed: int = 0) -> None:
        g = np.random.default_rng(seed)
        xs, ys, ds = [], [], []
        for d, shift in enumerate([0.0, 0.4, -0.4]):
            base = g.normal(size=(per_domain, 1, 6, 6))
            xs.append(base + shift)
            ys.append((base[:, 0] > 0).astype(np.int64))
            ds += [d] * per_domain
        self.x = torch.tensor(np.concatenate(xs), dtype=torch.float32)
        self.masks = torch.tensor(np.concatenate(ys))
        self.labels = np.zeros(len(ds), dtype=np.int64)  # no per-sample class
        self.domain_ids = np.array(ds, dtype=np.int64)
        self.domains = ["a", "b", "c"]
        self.classes = ["background", "foreground"]
        self.image_shape = (1, 6, 6)

    def get_batch(self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None
                  ) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(indices)
        return self.x[idx], self.masks[idx]


class PixelNet(FedModel):
    """A 3×3 convolution, then a 1×1 one: one output per class and pixel."""

    def __init__(self, num_classes: int, in_channels: int = 1, image_size: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.feature_dim = 4
        self.classifier = nn.Conv2d(4, num_classes, 1)

    def features(self, x: Tensor) -> Tensor:
        return torch.relu(self.conv(x))


def load(**kwargs: Any) -> ToyPixels:
    return ToyPixels(seed=kwargs.get("seed", 0))


def _refuse(**kwargs: Any) -> DomainDataset:
    raise AssertionError("toy-tokens is only ever validated: no data may load")


def register() -> None:
    """Make the dataset, its task and its model reachable by name; ``toy-tokens`` is a classification dataset with
    token inputs that is never loaded (configs against it are only validated)."""
    TASKS[PixelAgreement.name] = PixelAgreement
    PLUGINS[NAME] = Plugin(load, domains=["a", "b", "c"], classes=["background", "foreground"],
                           task=PixelAgreement.name)
    PLUGINS["toy-tokens"] = Plugin(_refuse, domains=["a", "b"], classes=["neg", "pos"], task="classification",
                                   inputs="tokens")
    MODELS["pixelnet"] = PixelNet
    CAPABILITIES["pixelnet"] = frozenset({"dense_masks"})  # one class score per pixel


@contextmanager
def registered() -> Iterator[None]:
    """The pixel task registered for the block, and gone after (other tests see the built-ins only)."""
    register()
    try:
        yield
    finally:
        del TASKS[PixelAgreement.name], PLUGINS[NAME], PLUGINS["toy-tokens"], MODELS["pixelnet"]
        del CAPABILITIES["pixelnet"]


class PixelFederation:
    """The federation factory of the pixel task. Unpickled in a Flower ClientApp process (a Ray actor), it
    registers the task there first, so the node can validate the config it is sent."""

    def __call__(self, cfg: ExperimentConfig) -> Federation:
        return build_federation(cfg)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_factory_in_a_node, ())


def _factory_in_a_node() -> PixelFederation:
    register()
    return PixelFederation()


pixel_federation = PixelFederation()

#: a small federation of the pixel task (4 clients over domains a, b; c held out)
PIXELS = {"data": {"dataset": NAME}, "model": {"name": "pixelnet"}, "split": {"target": "c"},
          "partition": {"kind": "by_domain", "num_clients": 4}, "optim": {"lr": 0.5},
          "federation": {"rounds": 3, "batch_size": 16, "workers": 1}, "device": "cpu", "name": "pixels"}


def needs_masks(method: str) -> bool:
    """Whether ``method`` needs dense masks (it then runs on the pixel task, not the toy classification)."""
    from feddg.algorithms.registry import method_class

    return DENSE_MASKS in method_class(method).requires


def pixel_config(*overrides: str) -> ExperimentConfig:
    return build_config(PIXELS, list(overrides))
