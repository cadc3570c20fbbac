"""Local augmentation baselines of FedFA's Table 10, composable with any client method.

A list in ``optim.augment`` (``[{name: mixup, alpha: 0.2}, {name: mixstyle}]``) is applied to the batches
of :func:`feddg.algorithms.components.local.local_batches`, which every local loop draws from (``train_local``
and the own loops of FedSR and FPL), so it rides along with whatever the client method computes (FedProx's
proximal term, FedFA's FFA layers, ...):

* **Mixup** (Zhang et al., 2018): ``x̃ = λ x_i + (1−λ) x_j``, ``ỹ = λ y_i + (1−λ) y_j``, λ ~ Beta(α, α).
* **Manifold Mixup** (Verma et al., 2019): the same at a stage ``k`` drawn uniformly from ``stages``
  each step (0 is the input), mixing that stage's output; by default {input, after the first and the second
  residual stage}, the paper's k ∈ {0, 1, 2}.
* **MixStyle** (Zhou et al., 2021): at each listed stage (default: after the first two residual stages, the
  paper's res1 and res2), with probability ``p``, per sample
  ``μ_mix = λ μ_i + (1−λ) μ_j``, ``σ_mix = λ σ_i + (1−λ) σ_j`` (channel statistics over H×W, detached),
  ``x̂ = σ_mix (x − μ_i)/σ_i + μ_mix``, λ ~ Beta(α, α) per sample; labels unchanged.
* **MoEx** (Li et al., 2021): at ``stage``, with probability ``p``, exchange the positional moments
  (PONO: mean and std over *channels* at each position) ``x̂_i = σ_j (x_i − μ_i)/σ_i + μ_j``, and
  interpolate the labels ``ỹ = λ y_i + (1−λ) y_j`` with a fixed λ.

Mixed labels reach the loss as soft targets ``[B, classes]`` (``F.cross_entropy`` takes class
probabilities), so a label-mixing augmentation needs a method whose loss uses the labels only through the
task's loss (``Method.takes_soft_targets``). Each augmentation names what it needs (``requires``: image inputs,
class labels, conv-stage feature maps), checked with the method's own needs at config load.

Stage ``k ≥ 1`` is the output of the module ``conv_stages(model)[k-1]``, hooked for the local training only; a
default placement counts its stages after the model's stem (``stem_stages``: a ResNet's stage 1 is its stem, so
"after the first residual stage" is its stage 2), so it is the paper's on every zoo model. All randomness comes
from one seed drawn from the client's generator, so runs stay reproducible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, ClassVar, Literal, Self

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, TypeAdapter, model_validator
from torch import Tensor, nn

from feddg.numerics import sqrt
from feddg.settings import Settings
from feddg.tasks import CLASS_LABELS, CONV_STAGES, IMAGES

#: variance epsilon of the MixStyle / MoEx standard deviations
EPS = 1e-6


class _Spec(Settings):
    #: what the augmentation needs of the task and the model (``feddg.tasks`` capabilities)
    requires: ClassVar[frozenset[str]]


class Mixup(_Spec):
    requires = frozenset({IMAGES, CLASS_LABELS})
    name: Literal["mixup"]
    alpha: float = Field(0.2, gt=0, description="λ ~ Beta(α, α)")


class ManifoldMixup(_Spec):
    requires = frozenset({IMAGES, CLASS_LABELS, CONV_STAGES})
    name: Literal["manifold_mixup"]
    alpha: float = Field(2.0, gt=0, description="λ ~ Beta(α, α)")
    stages: list[int] | None = Field(None, min_length=1, description="candidate stages, one drawn per step; 0 = "
                                     "input; default: input and after the first two stages past the stem (paper)")


class MixStyle(_Spec):
    requires = frozenset({IMAGES, CONV_STAGES})
    name: Literal["mixstyle"]
    alpha: float = Field(0.1, gt=0, description="λ ~ Beta(α, α), one per sample")
    p: float = Field(0.5, ge=0, le=1, description="probability per stage and step")
    stages: list[int] | None = Field(None, min_length=1, description="1-based conv stages; default: after the first "
                                     "two stages past the stem (the paper's res1, res2)")

    @model_validator(mode="after")
    def _no_input(self) -> MixStyle:
        if self.stages is not None and min(self.stages) < 1:
            raise ValueError("mixstyle.stages are 1-based conv stages (feature maps), not the input")
        return self


class MoEx(_Spec):
    requires = frozenset({IMAGES, CLASS_LABELS, CONV_STAGES})
    name: Literal["moex"]
    lam: float = Field(0.9, ge=0, le=1, description="label weight of the sample that keeps its normalised features")
    p: float = Field(0.5, ge=0, le=1, description="probability per step")
    stage: int = Field(1, ge=1, description="1-based conv stage (default: the first, after the first convolution as "
                       "in the paper)")


#: every augmentation of ``optim.augment`` (``feddg methods`` lists them)
AUGMENTATIONS: tuple[type[_Spec], ...] = (Mixup, ManifoldMixup, MixStyle, MoEx)
AugmentSpec = Annotated[Mixup | ManifoldMixup | MixStyle | MoEx, Field(discriminator="name")]
LABEL_MIXING = ("mixup", "manifold_mixup", "moex")
_ADAPTER = TypeAdapter(list[AugmentSpec])


def parse_augment(items: list[dict] | tuple[dict, ...]) -> list[AugmentSpec]:
    """Validate an ``optim.augment`` list; at most one label-mixing entry (their targets do not compose)."""
    specs = _ADAPTER.validate_python(list(items))
    mixing = [s.name for s in specs if s.name in LABEL_MIXING]
    if len(mixing) > 1:
        raise ValueError(f"at most one label-mixing augmentation ({', '.join(LABEL_MIXING)}); got {mixing}")
    return specs


def augment_requirements(specs: list[AugmentSpec]) -> dict[str, frozenset[str]]:
    """What each augmentation of the list needs, by name."""
    return {s.name: s.requires for s in specs}


def label_mixing(specs: list[AugmentSpec]) -> list[str]:
    """The augmentations of the list that hand the loss soft targets."""
    return [s.name for s in specs if s.name in LABEL_MIXING]


# --- the formulas, on tensors --------------------------------------------------------------------
def mix(a: Tensor, b: Tensor, lam: Tensor | float) -> Tensor:
    """``λ a + (1−λ) b`` (Mixup on inputs, hidden features or one-hot labels)."""
    return lam * a + (1.0 - lam) * b


def mix_permuted(x: Tensor, perm: Tensor, lam: float) -> Tensor:
    """``λ x + (1−λ) x[perm]``: :func:`mix` of a batch with its own permutation."""
    return mix(x, x[perm], lam)


def soft_targets(y: Tensor, perm: Tensor, lam: float, num_classes: int) -> Tensor:
    """``ỹ = λ onehot(y) + (1−λ) onehot(y[perm])`` as float class probabilities ``[B, classes]``."""
    onehot = F.one_hot(y, num_classes).float()
    return mix(onehot, onehot[perm], lam)


def mixstyle(x: Tensor, perm: Tensor, lam: Tensor) -> Tensor:
    """MixStyle on ``x [B, C, H, W]`` with per-sample ``lam [B]``: mix detached channel mean/std over H×W."""
    mu = x.mean(dim=(2, 3), keepdim=True).detach()
    sig = sqrt(x.var(dim=(2, 3), keepdim=True, unbiased=False) + EPS).detach()
    lam = lam.view(-1, 1, 1, 1).to(x.dtype)
    return (x - mu) / sig * mix(sig, sig[perm], lam) + mix(mu, mu[perm], lam)


def pono(x: Tensor) -> tuple[Tensor, Tensor]:
    """Positional normalisation's moments: mean and std over channels at each position, ``[B, 1, H, W]``."""
    return x.mean(dim=1, keepdim=True), sqrt(x.var(dim=1, keepdim=True, unbiased=False) + EPS)


def moex(x: Tensor, perm: Tensor) -> Tensor:
    """MoEx: ``σ_j (x_i − μ_i)/σ_i + μ_j`` with PONO moments of the partner ``j = perm[i]``."""
    mu, sig = pono(x)
    return (x - mu) / sig * sig[perm] + mu[perm]


# --- one local training -------------------------------------------------------------------------
class Augmenter:
    """Hooks the augmentation list onto ``model``'s conv stages for one local training (``with``)."""

    def __init__(self, model: nn.Module, specs: list[AugmentSpec], seed: int, num_classes: int) -> None:
        self.num_classes = num_classes
        self.rng = np.random.default_rng(seed)
        self.plan: dict[int, list[Callable[[Tensor], Tensor]]] = {}
        self.batch_size = 0
        stem = _stem(model)
        self.placed = [(s, _stages(s, stem)) for s in specs]  # each spec with the stages it acts at
        stages = sorted({k for _, ks in self.placed for k in ks if k >= 1})
        self.names = _stage_names(model, stages) if stages else {}  # stage -> hooked module name
        modules = dict(model.named_modules())
        self.modules = {k: modules[name] for k, name in self.names.items()}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> Self:
        self.handles = [m.register_forward_hook(self._hook(k)) for k, m in self.modules.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.plan = [], {}

    def _hook(self, k: int) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor | None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor | None:
            if not module.training or out.shape[0] != self.batch_size:
                return None  # eval passes and forwards of another batch size stay untouched (same-size ones share the draws)
            for fn in self.plan.get(k, []):
                out = fn(out)
            return out

        return hook

    def _perm(self, device: torch.device) -> Tensor:
        return torch.as_tensor(self.rng.permutation(self.batch_size), device=device)

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Draw this step's augmentations; return the (input-mixed) batch and the target (soft if mixed)."""
        self.batch_size, self.plan = len(y), {}
        target = y
        for s, stages in self.placed:
            if s.name == "mixstyle":
                for k in stages:
                    if self.rng.random() < s.p:
                        lams = torch.as_tensor(self.rng.beta(s.alpha, s.alpha, self.batch_size), device=x.device)
                        perm = self._perm(x.device)
                        self.plan.setdefault(k, []).append(functools.partial(mixstyle, perm=perm, lam=lams))
                continue
            if s.name == "moex":
                if self.rng.random() >= s.p:
                    continue
                perm, lam, k = self._perm(x.device), s.lam, s.stage
                self.plan.setdefault(k, []).append(functools.partial(moex, perm=perm))
            else:
                lam = float(self.rng.beta(s.alpha, s.alpha))
                k = 0 if s.name == "mixup" else int(self.rng.choice(stages))
                perm = self._perm(x.device)
                if k == 0:
                    x = mix(x, x[perm], lam)
                else:
                    self.plan.setdefault(k, []).append(functools.partial(mix_permuted, perm=perm, lam=lam))
            target = soft_targets(y, perm, lam, self.num_classes)
        return x, target


def _stages(spec: AugmentSpec, stem: int) -> list[int]:
    """The stages ``spec`` acts at; a default placement counts from the first stage past ``stem`` stem stages."""
    if spec.name == "mixup":
        return [0]
    if spec.name == "moex":
        return [spec.stage]
    if spec.stages is not None:
        return list(spec.stages)
    default = [1, 2] if spec.name == "mixstyle" else [0, 1, 2]
    return [k + stem if k else 0 for k in default]


def _stem(model: nn.Module) -> int:
    from feddg.models.stages import stem_stages  # models sit beside algorithms, imported on use

    return stem_stages(model)


def _stage_names(model: nn.Module, stages: list[int]) -> dict[int, str]:
    from feddg.models.stages import conv_stages

    names = conv_stages(model)
    bad = [k for k in stages if k > len(names)]
    if bad:
        raise ValueError(f"augmentation stages {bad} out of range: the model has conv stages 1..{len(names)}")
    return {k: names[k - 1] for k in stages}
