"""Experiment configuration: YAML validated with pydantic, overridable key by key.

Unknown keys and wrong types fail with the dotted name of the key, e.g.
``federation.rounds: Input should be a valid integer``.

The validators that need the lower layers (a method's ``Params``, the dataset's task, the model's capabilities)
import them inside the function: they import torch, and ``import feddg.cli`` (which imports this module) must not,
so that ``feddg --help`` and a warm ``feddg methods`` stay fast.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator, field_validator, model_validator

from feddg.settings import Settings, meant_keys


def domain_names(value: Any) -> Any:
    """Domain names written as whole numbers as the names they spell: rotated-mnist's domains are ``"0"``, ``"15"``,
    ..., and YAML reads ``-o split.target=15`` as an integer (lists, and lists of pairs, item by item)."""
    if isinstance(value, list | tuple):
        return [domain_names(v) for v in value]
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def one_error(expected: str) -> WrapValidator:
    """A union field's refusal in one phrase, ``expected <expected>, got <value>``, instead of pydantic's error for
    each branch of the union (``workers.constrained-int: ...; workers.literal['auto']: ...``)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"expected {expected}, got {value!r}") from None

    return WrapValidator(check)


#: a count of processes or threads, or ``auto``
CountOrAuto = Annotated[Annotated[int, Field(ge=1)] | Literal["auto"], one_error("a whole number >= 1 or auto")]


class DataConfig(Settings):
    dataset: str = "digits-dg"
    root: str | None = Field(None, description="folder of a real dataset (root/<domain>/<class>/<image>)")
    cache_dir: str | None = None
    image_size: int | None = None
    domains: list[str] | None = Field(None, description="use only these domains")
    numbered_domains = field_validator("domains", mode="before")(domain_names)
    max_per_domain: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0, description="seed of the built-in datasets' synthesis (fixed across experiment seeds)")
    transforms: Any = Field(  # a preset name or a mapping; checked by _transforms_valid with one clear line
        None, description="training augmentation and normalisation: a preset (none | digits | domainbed) or a "
        "mapping of preset, crop_scale, crop_ratio, flip, jitter, grayscale, pad_crop, mean, std (docs/data.md); "
        "default: the dataset's own (no augmentation for the built-ins, DomainBed's for folder presets); segmentation "
        "slices: hflip (default) or rot90_flip (the papers' code's)"
    )
    loader_workers: int = Field(
        0, ge=0, description="DataLoader processes building training batches (0 = in the client's process); "
        "memory is pinned when CUDA is available; batches are the same for any value"
    )
    tokenizer: str | None = Field(
        None, description="text datasets: a local Hugging Face tokenizer directory (default: model.path's tokenizer, "
        "else a byte-level BPE of data.vocab_size trained on every domain's texts)")
    max_length: int = Field(128, ge=8, description="text datasets: tokens per text (longer ones are truncated)")
    vocab_size: int = Field(4000, ge=261, description="text datasets: the size of the BPE trained when no tokenizer "
                            "is given")
    writers: int | None = Field(None, ge=1, description="the built-in writers dataset: how many synthetic writers "
                                "(default 3,400, FEMNIST's count in FedScale); other datasets refuse it")

    @model_validator(mode="after")
    def _transforms_valid(self) -> DataConfig:
        from feddg.data.transform_spec import SLICE_AUGMENTS, parse_transforms  # lazy: the CLI imports this without torch

        if not (isinstance(self.transforms, str) and self.transforms in SLICE_AUGMENTS):  # the loader checks those
            parse_transforms(self.transforms)
        return self


class SplitConfig(Settings):
    protocol: Literal["lodo", "ltdo", "federated"] = Field(
        "lodo", description="lodo: hold out split.target; ltdo: an ood validation and a test domain; federated: "
        "every domain trains, figures are each client's own holdout (id) only (FedFA Tables 3-5)")
    target: Annotated[str | list[str] | None, one_error("a domain name or a list of names")] = Field(
        None, description="held-out test domain, or several (lodo; default: the first domain)")
    target_fraction: float | None = Field(
        None, gt=0, lt=1, description="lodo over many domains: hold out this fraction of the domains (at least one; "
        "whole domains, a seeded draw) instead of split.target"
    )
    val_domain: str | None = Field(None, description="ood validation domain (ltdo only)")
    numbered_domains = field_validator("target", "val_domain", mode="before")(domain_names)
    few_shot_k: int = Field(
        0, ge=0, description="few-shot mode (hFedF Fig. 3): k target-domain samples added to every client's "
        "training data, distinct per client and removed from the ood test set"
    )


class PartitionConfig(Settings):
    kind: str = Field("by_domain", description="how source samples are dealt to clients (docs/partitions.md); "
                      "natural: each natural group of the dataset (a writer, a camera) is one client")
    num_clients: int = Field(4, ge=1, description="clients (natural: decided by the groups; leave it unset)")
    params: dict[str, Any] = Field(default_factory=dict, description="partitioner parameters (lam, d, alpha)")
    holdout: float = Field(0.1, ge=0.0, lt=1.0, description="per-client id-validation fraction (of whole cases where "
                           "the dataset has cases: a volume's slices)")
    train_fraction: float = Field(1.0, gt=0.0, le=1.0, description="keep this seeded fraction of each client's "
                                  "training samples (at least one): FedFA's mini-ProstateMRI (1/6) and Fig. 3")
    train_min: int = Field(0, ge=0, description="with train_fraction: keep at least this many training samples "
                           "per client (all it has if fewer); FedFA's mini-ProstateMRI keeps max(N/6, 32)")

    @model_validator(mode="after")
    def _known_partitioner(self) -> PartitionConfig:
        """The kind and its parameters, checked before any data loads (a sweep's later cell refused up front)."""
        from feddg.data.partition import check_partition  # lazy: the CLI imports this without torch

        check_partition(self.kind, self.params)
        return self


class ModelConfig(Settings):
    name: str = "cnn"
    weights: str | None = Field(None, description="local .pth state_dict to start from")
    path: str | None = Field(None, description="a local Hugging Face model directory (config.json, model.safetensors, "
                             "tokenizer files) for model transformer, or a Swin directory for swin_t; never downloaded")
    params: dict[str, Any] = Field(default_factory=dict)
    channels_last: bool = Field(
        False, description="torch.channels_last memory format for the model's 4-d weights and the image batches "
        "(faster convolutions on GPUs with tensor cores; no effect on results beyond rounding)"
    )


class MethodConfig(Settings):
    name: str = "fedavg"
    params: dict[str, Any] = Field(default_factory=dict)


class OptimConfig(Settings):
    name: Literal["sgd", "adam", "adamw"] = Field(
        "sgd", description="sgd | adam (L2 weight decay) | adamw (decoupled weight decay; HFedATM's Amazon Reviews)")
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum; for adam / adamw their β1")
    weight_decay: float = Field(5e-4, ge=0)
    schedule: Literal["constant", "cosine", "step"] = "constant"
    loss: str = Field("task", description="the training loss: task (the task's own) or another the task offers "
                      "(segmentation: ce_dice_all, HarmoFL's and FedFA's code's (CE + soft Dice over every class, "
                      "background included) / 2)")
    warmup_rounds: int = Field(0, ge=0, description="linear warm-up: round r ≤ k trains at lr·r/(k+1); the schedule "
                               "then runs over the remaining rounds")
    grad_clip: float | None = Field(None, gt=0, description="clip each local step's gradient to this global L2 norm")
    step_size: int = Field(10, ge=1, description="rounds between decays (step schedule)")
    gamma: float = Field(0.1, gt=0, description="decay factor (step schedule)")
    amp: Literal["off", "bf16", "fp16"] = Field(
        "off", description="mixed precision: torch.autocast with this dtype in the local training loop and in "
        "evaluation (weights stay float32; fp16 scales the loss); off = float32 throughout"
    )
    augment: list[dict[str, Any]] = Field(
        default_factory=list, description="local augmentations of every client loop, e.g. [{name: mixup, alpha: 0.2}]: "
        "mixup (alpha) | manifold_mixup (alpha, stages) | mixstyle (alpha, p, stages) | moex (lam, p, stage); "
        "docs/methods/augmentation.md"
    )

    @field_validator("augment")
    @classmethod
    def _augment_valid(cls, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from feddg.algorithms.components.augment import parse_augment  # lazy: it imports torch

        return [s.model_dump() for s in parse_augment(items)]


class FederationConfig(Settings):
    engine: Literal["inprocess", "flower"] = "inprocess"
    rounds: int = Field(10, ge=1)
    client_fraction: float = Field(1.0, gt=0, le=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    workers: CountOrAuto = Field(
        "auto", description="in-process engine: warm client worker processes, one torch thread each (auto = one "
        "per core on the CPU, one per GPU on CUDA, at most one per client, sequential with one thread where that "
        "is one; the same bits for any N >= 2, auto and 1 at federation.threads auto); 1 = sequential in the "
        "server process"
    )
    threads: CountOrAuto = Field(
        "auto", description="CPU: torch and BLAS threads of the server process (its evaluation, and the clients "
        "where they run sequentially) and of a Flower SuperNode's clients (its --node-config threads=N overrides); "
        "workers always use one. auto = 1: a process never waits on OpenMP threads that another "
        "process keeps off their core (under load they spin: 10x slower measured), and every worker count gives the "
        "same bits. N > 1 uses N threads where N cores are free (float summation order then differs)"
    )
    checkpoint_every: int = Field(
        1, ge=1, description="write checkpoint.pt every k rounds and after the last (a crash loses < k rounds); "
        "k > 1 saves disk time when the server state is large (hFedF's hypernetwork and Adam state)"
    )
    min_clients: int = Field(
        1, ge=1, description="a round completes when at least this many sampled clients replied usably (failed "
        "clients are dropped and logged); otherwise the run stops, its last checkpoint intact"
    )
    client_timeout_s: float | None = Field(
        None, gt=0, description="in-process engine: drop a client update that runs longer (its worker process is "
        "replaced); needs workers >= 2 or auto (the sequential path cannot interrupt a client). On Flower: "
        "flower.round_timeout_s"
    )
    reject_outliers: float | None = Field(
        None, gt=1, description="drop a reply whose update norm |w_k - w_sent| exceeds this factor x the round's "
        "median; holds the round's replies until it ends (O(clients x model) memory)"
    )
    update_norm_factor: float | None = Field(
        10.0, gt=1, description="drop a reply whose update norm |w_k - w_sent| exceeds this factor x the median of "
        "the previous round's accepted norms (round 1: x |w_sent|); streams (O(model) memory); null: off"
    )
    rollback_loss_factor: float | None = Field(
        None, gt=1, description="roll a round back (previous model kept, not checkpointed) when the new global "
        "model's mean task loss on the clients' holdouts exceeds this factor x the lowest such loss of an applied "
        "round; one extra evaluation pass per round; null: off (a non-finite aggregate is always rolled back)"
    )
    max_reply_mb: float | None = Field(
        None, gt=0, description="in-process worker pool: a client's reply (with its new client state) longer than "
        "this is refused before it is read; null: 4 x (model + message sent + client state) + 64 MiB"
    )
    aggregation: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = Field(
        "mean", description="how the w/ arrays of a round's replies are combined (methods that average weights): "
        "the num_examples-weighted mean (streams), or a robust rule that holds the round's replies "
        "(O(clients x model) memory): coordinate-wise median, trimmed_mean (trim_fraction cut at each end), "
        "krum (the one reply closest to its neighbours), multi_krum (the mean of the krum_keep best)"
    )
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="aggregation: trimmed_mean: the share cut at each end")
    krum_malicious: int = Field(1, ge=0, description="aggregation: krum, multi_krum: f, the attackers tolerated")
    krum_keep: int = Field(0, ge=0, description="aggregation: multi_krum: replies averaged (0: clients - f)")
    client_state_budget_mb: float | None = Field(
        1024.0, ge=0, description="RAM for per-client state on the server (client states, Local-only/hFedF/pFedHN "
        "per-client models and buffers, FedFA statistics); past it the least recently used entries are spilled to "
        "<run>/client_store/ and memory-mapped back, with identical results. 0: all on disk; null: unlimited"
    )

    @model_validator(mode="after")
    def _timeout_needs_workers(self) -> FederationConfig:
        if self.client_timeout_s is None:
            return self
        if self.engine == "flower":
            raise ValueError("client_timeout_s is for the in-process engine; Flower drops the replies that have "
                             "not arrived within flower.round_timeout_s: set that instead")
        if isinstance(self.workers, int) and self.workers <= 1:
            raise ValueError("client_timeout_s needs workers >= 2 (or auto): the sequential path (workers: 1) "
                             "cannot interrupt a client")
        return self


class HierarchyConfig(Settings):
    """A station topology, clients -> stations -> server (HFedATM); absent means a flat federation."""

    stations: int = Field(2, ge=1)
    station_rounds: int = Field(1, ge=1, description="N: station rounds per server round")
    merge: str = Field(
        "avg", description="station -> server merge, by name (feddg.aggregation.merges.MERGES): avg | hfedatm | "
        "hfedatm-no-fot | hfedatm-no-regmean"
    )
    assignment: Literal["contiguous", "domain", "round_robin"] = Field(
        "contiguous",
        description="clients -> stations: contiguous ids | domain (sorted by assigned domain) | round_robin; "
        "partition.kind=two_level_dirichlet (per-domain station shares, then client shares) needs contiguous",
    )
    station_fraction: float = Field(1.0, gt=0, le=1, description="stations sampled per server round")
    params: dict[str, Any] = Field(
        default_factory=dict, description="client_pull for every merge; the hfedatm merges also use the rest of "
        "feddg.aggregation.merges.HFedATMParams (lambda_ot, "
        "sinkhorn_iters, solver, alpha, gram_pass, client_pull, dp_epsilon, dp_delta, dp_clip, dp_mechanism)"
    )

    @field_validator("merge")
    @classmethod
    def _merge_registered(cls, name: str) -> str:
        from feddg.aggregation.merges import MERGES

        if name not in MERGES:
            raise ValueError(f"unknown station merge {name!r}; available: {', '.join(sorted(MERGES))}")
        return name


class SecAggPlusConfig(Settings):
    """Flower's SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow``; docs/flower.md, "Secure aggregation")."""

    num_shares: int | float = Field(1.0, gt=0, description="key shares per client: an int > 2, or a fraction of "
                                    "the round's clients (1.0: all)")
    reconstruction_threshold: int | float = Field(0.7, gt=0, description="shares needed to rebuild a key: an int "
                                                  "< num_shares, or a fraction of num_shares")
    clipping_range: float = Field(8.0, gt=0, description="each weight x (num_examples / max_weight) is clipped to "
                                  "[-c, c] before quantisation")
    quantization_range: int = Field(2**22, gt=1, description="integer levels over [-c, c]")
    modulus_range: int = Field(2**32, gt=1, description="the masks' modulus, a power of 2 above quantization_range")
    max_weight: float | None = Field(None, gt=0, description="the largest num_examples (default: the largest "
                                     "client's training examples, which the server knows)")


#: ``flower.roster`` outside a deployment: ``feddg run`` (in-process or Flower's simulation) and sweeps have no nodes
ROSTER_NEEDS_DEPLOYMENT = ("flower.roster is for deployments (feddg flower run: its nodes prove their keys); the "
                           "simulation and the in-process engine have no keys")
#: ``flower.secure_aggregation`` where the in-process engine would run (``feddg run``, sweeps): it has no SecAgg+
SECAGG_NEEDS_FLOWER = ("flower.secure_aggregation=secaggplus runs on Flower only: add -o federation.engine=flower "
                       "(simulation) or submit it with feddg flower run (deployment)")


class FlowerConfig(Settings):
    """Settings of the Flower engine (``federation.engine: flower``); see docs/flower.md."""

    client_num_cpus: float = Field(1.0, gt=0, description="simulation: CPUs reserved per ClientApp (Ray actor)")
    client_num_gpus: float = Field(0.0, ge=0, description="simulation: GPUs (fraction) per ClientApp")
    ray_num_cpus: int | None = Field(None, ge=1, description="simulation: CPUs Ray may use (default: all)")
    round_timeout_s: float = Field(3600.0, gt=0, description="seconds to wait for the replies of one round")
    node_wait_s: float = Field(120.0, gt=0, description="seconds to wait for every SuperNode partition to connect")
    roster: str | None = Field(
        None, description="deployment: YAML list of {client, name, public_key} read by the ServerApp; each node then "
        "proves its client's key (docs/flower.md, 'Secure deployment') and node-declared partition ids are ignored"
    )
    secure_aggregation: Literal["none", "secaggplus"] = Field(
        "none", description="secaggplus: the server receives only the num_examples-weighted mean of each round's "
        "weights (Flower's SecAgg+; methods whose replies are weights + num_examples only; integrity checks then "
        "apply to the aggregate only)"
    )
    secaggplus: SecAggPlusConfig = SecAggPlusConfig()

    @field_validator("roster")
    @classmethod
    def _roster_absolute(cls, roster: str | None) -> str | None:
        """The ServerApp reads the roster from its own working directory (the SuperLink's executor), not the user's."""
        if roster is None:
            return None
        if not (path := Path(roster).expanduser()).is_absolute():
            raise ValueError(f"give an absolute path (the ServerApp reads it from its own working directory), got "
                             f"{roster!r}")
        return str(path)


class AdaptiveClipConfig(Settings):
    """``dp_weights.adaptive``: the clip norm follows a quantile of the update norms (Andrew et al. 2021)."""

    target_quantile: float = Field(0.5, ge=0, le=1, description="γ: the share of updates to leave unclipped")
    clip_lr: float = Field(0.2, gt=0, description="η_C of the geometric update C <- C exp(-η_C (b/m - γ))")
    count_std: float | None = Field(None, gt=0, description="σ_b: noise std of the unclipped count (default: "
                                    "clients per round / 20)")


class WeightDPConfig(Settings):
    """DP-FedAvg on the weight replies (docs/privacy.md, "DP on the weights"): each update w_k - w_sent clipped to
    norm ``clip`` on the server, Gaussian noise z·C·max_k p_k (z·C/m for equal weights) on the aggregate; replacing
    one client moves that mean by up to 2·C·max_k p_k, so the run's ε is accounted at multiplier z/2."""

    noise_multiplier: float = Field(ge=0, description="z: noise std / (C x the largest client weight), as Flower's; "
                                    "ε is accounted at z/2 (replace-one sensitivity 2·C·max p); 0: clip only")
    clip: float = Field(gt=0, description="C: the L2 bound of a client's update (with adaptive: its first value)")
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the run's ε")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="rdp (Mironov 2017) or pld")
    adaptive: AdaptiveClipConfig | None = Field(None, description="adaptive clipping; absent: the clip is fixed")


PrivacyAttack = Literal["sample-style", "client-style", "fedfa-moments", "fpl-prototypes", "gram", "update-dlg"]


class AuditConfig(Settings):
    """``audit:``: the privacy audit of a finished run (docs/privacy.md, "Auditing what leaves a client").
    ``feddg audit privacy`` reads it as its defaults; with it, ``feddg run`` and ``feddg sweep`` audit each run
    after training (a sweep also writes audit.md / audit.csv over its cells). Not part of the run's config hash:
    changing it re-audits, never retrains."""

    attacks: list[PrivacyAttack] | None = Field(None, description="null: those on what the run's method shares, "
                                                "and update-dlg")
    per_client: int = Field(32, ge=1, description="victim images per client")
    attacker_size: int = Field(256, ge=1, description="the third-party attacker's public images")
    noise_multipliers: list[float] = Field([0.0, 0.01, 0.1, 1.0], min_length=1, description="DP noise "
                                           "multipliers z each attack is re-run at (0: no DP)")
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of each ε")
    generator_steps: int = Field(300, ge=1, description="the inversion generator's training steps")
    dlg_victims: int = Field(4, ge=1, description="clients whose one-step update DLG inverts")
    dlg_iterations: int = Field(20, ge=1, description="L-BFGS iterations of DLG")
    fid: bool = Field(True, description="FID (EfficientNet-Lite0 features)")
    seed: int | None = Field(None, ge=0, description="the audit's seed (images, generator, noise, DLG's dummy); "
                             "null: the run's seed, so a sweep's seeds differ in the audit's draws too")
    style_path: Literal["pixel", "feature", "adain-vgg"] | None = Field(
        None, description="the style attacks' path; null: the run's (pixel unless its method says)")

    @field_validator("noise_multipliers")
    @classmethod
    def _non_negative(cls, zs: list[float]) -> list[float]:
        if any(z < 0 for z in zs):
            raise ValueError(f"noise multipliers must be >= 0 (0: no DP); got {zs}")
        return zs


#: the audit's attack on what each method shares (feddg.audit)
METHOD_ATTACKS: dict[str, PrivacyAttack] = {"ccst": "sample-style", "pardon": "client-style", "fedfa": "fedfa-moments",
                                            "fpl": "fpl-prototypes"}
#: attacks that need class labels besides images: FPL's prototypes are per class, the Gram is of a classifier's
#: ``[N, d]`` inputs, DLG inverts a classifier's cross-entropy (every attack inverts images)
LABELLED_ATTACKS = ("fpl-prototypes", "gram", "update-dlg")


def audit_attacks(cfg: ExperimentConfig) -> tuple[PrivacyAttack, ...]:
    """The attacks on what the run's method shares: its statistic's, the Gram's under a hierarchy, and
    always the inversion of a weights update."""
    own = (METHOD_ATTACKS[cfg.method.name],) if cfg.method.name in METHOD_ATTACKS else ()
    gram: tuple[PrivacyAttack, ...] = ("gram",) if cfg.hierarchy is not None else ()
    return (*own, *gram, "update-dlg")


def task_provides(info: dict[str, Any]) -> frozenset[str]:
    """What a dataset's batches carry (``dataset_info``'s row): its inputs' kind and its task's targets."""
    from feddg.tasks import task_class  # lazy: tasks import torch

    return frozenset({info["inputs"]}) | task_class(info["task"]).targets


def audit_problem(cfg: ExperimentConfig, attacks: list[PrivacyAttack] | None) -> str | None:
    """Why ``attacks`` (``None``: :func:`audit_attacks` of the run) do not fit the task of ``cfg``'s dataset, on
    one line; ``None`` when they all do."""
    from feddg.data import dataset_info  # lazy: tasks import torch
    from feddg.tasks import CLASS_LABELS, IMAGES

    info = dataset_info(cfg.data.dataset)
    provides = task_provides(info)
    needs = {a: frozenset({IMAGES, *((CLASS_LABELS,) if a in LABELLED_ATTACKS else ())}) for a in get_args(PrivacyAttack)}
    misfit = {a: needs[a] - provides for a in (attacks or audit_attacks(cfg)) if not needs[a] <= provides}
    if not misfit:
        return None
    fit = [a for a, need in needs.items() if need <= provides]
    why = "; ".join(f"{a} needs {', '.join(sorted(m))}" for a, m in misfit.items())
    return (f"the privacy audit is for image classification: the {info['task']} task of {cfg.data.dataset} provides "
            f"{', '.join(sorted(provides))}; {why} (attacks that fit: {', '.join(fit) or 'none'})")


class ExtraEvalConfig(Settings):
    """A further dataset with the training data's classes, evaluated like the held-out domain."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="the metrics' key: extra/<name>_acc[/<domain>]")
    dataset: str = Field(description="a dataset name (feddg datasets), loaded at the training data's image size")
    root: str | None = Field(None, description="its folder, for a folder dataset")
    domains: list[str] | None = Field(None, description="only these of its domains (default: all)")
    numbered_domains = field_validator("domains", mode="before")(domain_names)
    max_per_domain: int | None = Field(None, ge=1, description="at most this many samples of each domain")


class EvalConfig(Settings):
    every: int = Field(1, ge=1, description="evaluate every k rounds (and always after the last)")
    batch_size: int = Field(256, ge=1)
    per_domain: bool = Field(
        True, description="write every domain's figures to metrics.jsonl; false keeps the means only (readable with "
        "thousands of domains), and results.json holds the final per-domain figures"
    )
    metrics: list[str] = Field(
        default_factory=list, description="further metrics reported beside the task's own, from the same tallies, as "
        "<role>_<name>[/<domain>]: macro_f1 (classification: WILDS' IWildCam metric), slice_dice (segmentation: "
        "HarmoFL's and FedFA's code's per-slice Dice, background included)"
    )
    extra: list[ExtraEvalConfig] = Field(
        default_factory=list, description="further evaluation targets: other datasets with the same classes, "
        "reported as extra/<name>_acc[/<domain>] on every evaluation"
    )

    @field_validator("extra")
    @classmethod
    def _names_unique(cls, extra: list[ExtraEvalConfig]) -> list[ExtraEvalConfig]:
        names = [e.name for e in extra]
        if len(set(names)) < len(names):
            raise ValueError(f"every extra target needs its own name; got {names}")
        return extra


class LoggingConfig(Settings):
    """Copies of the metrics for experiment trackers (``pip install 'feddg[logging]'``); metrics.jsonl stays the record."""

    tensorboard: bool = Field(False, description="TensorBoard scalars per round and hparams at the end, in the run dir")
    mlflow: str | None = Field(
        None, description="MLflow tracking directory or URI: params, metrics per round, the run directory as artifacts"
    )


class ExperimentConfig(Settings):
    name: str = "experiment"
    seed: int = Field(0, ge=0)
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda[:k]'")
    dp_noise: Literal["secret", "seeded"] = Field(
        "secret", description="the stream of every DP noise (dp_weights, a method's dp:, HFedATM's Gram "
        "noise): secret: keyed from the OS's entropy, afresh for every run and written nowhere, so that no "
        "one can redraw and subtract it (a rerun or a resumed run draws other noise); seeded: from the run's seed, bit for "
        "bit reproducible, and by anyone who holds config.yaml, against whom it then protects nothing (tests, "
        "replication; docs/privacy.md)")
    reproducibility: Literal["native", "portable"] = Field(
        "native", description="native: this CPU's fastest float kernels (a run repeats bit for bit on the same "
        "machine); portable: kernels pinned so that every x86-64 CPU with AVX2 gives the same bits, one thread per "
        "process (slower; docs/reliability.md). The feddg command re-executes itself with the kernels pinned"
    )
    output_dir: str = "runs"
    data: DataConfig = Field(default_factory=DataConfig)  # built on use: its check imports feddg.data (torch)
    split: SplitConfig = SplitConfig()
    partition: PartitionConfig = Field(default_factory=PartitionConfig)  # built on use: its check imports torch
    model: ModelConfig = ModelConfig()
    method: MethodConfig = MethodConfig()
    optim: OptimConfig = OptimConfig()
    federation: FederationConfig = FederationConfig()
    hierarchy: HierarchyConfig | None = None
    dp_weights: WeightDPConfig | None = None
    audit: AuditConfig | None = None
    eval: EvalConfig = EvalConfig()
    flower: FlowerConfig = FlowerConfig()
    logging: LoggingConfig = LoggingConfig()

    @field_validator("device")
    @classmethod
    def _device_known(cls, device: str) -> str:
        """auto, cpu, cuda or cuda:k; CUDA only when this torch has it (checked at load, not mid-run)."""
        m = re.fullmatch(r"cuda(?::(\d+))?", device)
        if device in ("auto", "cpu"):
            return device
        if m is None:
            raise ValueError(f"{device!r} is not a device; use auto, cpu, cuda or cuda:k")
        import torch  # lazy: only a CUDA request needs it

        if not torch.cuda.is_available():
            raise ValueError(f"{device} requested but torch has no CUDA; use device=cpu (or auto)")
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise ValueError(f"{device} requested but torch sees {torch.cuda.device_count()} CUDA device(s)")
        return device

    @model_validator(mode="after")
    def _model_fits_data(self) -> ExperimentConfig:
        """The model takes the dataset's inputs (images, tokens or features) and predicts its task's targets (class
        labels or dense masks), and every ``model.params`` key is an option of it, before any data loads."""
        from feddg.data import dataset_info
        from feddg.models import check_model_params, list_models, model_inputs, model_targets
        from feddg.tasks import task_class

        info = dataset_info(self.data.dataset)
        targets = task_class(info["task"]).targets

        def fits(model: str) -> bool:
            return model_inputs(model) == info["inputs"] and model_targets(model) in targets

        if not fits(name := self.model.name):
            raise ValueError(f"model.name: model {name} ({model_inputs(name)} → {model_targets(name)}) does not fit "
                             f"the {info['task']} task of {self.data.dataset} ({info['inputs']} → "
                             f"{', '.join(sorted(targets))}); models that do: "
                             f"{', '.join(m for m in list_models() if fits(m))}")
        check_model_params(name, self.model.params)
        return self

    @model_validator(mode="after")
    def _extra_targets_fit(self) -> ExperimentConfig:
        """Every ``eval.extra`` dataset is of the training data's task, inputs and (where both are known) classes,
        before any data loads."""
        from feddg.data.registry import evaluation_mismatch

        for i, spec in enumerate(self.eval.extra):
            try:
                why = evaluation_mismatch(spec.dataset, self.data.dataset, self.data.tokenizer or self.model.path)
            except ValueError as err:  # an unknown dataset name
                why = str(err)
            if why:
                raise ValueError(f"eval.extra.{i} ({spec.name}): {why}")
        return self

    @model_validator(mode="after")
    def _method_params_known(self) -> ExperimentConfig:
        from feddg.algorithms.registry import method_class  # lazy: methods import torch

        cls = method_class(self.method.name)
        try:
            cls.Params(**self.method.params)
        except ValidationError as err:
            raise ValueError(format_errors(err, prefix="method.params", model=cls.Params)) from None
        return self

    @model_validator(mode="after")
    def _method_fits_task_and_model(self) -> ExperimentConfig:
        """The method and ``optim.augment`` against what the dataset's task and the model provide, before any data
        loads; label mixing only with a method whose loss takes soft targets."""
        from feddg.algorithms.components.augment import augment_requirements, label_mixing, parse_augment
        from feddg.algorithms.registry import method_class
        from feddg.data import dataset_info
        from feddg.models import model_capabilities
        from feddg.tasks import task_class

        cls = method_class(self.method.name)
        info = dataset_info(self.data.dataset)
        task = task_provides(info)
        model = model_capabilities(self.model.name)
        specs = parse_augment(self.optim.augment)
        needs = {f"method {cls.name}": cls.requirements(cls.Params(**self.method.params)),
                 **{f"optim.augment {name}": need for name, need in augment_requirements(specs).items()}}
        for who, need in needs.items():
            if missing := need - task - model:
                raise ValueError(f"{who} needs {', '.join(sorted(missing))}: the {info['task']} task of "
                                 f"{self.data.dataset} provides {', '.join(sorted(task))}, model {self.model.name} "
                                 f"{', '.join(sorted(model)) or 'nothing more'}")
        if problem := cls.optim_problem(cls.Params(**self.method.params), self.optim.name, self.optim.momentum):
            raise ValueError(problem)
        if self.optim.loss != "task" and self.optim.loss not in (losses := task_class(info["task"]).losses):
            raise ValueError(f"optim.loss: the {info['task']} task of {self.data.dataset} trains with no "
                             f"{self.optim.loss!r}; it offers task{''.join(', ' + name for name in losses)}")
        offers = task_class(info["task"]).offers
        if unknown := [m for m in self.eval.metrics if m not in offers]:
            raise ValueError(f"eval.metrics: the {info['task']} task of {self.data.dataset} reports no {unknown[0]!r}; "
                             f"it offers {', '.join(offers) or 'none'}")
        if (mixing := label_mixing(specs)) and not cls.takes_soft_targets:
            raise ValueError(f"optim.augment: {cls.name}'s loss uses hard labels beyond the task's loss; use mixstyle "
                             f"with it, not {mixing[0]}")
        return self

    @model_validator(mode="after")
    def _hierarchy_fits(self) -> ExperimentConfig:
        h = self.hierarchy
        if h is None:
            return self
        from feddg.aggregation.merges import HFedATMParams  # lazy: it imports torch
        from feddg.algorithms.registry import method_class

        if not method_class(self.method.name).averages_weights:  # it ran a server round, then failed at the merge
            raise ValueError(f"hierarchy: {self.method.name} does not average weights, so its stations have no model "
                             "to merge; run it flat")
        try:  # every hierarchy key is known (a sweep may switch merges); each merge takes the ones it uses
            HFedATMParams(**h.params)
        except ValidationError as err:
            raise ValueError(format_errors(err, prefix="hierarchy.params", model=HFedATMParams)) from None
        natural = self.partition.kind == "natural"  # its clients are the dataset's groups: counted when it loads
        if not natural and self.partition.num_clients < h.stations:
            raise ValueError(f"hierarchy.stations: {h.stations} stations need partition.num_clients >= {h.stations}")
        groups = self.partition.params.get("groups")
        if self.partition.kind == "two_level_dirichlet" and groups != h.stations:
            raise ValueError(f"partition.kind=two_level_dirichlet: partition.params.groups ({groups}) must equal "
                             f"hierarchy.stations ({h.stations})")
        if self.partition.kind == "two_level_dirichlet" and h.assignment != "contiguous":
            raise ValueError(f"partition.kind=two_level_dirichlet numbers clients station by station: it needs "
                             f"hierarchy.assignment=contiguous, not {h.assignment}")
        return self

    @model_validator(mode="after")
    def _dp_weights_fits(self) -> ExperimentConfig:
        """DP-FedAvg needs a flat federation whose method averages the ``w/`` arrays by ``num_examples``."""
        if self.dp_weights is None:
            return self
        from feddg.aggregation.mean import WeightedSum  # lazy: methods import torch
        from feddg.algorithms.registry import create_method

        method = create_method(self.method.name, self.method.params)
        weights = getattr(method.start(7.0), "weights", None)  # a running sum normalised by the announced examples
        weighs_examples = isinstance(weights, WeightedSum) and weights.scale == 7.0
        fc = self.federation
        problem = (f"{method.name} does not average weights by num_examples" if not weighs_examples
                   else "a station topology (hierarchy)" if self.hierarchy is not None
                   else f"federation.aggregation={fc.aggregation}" if fc.aggregation != "mean"
                   else "federation.reject_outliers" if fc.reject_outliers is not None else None)
        if problem is not None:
            raise ValueError(f"dp_weights: DP-FedAvg is for flat federations whose method averages the weights by "
                             f"num_examples (federation.aggregation=mean), not {problem}")
        if self.dp_weights.accountant == "pld" and fc.client_fraction < 1:
            raise ValueError("dp_weights.accountant: pld cannot compose client sampling without replacement "
                             "(federation.client_fraction < 1, dp-accounting has it for rdp only); use rdp")
        return self

    @model_validator(mode="after")
    def _audit_fits(self) -> ExperimentConfig:
        """The ``audit:`` section's attacks (or the run's defaults) against the dataset's task."""
        if self.audit is None:
            return self
        if (problem := audit_problem(self, self.audit.attacks)) is not None:
            raise ValueError(f"audit: {problem}")
        return self

    @model_validator(mode="after")
    def _defences_fit(self) -> ExperimentConfig:
        """The server's defences where they are defined: robust rules and outlier rejection combine ``w/`` arrays
        (flat federations of methods that average weights), the loss rollback needs the clients' holdouts and a
        flat federation."""
        fc = self.federation
        if fc.aggregation == "mean" and fc.reject_outliers is None and fc.rollback_loss_factor is None:
            return self
        from feddg.algorithms.registry import create_method  # lazy: methods import torch

        method = create_method(self.method.name, self.method.params)
        if fc.aggregation != "mean" and (not method.averages_weights or self.hierarchy is not None):
            what = ("a station topology (hierarchy)" if self.hierarchy is not None
                    else f"{method.name}, which does not average weights")
            raise ValueError(f"federation.aggregation: {fc.aggregation} is for flat federations of methods that "
                             f"average weights, not {what}")
        if fc.reject_outliers is not None and not method.averages_weights:
            raise ValueError(f"federation.reject_outliers: {method.name} does not average weights, so a reply's "
                             "update norm is not defined")
        if fc.rollback_loss_factor is not None and self.partition.holdout == 0:
            raise ValueError("federation.rollback_loss_factor needs the clients' holdouts (partition.holdout > 0)")
        if fc.rollback_loss_factor is not None and self.hierarchy is not None:
            # it measures the global model, which a station round does not change, and a rolled-back merge would
            # keep the stations' models that caused it, so every later merge would be rolled back too
            raise ValueError("federation.rollback_loss_factor is for flat federations: under a hierarchy the global "
                             "model changes only at a merge, so a station round's loss is not measured")
        return self

    @model_validator(mode="after")
    def _secure_aggregation_fits(self) -> ExperimentConfig:
        """SecAgg+ sums weights: the method's server half must need nothing of a reply but its share of the
        weighted mean, and nothing of the round may need a single reply. (The engine is checked where a run starts,
        :data:`SECAGG_NEEDS_FLOWER`: a deployment's config keeps ``federation.engine``'s default.)"""
        if self.flower.secure_aggregation == "none":
            return self
        from feddg.algorithms.base import Method  # lazy: methods import torch
        from feddg.algorithms.registry import create_method

        method = create_method(self.method.name, self.method.params)
        own = [name for name in ("start", "accumulate", "keep", "client_config", "setup_request", "client_setup")
               if getattr(type(method), name) is not getattr(Method, name)]
        fc = self.federation
        problem = (f"{method.name}, which does not average weights" if not method.averages_weights
                   else f"{method.name}, whose server uses more of a reply than its weights ({', '.join(own)})" if own
                   else "a station topology (hierarchy)" if self.hierarchy is not None
                   else f"federation.aggregation={fc.aggregation}" if fc.aggregation != "mean"
                   else "federation.reject_outliers" if fc.reject_outliers is not None
                   else "dp_weights (it clips each reply)" if self.dp_weights is not None else None)
        if problem is not None:
            raise ValueError(f"flower.secure_aggregation: secaggplus is for Flower runs of methods whose replies are "
                             f"weights + num_examples, averaged by the mean, not {problem}")
        return self


class ConfigError(ValueError):
    """A configuration problem, with the dotted key in the message."""


def format_errors(err: ValidationError, prefix: str = "", model: type[Settings] | None = None) -> str:
    """Every error of ``err`` as ``key: problem`` on one line; with the validated ``model``, an unknown key names
    the keys it may have meant."""
    lines = []
    for e in err.errors():
        loc = ".".join(_show(p) for p in e["loc"])
        loc = f"{prefix}.{loc}" if prefix and loc else prefix or loc
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and model is not None and (meant := meant_keys(model, e["loc"])):
            msg += f"; did you mean {' or '.join('.'.join(filter(None, (prefix, *path))) for path in meant)}?"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return one_line("; ".join(lines))


def one_line(text: str) -> str:
    """``text`` with line breaks and runs of white space folded into single spaces."""
    return " ".join(text.split())


def _show(key: object) -> str:
    """A key as written, or its repr when it holds line breaks or other unprintable characters."""
    return repr(key) if isinstance(key, str) and not key.isprintable() else str(key)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_dotted(d, "a.b.c", v)`` sets ``d["a"]["b"]["c"] = v``, creating dicts on the way. A mapping value is
    merged key by key into a section already there (``federation={local_epochs: 1}`` keeps the section's other
    keys), except a component's ``params`` (``method.params``, ``model.params``, ...), which belong to whatever
    the component is named and are replaced whole (a sweep variant that switches methods gives the new method's
    parameters); an empty mapping ``{}`` empties a section."""
    *parents, leaf = dotted.split(".")
    if not all(parents) or not leaf:
        raise ConfigError(f"override key {_show(dotted)} has an empty part")
    node = tree
    for p in parents:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{_show(dotted)}: {p!r} is not a section")
        node = child
    if isinstance(value, dict) and value and isinstance(node.get(leaf), dict) and leaf != "params":
        for key, sub in value.items():
            set_dotted(node[leaf], str(key), sub)
    else:
        node[leaf] = value


def _leaves(key: str, value: Any) -> list[str]:
    """The dotted keys an override sets (a mapping's every leaf; a component's ``params`` as a whole)."""
    if isinstance(value, dict) and value and not key.endswith("params"):
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]
    return [key]


def _get_dotted(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["federation.rounds=5", "method.name=fedprox"]`` -> typed (key, value) pairs (YAML scalars)."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        try:
            value = _load_yaml(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: invalid YAML value: {_yaml_problem(err)}") from None
        pairs.append((key.strip(), value))
    return pairs


def build_config(raw: dict[str, Any], overrides: list[str] | None = None) -> ExperimentConfig:
    """Validate ``raw`` after applying ``overrides``; errors name the key, on one line."""
    tree = copy.deepcopy(raw)  # overrides must not leak into ``raw`` (a sweep reuses it per variant)
    given: dict[str, Any] = {}
    pairs = parse_overrides(overrides or [])
    keys = {k for k, _ in pairs}
    for key, value in pairs:
        for leaf in _leaves(key, value):
            if leaf in given:
                warnings.warn(f"{leaf} is overridden twice: the last value wins ({given[leaf]!r} is replaced)",
                              stacklevel=2)
        old = _get_dotted(tree, key)
        # the component itself switched (method.name, partition.kind): its old params are no longer its defaults
        renamed = any(key.removesuffix("params") + selector in keys for selector in ("name", "kind"))
        if key.endswith(".params") and isinstance(old, dict) and isinstance(value, dict) and not renamed:
            if dropped := sorted(set(old) - set(value)):
                warnings.warn(f"{key} is replaced whole: {', '.join(map(str, dropped))} go back to their defaults "
                              f"(set {key}.<name>=... to change one)", stacklevel=2)
        set_dotted(tree, key, value)
        given.update({leaf: _get_dotted(tree, leaf) for leaf in _leaves(key, value)})
    try:
        return ExperimentConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_errors(err, model=ExperimentConfig)) from None
    except (ValueError, TypeError) as err:  # a validator's own check, outside pydantic's wrapping
        raise ConfigError(one_line(str(err))) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file; syntax errors and duplicate keys give ``file:line:column: problem``."""
    path = Path(path)
    if path.is_dir():
        hint = f" (a run directory: feddg run --resume {path})" if (path / "config.yaml").is_file() else ""
        raise ConfigError(f"{path} is a folder, not a config file{hint}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _load_yaml(path.read_text(encoding="utf-8")) or {}
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: {_yaml_problem(err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: {_yaml_problem(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (not last-one-wins)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The problem of a YAML error on one line, without PyYAML's multi-line location dump."""
    if isinstance(err, yaml.MarkedYAMLError):
        text = err.problem or err.context or ""
        if err.problem and err.context:
            mark = err.context_mark
            text += f" ({err.context}" + (f" at {mark.line + 1}:{mark.column + 1})" if mark is not None else ")")
    else:
        text = str(err).split("\n")[0]
    return one_line(text or "invalid YAML")


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """An experiment config; a sweep file's ``sweep:`` section is ignored (its base config runs)."""
    raw = read_yaml(path)
    raw.pop("sweep", None)
    if not raw and not overrides:
        raise ConfigError(f"{path} is empty: an experiment config names at least its data, partition and method "
                          "(configs/demo.yaml is a complete one)")
    return build_config(raw, overrides)


def config_tree(cfg: ExperimentConfig) -> dict[str, Any]:
    """``cfg`` as a plain tree that builds the same config again: every field, except a natural partition's
    ``num_clients`` when the config left it to the data (set, it must match the groups: a rebuilt config would
    then refuse the default count)."""
    tree = cfg.model_dump(mode="json")
    if cfg.partition.kind == "natural" and "num_clients" not in cfg.partition.model_fields_set:
        del tree["partition"]["num_clients"]
    return tree


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(config_tree(cfg), sort_keys=False)
