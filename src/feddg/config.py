"""Experiment configuration: YAML validated with pydantic, overridable key by key.

Unknown keys and wrong types fail with the dotted name of the key, e.g.
``federation.rounds: Input should be a valid integer``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(Strict):
    dataset: str = "digits-dg"
    root: str | None = Field(None, description="folder of a real dataset (root/<domain>/<class>/<image>)")
    cache_dir: str | None = None
    image_size: int | None = None
    domains: list[str] | None = Field(None, description="use only these domains")
    max_per_domain: int | None = Field(None, ge=1)
    seed: int = Field(0, description="seed of the built-in datasets' synthesis (fixed across experiment seeds)")


class SplitConfig(Strict):
    protocol: Literal["lodo", "ltdo"] = "lodo"
    target: str | None = Field(None, description="held-out test domain (default: the first domain)")
    val_domain: str | None = Field(None, description="ood validation domain (ltdo only)")
    few_shot_k: int = Field(
        0, ge=0, description="few-shot mode (hFedF Fig. 3): k target-domain samples added to every client's "
        "training data, distinct per client and removed from the ood test set"
    )


class PartitionConfig(Strict):
    kind: str = "by_domain"
    num_clients: int = Field(4, ge=1)
    params: dict[str, Any] = Field(default_factory=dict, description="partitioner parameters (lam, d, alpha)")
    holdout: float = Field(0.1, ge=0.0, lt=1.0, description="per-client id-validation fraction")


class ModelConfig(Strict):
    name: str = "cnn"
    weights: str | None = Field(None, description="local .pth state_dict to start from")
    params: dict[str, Any] = Field(default_factory=dict)


class MethodConfig(Strict):
    name: str = "fedavg"
    params: dict[str, Any] = Field(default_factory=dict)


class OptimConfig(Strict):
    name: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(5e-4, ge=0)
    schedule: Literal["constant", "cosine", "step"] = "constant"
    step_size: int = Field(10, ge=1, description="rounds between decays (step schedule)")
    gamma: float = Field(0.1, gt=0, description="decay factor (step schedule)")


class FederationConfig(Strict):
    engine: Literal["inprocess", "flower"] = "inprocess"
    rounds: int = Field(10, ge=1)
    client_fraction: float = Field(1.0, gt=0, le=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    workers: int | Literal["auto"] = Field(
        1, description="in-process engine: warm client worker processes (1 = sequential; auto = one per core)"
    )
    checkpoint_every: int = Field(
        1, ge=1, description="write checkpoint.pt every k rounds and after the last (a crash loses < k rounds); "
        "k > 1 saves disk time when the server state is large (hFedF's hypernetwork and Adam state)"
    )


class HierarchyConfig(Strict):
    """Clients -> stations -> server (HFedATM); absent means a flat federation."""

    stations: int = Field(2, ge=1)
    station_rounds: int = Field(1, ge=1, description="N: station rounds per server round")
    merge: Literal["avg", "hfedatm", "hfedatm-no-fot", "hfedatm-no-regmean"] = Field(
        "avg", description="station -> server merge: avg | hfedatm | hfedatm-no-fot | hfedatm-no-regmean"
    )
    assignment: Literal["contiguous", "domain", "round_robin", "dirichlet"] = Field(
        "contiguous",
        description="clients -> stations: contiguous ids | domain (sorted by assigned domain) | round_robin | "
        "dirichlet (two-level partition with alpha_station, alpha_client; replaces partition.kind)",
    )
    station_fraction: float = Field(1.0, gt=0, le=1, description="stations sampled per server round")
    alpha_station: float = Field(1.0, gt=0, description="assignment=dirichlet: Dir(α) shares of a domain over stations")
    alpha_client: float = Field(1.0, gt=0, description="assignment=dirichlet: Dir(α) shares over a station's clients")
    params: dict[str, Any] = Field(
        default_factory=dict, description="merge parameters (feddg.algorithms.hierarchy.MergeParams: lambda_ot, "
        "sinkhorn_iters, solver, alpha, gram_pass, client_pull, dp_epsilon, dp_delta, dp_clip, dp_mechanism)"
    )


class FlowerConfig(Strict):
    """Settings of the Flower engine (``federation.engine: flower``); see docs/flower.md."""

    client_num_cpus: float = Field(1.0, gt=0, description="simulation: CPUs reserved per ClientApp (Ray actor)")
    client_num_gpus: float = Field(0.0, ge=0, description="simulation: GPUs (fraction) per ClientApp")
    ray_num_cpus: int | None = Field(None, ge=1, description="simulation: CPUs Ray may use (default: all)")
    round_timeout_s: float = Field(3600.0, gt=0, description="seconds to wait for the replies of one round")
    node_wait_s: float = Field(120.0, gt=0, description="seconds to wait for every SuperNode partition to connect")


class EvalConfig(Strict):
    every: int = Field(1, ge=1, description="evaluate every k rounds (and always after the last)")
    batch_size: int = Field(256, ge=1)


class ExperimentConfig(Strict):
    name: str = "experiment"
    seed: int = 0
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda[:k]'")
    output_dir: str = "runs"
    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    method: MethodConfig = MethodConfig()
    optim: OptimConfig = OptimConfig()
    federation: FederationConfig = FederationConfig()
    hierarchy: HierarchyConfig | None = None
    eval: EvalConfig = EvalConfig()
    flower: FlowerConfig = FlowerConfig()

    @model_validator(mode="after")
    def _method_params_known(self) -> ExperimentConfig:
        from feddg.algorithms.registry import method_class  # lazy: config is the top layer

        cls = method_class(self.method.name)
        try:
            cls.Params(**self.method.params)
        except ValidationError as err:
            raise ValueError(format_errors(err, prefix="method.params")) from None
        return self

    @model_validator(mode="after")
    def _hierarchy_fits(self) -> ExperimentConfig:
        h = self.hierarchy
        if h is None:
            return self
        from feddg.algorithms.hierarchy import MergeParams  # lazy, like the method registry

        try:
            MergeParams(**h.params)
        except ValidationError as err:
            raise ValueError(format_errors(err, prefix="hierarchy.params")) from None
        if self.partition.num_clients < h.stations:
            raise ValueError(f"hierarchy.stations: {h.stations} stations need partition.num_clients >= {h.stations}")
        if h.assignment == "dirichlet" and self.partition.num_clients % h.stations:
            raise ValueError("hierarchy.assignment=dirichlet: partition.num_clients must be a multiple of hierarchy.stations")
        return self


class ConfigError(ValueError):
    """A configuration problem, with the dotted key in the message."""


def format_errors(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        loc = f"{prefix}.{loc}" if prefix and loc else prefix or loc
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_dotted(d, "a.b.c", v)`` sets ``d["a"]["b"]["c"] = v``, creating dicts on the way."""
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p!r} is not a section")
        node = child
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["federation.rounds=5", "method.name=fedprox"]`` -> typed (key, value) pairs (YAML scalars)."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        pairs.append((key.strip(), yaml.safe_load(raw)))
    return pairs


def build_config(raw: dict[str, Any], overrides: list[str] | None = None) -> ExperimentConfig:
    """Validate ``raw`` after applying ``overrides``; errors name the key."""
    tree = copy.deepcopy(raw)  # overrides must not leak into ``raw`` (a sweep reuses it per variant)
    for key, value in parse_overrides(overrides or []):
        set_dotted(tree, key, value)
    try:
        return ExperimentConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_errors(err)) from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys")
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """An experiment config; a sweep file's ``sweep:`` section is ignored (its base config runs)."""
    raw = read_yaml(path)
    raw.pop("sweep", None)
    return build_config(raw, overrides)


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
