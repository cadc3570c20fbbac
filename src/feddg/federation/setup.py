"""Everything a federation needs, built once from a validated config.

Both engines (in-process and Flower) start from :func:`build_federation`, so the same config
gives the same clients, data and initial model on either.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from feddg.algorithms import Method, OptimSettings, create_method
from feddg.algorithms.components.local import has_batchnorm
from feddg.config import ExperimentConfig, ExtraEvalConfig
from feddg.data import dataset_info, load_dataset
from feddg.data.base import DomainDataset
from feddg.data.partition import Partition, make_partition
from feddg.data.splits import (
    DomainSplit,
    every_domain_trains,
    holdout_split,
    holdout_split_by_case,
    leave_domains_out,
    leave_two_domains_out,
)
from feddg.federation.topology import Topology, station_topology
from feddg.models import create_model
from feddg.seeds import derived_seed, noise_seed
from feddg.tasks import Task, make_task


@dataclass(frozen=True)
class ClientData:
    """A client's share of the data: indices into the shared dataset, never copies."""

    train_idx: np.ndarray
    holdout_idx: np.ndarray
    domains: tuple[int, ...]


@dataclass(frozen=True)
class ExtraTarget:
    """A further evaluation dataset (``eval.extra``): every sample of it, in the training data's classes."""

    name: str
    dataset: DomainDataset


@dataclass
class Federation:
    cfg: ExperimentConfig
    dataset: DomainDataset
    split: DomainSplit
    clients: list[ClientData]
    method: Method
    model: nn.Module
    device: torch.device
    topology: Topology
    extra: list[ExtraTarget] = field(default_factory=list)
    #: the dataset's task (loss, tallies, metric), made from ``dataset``
    task: Task = field(init=False)
    #: the root of this federation's DP noise streams (``dp_noise``; :func:`~feddg.seeds.noise_seed`): under
    #: ``secret`` drawn afresh for every federation built, so each run, and each Flower node, keys its own
    noise_key: int = field(init=False)

    def __post_init__(self) -> None:
        if self.cfg.federation.batch_size == 1 and has_batchnorm(self.model):
            raise ValueError(f"federation.batch_size=1: model {self.cfg.model.name} has BatchNorm, which cannot train "
                             "on one-sample batches (they are skipped, so no client would train): use 2 or more")
        self.task = task_of(self.dataset).with_metrics(self.cfg.eval.metrics).with_loss(self.cfg.optim.loss)
        self.noise_key = noise_seed(self.cfg.seed, self.cfg.dp_noise)

    @property
    def optim(self) -> OptimSettings:
        o = self.cfg.optim
        return OptimSettings(name=o.name, momentum=o.momentum, weight_decay=o.weight_decay, grad_clip=o.grad_clip, amp=o.amp,
                             channels_last=self.cfg.model.channels_last, augment=tuple(o.augment))


def task_of(dataset: DomainDataset) -> Task:
    """The task of ``dataset``'s targets, for its classes and kind of inputs."""
    return make_task(dataset.task, dataset.num_classes, dataset.inputs)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def worker_device(name: str, index: int) -> str:
    """The device of client worker ``index``: round-robin over the visible GPUs when CUDA is asked for
    (``cuda`` or ``auto`` with a GPU; ``cuda:k`` pins every worker to GPU k), else the CPU."""
    device = resolve_device(name)
    if device.type != "cuda":
        return "cpu"
    return str(device) if device.index is not None else f"cuda:{index % torch.cuda.device_count()}"


def load_extra_target(spec: ExtraEvalConfig, cfg: ExperimentConfig, reference: DomainDataset,
                      where: str | None = None) -> ExtraTarget:
    """Dataset ``spec`` read as the training data is: images at its size and normalised with its statistics (not
    the other dataset's default ones), text with its tokenizer and ``max_length``; checked to have the training
    data's classes (same names, same order) and input shape. A refusal starts with ``where`` (default: the config's
    ``eval.extra <name>``)."""
    where = where or f"eval.extra {spec.name}"
    try:
        if reference.inputs == "tokens":
            inputs = text_options(cfg)  # the training data's tokenizer and length
        elif reference.task == "classification" and reference.mean is not None and reference.std is not None:
            # evaluation never augments; a folder without feddg.json would otherwise get DomainBed's statistics
            stats = {"preset": "none", "mean": list(reference.mean), "std": list(reference.std)}
            inputs = {"image_size": reference.image_shape[1], "transforms": stats}
        else:  # slices are normalised the same way in every dataset (slices.py)
            inputs = {"image_size": reference.image_shape[1], "transforms": cfg.data.transforms}
        ds = load_dataset(spec.dataset, root=spec.root, cache_dir=cfg.data.cache_dir, seed=cfg.data.seed,
                          domains=spec.domains, max_per_domain=spec.max_per_domain, **inputs)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"{where}: {err}") from None
    if ds.classes != reference.classes:
        raise ValueError(f"{where}: {spec.dataset} has classes {ds.classes}, the training data "
                         f"{reference.classes}; an extra target needs the same classes in the same order")
    if ds.image_shape != reference.image_shape:
        raise ValueError(f"{where}: {spec.dataset} has images of shape {ds.image_shape}, the model takes "
                         f"{reference.image_shape}")
    return ExtraTarget(spec.name, ds)


def held_out(dataset: DomainDataset, cfg: ExperimentConfig) -> list[int]:
    """The test domains of ``split``: named (one or several), a seeded fraction of the domains, or the first."""
    s = cfg.split
    if s.target_fraction is not None:
        if s.target is not None:
            raise ValueError("split.target_fraction draws the held-out domains: drop split.target")
        present = [int(d) for d in np.unique(dataset.domain_ids)]
        k = max(1, int(round(s.target_fraction * len(present))))
        if k >= len(present):
            raise ValueError(f"split.target_fraction={s.target_fraction} holds out all {len(present)} domains")
        rng = np.random.default_rng(derived_seed(cfg.seed, 31))
        return sorted(int(d) for d in rng.choice(present, size=k, replace=False))
    names = [s.target] if isinstance(s.target, str) else (s.target or [dataset.domains[0]])
    return [dataset.domain_index(n) for n in names]


def make_split(dataset: DomainDataset, cfg: ExperimentConfig) -> DomainSplit:
    """LODO (one or several held-out domains), LTDO or federated (none held out) split from the config (the LODO
    target defaults to the first domain)."""
    s = cfg.split
    if s.protocol == "federated":
        given = [k for k in ("target", "target_fraction", "val_domain", "few_shot_k") if getattr(s, k)]
        if given:
            raise ValueError(f"split.protocol=federated holds no domain out: drop split.{', split.'.join(given)}")
        return every_domain_trains(dataset.domain_ids)
    targets = held_out(dataset, cfg)
    if (t := dataset.ood_test) is not None and dataset.domain_index(t) not in targets and s.val_domain != t:
        raise ValueError(f"{dataset.name}'s domain {t!r} is its official ood test split and would train: hold it "
                         f"out (split.target: {t}, or split: {{protocol: ltdo, val_domain: val, target: {t}}})")
    if (v := dataset.ood_validation) is not None and dataset.domain_index(v) not in targets and s.val_domain != v:
        raise ValueError(f"{dataset.name}'s domain {v!r} is its official ood validation split and would train: "
                         f"split: {{protocol: ltdo, val_domain: {v}, target: {dataset.domains[targets[0]]}}} "
                         f"reports it as val_*, or name it in split.target")
    if s.protocol == "lodo":
        if s.val_domain is not None:
            raise ValueError("split.val_domain is only used with split.protocol=ltdo")
        return without_few_shot(dataset, leave_domains_out(dataset.domain_ids, targets), cfg)
    if len(targets) != 1:
        raise ValueError("split.protocol=ltdo holds out one test domain: give split.target as one name")
    target = targets[0]
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
    if dataset.cases is not None:
        raise ValueError(f"split.few_shot_k: {dataset.name} keeps a case's slices together, and a shot's neighbouring "
                         "slices would stay in the test set: few-shot needs a dataset without cases")
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


def partition_cases(dataset: DomainDataset, source_idx: np.ndarray, cfg: ExperimentConfig,
                    rng: np.random.Generator) -> Partition:
    """``partition.kind`` over the source samples; where the dataset keeps cases together (a volume's slices, which
    sit in each other's channels), over the cases: one representative slice each is dealt out, and each client gets
    every slice of its cases, so no case is split between clients (one's holdout, another's training data)."""
    p = cfg.partition
    if dataset.cases is None:
        return make_partition(p.kind, source_idx, dataset.domain_ids, dataset.labels, p.num_clients, rng,
                              dataset.groups, **p.params)
    cases = dataset.cases[source_idx]
    _, first = np.unique(cases, return_index=True)
    reps = source_idx[np.sort(first)]
    part = make_partition(p.kind, reps, dataset.domain_ids, dataset.labels, p.num_clients, rng, dataset.groups,
                          **p.params)
    members = [source_idx[np.isin(cases, dataset.cases[idx])] for idx in part.client_indices]
    return Partition([np.sort(m).astype(np.int64) for m in members], part.client_domains)


def make_clients(dataset: DomainDataset, split: DomainSplit, cfg: ExperimentConfig) -> list[ClientData]:
    """Partition the source data over clients, then hold out ``partition.holdout`` of each."""
    p = cfg.partition
    rng = np.random.default_rng(derived_seed(cfg.seed, 17))
    part = partition_cases(dataset, split.source_idx, cfg, rng)
    if p.kind == "natural" and "num_clients" in p.model_fields_set and p.num_clients != part.num_clients:
        raise ValueError(f"partition.kind=natural makes one client per natural group ({part.num_clients} in the "
                         f"source domains here): drop partition.num_clients={p.num_clients}")
    if p.kind == "natural" and cfg.split.few_shot_k:
        raise ValueError("split.few_shot_k deals target samples to partition.num_clients clients; with natural groups "
                         "the clients are the groups: use it with another partition")
    clients = []
    keep_rng = np.random.default_rng(derived_seed(cfg.seed, 37))  # its own stream: holdouts stay as without it
    for idx, doms in zip(part.client_indices, part.client_domains, strict=True):
        if dataset.cases is None:
            train, hold = holdout_split(idx, p.holdout, rng)
        else:
            train, hold = holdout_split_by_case(idx, dataset.cases, p.holdout, rng)
        if p.train_fraction < 1.0:
            keep = max(1, int(round(p.train_fraction * len(train))), min(p.train_min, len(train)))
            train = np.sort(keep_rng.choice(train, size=keep, replace=False))
        clients.append(ClientData(train_idx=train, holdout_idx=hold, domains=tuple(doms)))
    if p.holdout > 0 and not any(len(c.holdout_idx) for c in clients):
        raise ValueError(f"partition.holdout={p.holdout} leaves no client a holdout sample (clients of "
                         f"{max(len(c.train_idx) for c in clients)} sample(s) at most): the id figures would be "
                         "missing; use fewer clients or more data, or partition.holdout=0 to train without id "
                         "evaluation")
    if cfg.split.few_shot_k:  # the k target samples join training only; the id holdout stays source data
        shots = few_shot_samples(dataset, split.test_domains, cfg)
        clients = [replace(c, train_idx=np.sort(np.concatenate([c.train_idx, s])))
                   for c, s in zip(clients, shots, strict=True)]
    return clients


def load_data(cfg: ExperimentConfig) -> DomainDataset:
    """The dataset of ``cfg.data`` (the one call every part of feddg loads training data with)."""
    d = cfg.data
    return load_dataset(
        d.dataset,
        root=d.root,
        cache_dir=d.cache_dir,
        image_size=d.image_size,
        seed=d.seed,
        domains=d.domains,
        max_per_domain=d.max_per_domain,
        transforms=d.transforms,
        loader_workers=d.loader_workers,
        writer_count=d.writers,
        **text_options(cfg),
    )


def text_options(cfg: ExperimentConfig) -> dict[str, Any]:
    """``load_dataset``'s text options for ``cfg``: the tokenizer (``data.tokenizer``, else ``model.path``'s),
    ``max_length`` and ``vocab_size`` for a token dataset; for any other, those changed from their defaults (refused
    there: a config dumped with every field sets them all)."""
    d = cfg.data
    if dataset_info(d.dataset)["inputs"] != "tokens":  # changed from their defaults, they are refused in one line
        return {k: getattr(d, k) for k in ("tokenizer", "max_length", "vocab_size")
                if getattr(d, k) != type(d).model_fields[k].default}
    return {"tokenizer": d.tokenizer or cfg.model.path, "max_length": d.max_length, "vocab_size": d.vocab_size}


def build_federation(cfg: ExperimentConfig) -> Federation:
    """Load data, split, partition, and build the (seeded) initial model and the method."""
    method = create_method(cfg.method.name, cfg.method.params)
    check_topology(method, cfg)
    dataset = load_data(cfg)
    split = make_split(dataset, cfg)
    clients = make_clients(dataset, split, cfg)
    torch.manual_seed(derived_seed(cfg.seed, 23))
    path: dict[str, Any] = {"path": cfg.model.path} if cfg.model.path is not None else {}
    base = create_model(
        cfg.model.name,
        **task_of(dataset).model_head(),
        **dataset.model_args(),
        weights=cfg.model.weights,
        **path,
        **cfg.model.params,
    )
    device = resolve_device(cfg.device)
    model = method.prepare_model(base).to(device)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # missing from torch's stubs
    extra = [load_extra_target(spec, cfg, dataset) for spec in cfg.eval.extra]
    return Federation(cfg, dataset, split, clients, method, model, device, make_topology(cfg, clients, model), extra)


def check_topology(method: Method, cfg: ExperimentConfig) -> None:
    """A hierarchical method needs stations, a merge it is defined with, and clients that pull their station."""
    if not method.station_merges:
        return
    need = f"{method.name} is a hierarchical method: it needs a hierarchy: section with merge " + " or ".join(
        method.station_merges)
    h = cfg.hierarchy
    if h is None:
        raise ValueError(need)
    if h.merge not in method.station_merges:
        raise ValueError(f"{need} (got {h.merge!r})")
    if h.params.get("client_pull", "station") != "station":
        raise ValueError(f"{method.name}'s clients train from their station's model: drop hierarchy.params.client_pull")


def make_topology(cfg: ExperimentConfig, clients: list[ClientData], model: nn.Module) -> Topology:
    """Flat, or the stations of the config's ``hierarchy:`` section around the prepared ``model``."""
    h = cfg.hierarchy
    if h is None:
        return Topology(len(clients))
    return station_topology(h.stations, h.station_rounds, h.station_fraction, h.assignment, h.merge, h.params,
                            [c.domains for c in clients], model)
