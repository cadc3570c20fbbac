"""Everything a federation needs, built once from a validated config.

Both engines (in-process and Flower) start from :func:`build_federation`, so the same config
gives the same clients, data and initial model on either.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from feddg.algorithms import Method, OptimSettings, create_method
from feddg.algorithms.hierarchy import build_hierarchy
from feddg.algorithms.stations import two_level_dirichlet
from feddg.config import ExperimentConfig
from feddg.data import load_dataset
from feddg.data.base import DomainDataset
from feddg.data.partition import make_partition
from feddg.data.splits import DomainSplit, holdout_split, leave_one_domain_out, leave_two_domains_out
from feddg.federation.rounds import derived_seed
from feddg.models import create_model


@dataclass(frozen=True)
class ClientData:
    """A client's share of the data: indices into the shared dataset, never copies."""

    train_idx: np.ndarray
    holdout_idx: np.ndarray
    domains: tuple[int, ...]


@dataclass
class Federation:
    cfg: ExperimentConfig
    dataset: DomainDataset
    split: DomainSplit
    clients: list[ClientData]
    method: Method
    model: nn.Module
    device: torch.device

    @property
    def optim(self) -> OptimSettings:
        o = self.cfg.optim
        return OptimSettings(name=o.name, momentum=o.momentum, weight_decay=o.weight_decay)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_split(dataset: DomainDataset, cfg: ExperimentConfig) -> DomainSplit:
    """LODO or LTDO split from the config (target defaults to the first domain)."""
    s = cfg.split
    target = dataset.domain_index(s.target) if s.target is not None else 0
    if s.protocol == "lodo":
        if s.val_domain is not None:
            raise ValueError("split.val_domain is only used with split.protocol=ltdo")
        return without_few_shot(dataset, leave_one_domain_out(dataset.domain_ids, target), cfg)
    if s.val_domain is None:
        raise ValueError("split.protocol=ltdo needs split.val_domain")
    val = dataset.domain_index(s.val_domain)
    if val == target:
        raise ValueError("split.val_domain must differ from split.target")
    return without_few_shot(dataset, leave_two_domains_out(dataset.domain_ids, val, target), cfg)


def few_shot_samples(dataset: DomainDataset, test_domains: list[int], cfg: ExperimentConfig) -> list[np.ndarray]:
    """Few-shot mode (hFedF §5.2, Fig. 3): per client, ``split.few_shot_k`` distinct target-domain
    samples, drawn without replacement from the test domain(s) with a seed of their own."""
    k, n = cfg.split.few_shot_k, cfg.partition.num_clients
    target = np.flatnonzero(np.isin(dataset.domain_ids, test_domains)).astype(np.int64)
    if n * k > len(target):
        raise ValueError(f"split.few_shot_k={k} for {n} clients needs {n * k} target samples, there are {len(target)}")
    chosen = np.random.default_rng(derived_seed(cfg.seed, 29)).choice(target, size=n * k, replace=False)
    return [np.sort(part) for part in np.split(chosen, n)]


def without_few_shot(dataset: DomainDataset, split: DomainSplit, cfg: ExperimentConfig) -> DomainSplit:
    """``split`` with the few-shot samples (given to the clients) removed from the ood test set."""
    if cfg.split.few_shot_k == 0:
        return split
    shots = np.concatenate(few_shot_samples(dataset, split.test_domains, cfg))
    return replace(split, test_idx=np.setdiff1d(split.test_idx, shots).astype(np.int64))


def make_clients(dataset: DomainDataset, split: DomainSplit, cfg: ExperimentConfig) -> list[ClientData]:
    """Partition the source data over clients, then hold out ``partition.holdout`` of each."""
    p = cfg.partition
    rng = np.random.default_rng(derived_seed(cfg.seed, 17))
    h = cfg.hierarchy
    if h is not None and h.assignment == "dirichlet":  # two-level partition: domains -> stations -> clients
        part = two_level_dirichlet(
            split.source_idx, dataset.domain_ids, p.num_clients, h.stations, h.alpha_station, h.alpha_client, rng
        )
    else:
        part = make_partition(
            p.kind, split.source_idx, dataset.domain_ids, dataset.labels, p.num_clients, rng, **p.params
        )
    clients = []
    for idx, doms in zip(part.client_indices, part.client_domains, strict=True):
        train, hold = holdout_split(idx, p.holdout, rng)
        clients.append(ClientData(train_idx=train, holdout_idx=hold, domains=tuple(doms)))
    if cfg.split.few_shot_k:  # the k target samples join training only; the id holdout stays source data
        shots = few_shot_samples(dataset, split.test_domains, cfg)
        clients = [replace(c, train_idx=np.sort(np.concatenate([c.train_idx, s])))
                   for c, s in zip(clients, shots, strict=True)]
    return clients


def build_federation(cfg: ExperimentConfig) -> Federation:
    """Load data, split, partition, and build the (seeded) initial model and the method."""
    d = cfg.data
    dataset = load_dataset(
        d.dataset,
        root=d.root,
        cache_dir=d.cache_dir,
        image_size=d.image_size,
        seed=d.seed,
        domains=d.domains,
        max_per_domain=d.max_per_domain,
    )
    split = make_split(dataset, cfg)
    clients = make_clients(dataset, split, cfg)
    method = create_method(cfg.method.name, cfg.method.params)
    if cfg.hierarchy is not None:  # clients -> stations -> server around the client method
        method = build_hierarchy(method, cfg.hierarchy, [c.domains for c in clients])
    torch.manual_seed(derived_seed(cfg.seed, 23))
    c, h, _ = dataset.image_shape
    base = create_model(
        cfg.model.name,
        num_classes=dataset.num_classes,
        in_channels=c,
        image_size=h,
        weights=cfg.model.weights,
        **cfg.model.params,
    )
    device = resolve_device(cfg.device)
    model = method.prepare_model(base).to(device)
    return Federation(cfg, dataset, split, clients, method, model, device)
