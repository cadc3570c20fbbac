"""What a dataset asks of a model and how its predictions are scored: the task seam.

A :class:`Task` owns, for a dataset, everything after the model's output: the training loss, an additive
per-domain *tally* of sufficient statistics of the predictions (classification: correct and total, and per class
the hits, samples and predictions, which give macro-F1; segmentation: twice the true positives and the
predicted-plus-true pixels per class) and the metric computed from a tally, with its name, bounds, direction and
chance level; further metrics of the same tally on request (``eval.metrics``: :meth:`Task.with_metrics`). Because tallies
add, per-domain, id/ood and cross-client figures are sums however the evaluation is split (batches, worker
processes, Flower replies), and the sample count behind every figure comes with it.

It also says what its batches *provide* (:data:`CAPABILITIES`): methods name what they need
(``Method.requires``) and a config that pairs a method with a task or model that cannot serve it is refused at
load. Metric keys are ``<role>_<metric>[/<domain>]`` (``ood_acc/uci``, ``id_dice``): :func:`metric_key`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from torch import Tensor

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from feddg.data.base import DomainDataset

#: a run's final model on dataset indices: its outputs (on the CPU) with the weights the final evaluation scored
Predictor = Callable[[np.ndarray], Tensor]

# what a dataset's batches provide (the inputs' kind, the targets' kind) ...
IMAGES = "images"  # inputs are image tensors [B, C, H, W]
TOKENS = "tokens"  # inputs are a dict of token ids and attention masks [B, L]
FEATURES = "features"  # inputs are dense float vectors [B, V] (bag-of-words counts)
CLASS_LABELS = "class_labels"  # one class index per sample
DENSE_MASKS = "dense_masks"  # one class index per pixel [B, H, W]
# ... and what a model offers (models/registry.py declares them per model)
BATCHNORM = "batchnorm"  # BatchNorm layers (FedBN keeps them local)
CONV_STAGES = "conv_stages"  # a conv-stage map of [B, C, H, W] feature maps (models/stages.py)
CAPABILITIES = frozenset({IMAGES, TOKENS, FEATURES, CLASS_LABELS, DENSE_MASKS, BATCHNORM, CONV_STAGES})
INPUT_KINDS = frozenset({IMAGES, TOKENS, FEATURES})

#: the roles a metric is reported for: the clients' holdouts, the held-out (test) and validation domains, and for a
#: personalised method the global model's
ROLES = ("id", "val", "ood", "global_id", "global_val", "global_ood")


def metric_key(role: str, metric: str, domain: str | None = None) -> str:
    """``id_acc``, ``ood_dice/BIDMC``, ``extra/rot_acc``: the key a figure is written under."""
    return f"{role}_{metric}" + ("" if domain is None else f"/{domain}")


class Task(ABC):
    """A dataset's loss, tally and metric (see the module docstring). Subclasses set the class attributes and the
    four methods; ``num_classes`` counts the target classes (a segmentation's background included)."""

    name: ClassVar[str]
    metric: ClassVar[str]  # the metric keys' suffix, e.g. "acc"
    label: ClassVar[str]  # how plots and tables name it, e.g. "accuracy"
    unit: ClassVar[str] = "%"
    bounds: ClassVar[tuple[float, float]] = (0.0, 100.0)
    higher_is_better: ClassVar[bool] = True
    targets: ClassVar[frozenset[str]]  # the target kind (CLASS_LABELS, DENSE_MASKS)
    offers: ClassVar[tuple[str, ...]] = ()  # further metrics it can report beside its own (eval.metrics)
    losses: ClassVar[tuple[str, ...]] = ()  # other training losses it can use instead of its own (optim.loss)

    def __init__(self, num_classes: int, inputs: str = IMAGES) -> None:
        if inputs not in INPUT_KINDS:
            raise ValueError(f"unknown input kind {inputs!r}; expected one of {sorted(INPUT_KINDS)}")
        self.num_classes, self.inputs = int(num_classes), inputs
        #: the further metrics reported beside :attr:`metric` (keys ``<role>_<name>[/<domain>]``), from the same tally
        self.extra_metrics: tuple[str, ...] = ()
        #: the training loss: "task" (:meth:`loss` as the task defines it) or one of :attr:`losses`
        self.loss_name = "task"

    def with_metrics(self, names: Sequence[str]) -> Task:
        """This task, also reporting the further metrics ``names`` (among :attr:`offers`); one line for others."""
        if unknown := [n for n in names if n not in self.offers]:
            raise ValueError(f"the {self.name} task reports no metric {unknown[0]!r} beside {self.metric}; it offers "
                             f"{', '.join(self.offers) or 'none'}")
        self.extra_metrics = tuple(dict.fromkeys(names))
        return self

    def with_loss(self, name: str) -> Task:
        """This task, training with loss ``name`` ("task" or one of :attr:`losses`); one line for others."""
        if name != "task" and name not in self.losses:
            raise ValueError(f"the {self.name} task trains with no loss {name!r}; it offers "
                             f"task{''.join(', ' + n for n in self.losses)}")
        self.loss_name = name
        return self

    def extra_score(self, name: str, tally: np.ndarray) -> float:
        """Further metric ``name`` (one of :attr:`offers`) of one tally row."""
        raise ValueError(f"the {self.name} task reports no metric {name!r}")

    def extra_figures(self, tally: np.ndarray, domains: list[str], role: str) -> dict[str, float]:
        """``{<role>_<name>/<domain>: score, <role>_<name>: mean over the domains}`` of every further metric, for
        the domains with samples (as the task's own metric is reported)."""
        out: dict[str, float] = {}
        present = [d for d in range(len(tally)) if self.count(tally[d]) > 0]
        for name in self.extra_metrics:
            per = {metric_key(role, name, domains[d]): self.extra_score(name, tally[d]) for d in present}
            out.update(per | ({metric_key(role, name): float(np.mean(list(per.values())))} if per else {}))
        return out

    @abstractmethod
    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The training loss of a batch (a scalar tensor); ``target`` may be soft (label mixing)."""

    @abstractmethod
    def tally_zeros(self, num_domains: int) -> np.ndarray:
        """The empty tally, ``[num_domains, *shape]``."""

    @abstractmethod
    def tally(self, output: Tensor, target: Tensor, domains: np.ndarray, num_domains: int) -> np.ndarray:
        """Sufficient statistics of one batch per domain, ``[num_domains, *shape]`` (``domains``: each sample's),
        additive over batches and over disjoint sample sets."""

    @abstractmethod
    def score(self, tally: np.ndarray) -> float:
        """The metric of one tally row (a domain's, or several domains' summed), in :attr:`unit` within
        :attr:`bounds`."""

    @abstractmethod
    def count(self, tally: np.ndarray) -> int:
        """The samples behind one tally row."""

    def chance(self) -> float | None:
        """The metric of an uninformed predictor (plots draw it), ``None`` where it has none."""
        return None

    def class_view(self, tally: np.ndarray) -> dict[str, list[float | None]] | None:
        """Per-class figures of a tally row, for the report (``None`` where the task has none): e.g. each class's
        recall and its share of the predictions, which show a model that predicts one class."""
        return None

    def examples(self, dataset: DomainDataset, indices_by_domain: Mapping[str, np.ndarray],
                 predict: Predictor) -> dict[str, Figure]:
        """A figure per domain of a few of its evaluation samples and the final model's predictions of them, for
        the run directory's ``examples/<domain>.png`` (``indices_by_domain``: each domain's evaluation samples;
        ``predict``: the model's outputs on indices of ``dataset``). The default draws none (classification)."""
        return {}

    def model_head(self) -> dict[str, Any]:
        """What ``create_model`` needs of the task (the output head)."""
        return {"num_classes": self.num_classes}

    def info(self) -> dict[str, Any]:
        """results.json's ``task`` block: what every consumer of a run reads instead of sniffing key names."""
        return {"name": self.name, "metric": self.metric, "label": self.label, "unit": self.unit,
                "bounds": list(self.bounds), "higher_is_better": self.higher_is_better, "chance": self.chance(),
                "num_classes": self.num_classes, "inputs": self.inputs} | (
                    {"extra_metrics": list(self.extra_metrics)} if self.extra_metrics else {})
