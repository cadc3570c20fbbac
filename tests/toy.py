"""A tiny synthetic multi-domain dataset and model for fast engine tests (no disk, no cache)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from feddg.algorithms import create_method
from feddg.config import ExperimentConfig, build_config
from feddg.data.base import DomainDataset
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.federation.setup import Federation, make_clients, make_split, make_topology
from feddg.messages import Message, weights_of
from feddg.models.base import FedModel


class ToyDomains(DomainDataset):
    """3 domains × 4 classes of 1×6×6 images: class prototypes, per-domain contrast and offset."""

    name = "toy"

    def __init__(self, per_class_domain: int = 30, seed: int = 0) -> None:
        g = np.random.default_rng(seed)
        protos = g.normal(size=(4, 1, 6, 6))
        xs, ys, ds = [], [], []
        for d, (scale, shift) in enumerate([(1.0, 0.0), (0.7, 0.5), (1.3, -0.5)]):
            for k in range(4):
                noise = 1.0 * g.normal(size=(per_class_domain, 1, 6, 6))
                xs.append(scale * protos[k] + shift + noise)
                ys += [k] * per_class_domain
                ds += [d] * per_class_domain
        self.x = torch.tensor(np.concatenate(xs), dtype=torch.float32)
        self.labels = np.array(ys, dtype=np.int64)
        self.domain_ids = np.array(ds, dtype=np.int64)
        self.domains = ["a", "b", "c"]
        self.classes = ["0", "1", "2", "3"]
        self.image_shape = (1, 6, 6)

    def get_batch(self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None):
        idx = torch.as_tensor(indices)
        return self.x[idx], torch.as_tensor(self.labels[indices])


class ToyNet(FedModel):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 36, 16)
        self.feature_dim = 16
        self.classifier = nn.Linear(16, 4)

    def features(self, x: Tensor) -> Tensor:
        return torch.relu(self.fc(torch.relu(self.bn(self.conv(x))).flatten(1)))


class ToyMLPHeadNet(ToyNet):
    """ToyNet with an AlexNet-like MLP head, linear → BatchNorm1d → ReLU → linear (BatchNorm1d cannot train on a
    single sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))


def toy_federation(*overrides: str) -> Federation:
    cfg = build_config(
        {"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
         "federation": {"rounds": 3, "batch_size": 16, "workers": 1}, "optim": {"lr": 0.1}, "device": "cpu"},
        list(overrides),
    )
    return toy_federation_of(cfg)


def toy_federation_of(cfg: ExperimentConfig) -> Federation:
    """The toy federation of a built config."""
    ds = ToyDomains()
    split = make_split(ds, cfg)
    clients = make_clients(ds, split, cfg)
    torch.manual_seed(cfg.seed)
    method = create_method(cfg.method.name, cfg.method.params)
    model = method.prepare_model(ToyNet())
    return Federation(cfg, ds, split, clients, method, model, torch.device("cpu"), make_topology(cfg, clients, model))


class Point(nn.Module):
    """One parameter ``w``; the data only define each client's target (tests on quadratics)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([3.0]))


def quadratic(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """``f_i(w) = ½ (w − a_i)²`` with ``a_i`` the mean pixel of client i's data (one full batch an epoch)."""
    return 0.5 * ((model.w - x.mean()) ** 2).sum()


def run_recording_replies(fed: Federation, run_dir: Path) -> tuple[Server, list[Message]]:
    """Run ``fed`` in-process into ``run_dir``; its server and every client reply, in the order they were made."""
    replies: list[Message] = []
    update = fed.method.client_update

    def client_update(*args: Any) -> Any:
        out = update(*args)
        replies.append(out[0])
        return out

    fed.method.client_update = client_update  # type: ignore[method-assign]
    server = Server(fed, run_dir)
    run_inprocess(server)
    return server, replies


def assert_reply_is_sgd_steps(reply: Message, sent: Message, model: nn.Module, loss: Callable[[], Tensor],
                              lr: float, steps: int) -> None:
    """``reply``'s weights are ``steps`` plain SGD steps ``w ← w − lr ∇loss()`` taken here on ``model`` (a copy of
    the client's model as ``sent``), and those steps moved them."""
    params = list(model.parameters())
    for _ in range(steps):
        grads = torch.autograd.grad(loss(), params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(lr * g)
    assert_reply_weights(reply, weights_of(model), sent)


def assert_reply_weights(reply: Message, want: Message, sent: Message, rtol: float = 1e-4) -> None:
    """``reply`` holds the weights ``want`` (built by hand), which training moved away from ``sent``: a comparison
    that could not tell a wrong objective from no training at all would prove nothing."""
    assert max(float(np.abs(np.asarray(want[k]) - np.asarray(sent[k])).max()) for k in want) > 1e-2  # it moved
    for k in want:
        np.testing.assert_allclose(np.asarray(reply[k]), np.asarray(want[k]), rtol=rtol, atol=1e-6, err_msg=k)
