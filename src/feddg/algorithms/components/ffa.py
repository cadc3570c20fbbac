"""The federated feature augmentation (FFA) layer of FedFA^l (Zhou & Konukoglu, §3.2, Algorithm 2).

An FFA layer sits after a convolutional stage. In training, with probability ``p``, it perturbs
each sample's channel statistics inside a Gaussian whose variance mixes the client's own batch
variance with the server's modulated client-sharing variance, and re-normalises the features:

* eq. 2  ``μ, σ ∈ R^{B×C}``: per-sample channel mean / std over H×W
* eq. 4  ``Σ²_μ, Σ²_σ ∈ R^C``: client-specific variances over the batch (population, 1/B)
* eq. 5  ``μ̄ ← α μ̄ + (1−α) E_B[μ]``, ``σ̄ ← α σ̄ + (1−α) E_B[σ]`` (init 0 and 1)
* eq. 8  ``Σ̂² = (γ + 1) ⊙ Σ²`` with γ from the server (eq. 7, :mod:`feddg.aggregation.fedfa_stats`)
* eq. 10 ``μ̂ = μ + ε_μ Σ̂_μ``, ``σ̂ = σ + ε_σ Σ̂_σ``, ``ε ~ N(0, 1)`` per sample and channel
* eq. 9  ``X̂ = σ̂ (X − μ) / σ + μ̂``

At test time (``eval()``) and with ``p = 0`` the layer is the identity. The layers hold no
learnable parameters and only *non-persistent* buffers, so attaching them (by forward hooks, see
:func:`attach_ffa`) leaves the model's ``state_dict`` — the ``w/`` arrays — unchanged; μ̄ and σ̄
are client state, moved in and out by the method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from feddg.devices import Inputs
from feddg.numerics import sqrt

#: full: eq. 8 with the t-modulated γ; direct: Table 11's "Direct Fusion" (γ replaced by the raw
#: eq. 6 variance); client: FedFA-C (Σ̂² = Σ²); random: FedFA-R (Σ̂ = a fixed std for all channels)
Variant = Literal["full", "random", "client", "direct"]
VARIANTS: tuple[str, ...] = ("full", "random", "client", "direct")
#: added to the spatial variance before the square root of eq. 2 (σ > 0, finite gradients)
STD_EPS = 1e-6


def channel_stats(x: Tensor, eps: float = STD_EPS) -> tuple[Tensor, Tensor]:
    """Eq. 2: per-sample, per-channel mean and std of ``x [B, C, H, W]`` over H×W → ``[B, C]`` each.

    ``σ = sqrt(Var_HW + eps)`` (population variance), so a constant channel has σ = √eps, not 0.
    """
    if x.dim() != 4:
        raise ValueError(f"FFA needs a feature map [B, C, H, W], got shape {tuple(x.shape)}")
    mu = x.mean(dim=(2, 3))
    var = x.var(dim=(2, 3), unbiased=False)
    return mu, sqrt(var + eps)


def batch_variance(stat: Tensor) -> Tensor:
    """Eq. 4: ``(1/B) Σ_b (s_b − E_B[s])²`` per channel of ``stat [B, C]``; a batch of one gives 0."""
    return stat.var(dim=0, unbiased=False)


def fuse_variance(client_var: Tensor, modulation: Tensor | float) -> Tensor:
    """Eq. 8: ``Σ̂² = (γ + 1) ⊙ Σ²`` (γ = 0 gives FedFA-C's Σ̂² = Σ²)."""
    return (modulation + 1.0) * client_var


def safe_sqrt(v: Tensor) -> Tensor:
    """``√v`` that is exactly 0 (with a zero, not NaN, gradient) where ``v = 0``."""
    positive = v > 0
    return torch.where(positive, sqrt(v.clamp_min(1e-12)), torch.zeros_like(v))


def renormalise(x: Tensor, mu: Tensor, sigma: Tensor, mu_hat: Tensor, sigma_hat: Tensor) -> Tensor:
    """Eq. 9: ``X̂ = σ̂ (X − μ) / σ + μ̂`` with ``[B, C]`` statistics broadcast over H×W."""
    return sigma_hat[..., None, None] * (x - mu[..., None, None]) / sigma[..., None, None] + mu_hat[..., None, None]


def momentum_update(bar: Tensor, stat: Tensor, alpha: float) -> Tensor:
    """Eq. 5: ``s̄ ← α s̄ + (1 − α) E_B[s]`` for a batch statistic ``stat [B, C]``."""
    return alpha * bar + (1.0 - alpha) * stat.mean(dim=0)


def ffa_transform(
    x: Tensor,
    mu: Tensor,
    sigma: Tensor,
    std_mu: Tensor | float,
    std_sigma: Tensor | float,
    eps_mu: Tensor,
    eps_sigma: Tensor,
) -> Tensor:
    """Eqs. 10 and 9: sample ``μ̂ = μ + ε_μ Σ̂_μ``, ``σ̂ = σ + ε_σ Σ̂_σ`` (noises ``ε [B, C]``) and re-normalise."""
    return renormalise(x, mu, sigma, mu + eps_mu * std_mu, sigma + eps_sigma * std_sigma)


class FFALayer(nn.Module):
    """Algorithm 2 for one layer: active with probability ``p`` in training, identity otherwise.

    Client state (set by the method before local training, read after): ``mu_bar``, ``sigma_bar``
    (eq. 5, created as 0 / 1 on the first training forward when absent). Server message:
    ``modulation_mu``, ``modulation_sigma`` (γ of eq. 7 for ``full``, the raw eq. 6 variance for
    ``direct``); while ``None`` they default to the value eqs. 6–7 give for clients that all sit
    at the initial statistics (zero shared variance): γ = 1 (``full``), 0 (``direct``).
    """

    mu_bar: Tensor | None
    sigma_bar: Tensor | None
    modulation_mu: Tensor | None
    modulation_sigma: Tensor | None

    def __init__(self, variant: Variant = "full", p: float = 0.5, momentum: float = 0.99, random_std: float = 0.5):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown FFA variant {variant!r}; expected one of {VARIANTS}")
        self.variant = variant
        self.p = p
        self.momentum = momentum
        self.random_std = random_std
        for name in ("mu_bar", "sigma_bar", "modulation_mu", "modulation_sigma"):
            self.register_buffer(name, None, persistent=False)

    @property
    def tracks_stats(self) -> bool:
        """Only the variants that use the client-sharing variance keep (and upload) μ̄, σ̄."""
        return self.variant in ("full", "direct")

    def reset(self) -> None:
        """Forget client state and server message (the model object is shared by all clients)."""
        self.mu_bar = self.sigma_bar = self.modulation_mu = self.modulation_sigma = None

    def _default_modulation(self) -> float:
        return 1.0 if self.variant == "full" else 0.0

    def perturbation_std(self, mu: Tensor, sigma: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """``Σ̂_μ, Σ̂_σ`` of the variant: eq. 4 + eq. 8 (full, direct, client) or a constant (random)."""
        if self.variant == "random":
            return self.random_std, self.random_std
        mod_mu: Tensor | float
        mod_sigma: Tensor | float
        if self.variant == "client":
            mod_mu = mod_sigma = 0.0
        else:
            default = self._default_modulation()
            mod_mu = self.modulation_mu if self.modulation_mu is not None else default
            mod_sigma = self.modulation_sigma if self.modulation_sigma is not None else default
        var_mu = fuse_variance(batch_variance(mu), mod_mu)
        var_sigma = fuse_variance(batch_variance(sigma), mod_sigma)
        return safe_sqrt(var_mu), safe_sqrt(var_sigma)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        if self.tracks_stats and self.mu_bar is None:
            c = x.shape[1]
            self.mu_bar = torch.zeros(c, device=x.device)  # eq. 5 initialisation
            self.sigma_bar = torch.ones(c, device=x.device)
        if self.p <= 0 or float(torch.rand(())) >= self.p:  # Algorithm 2, line 1
            return x
        mu, sigma = channel_stats(x)
        std_mu, std_sigma = self.perturbation_std(mu, sigma)
        out = ffa_transform(x, mu, sigma, std_mu, std_sigma, torch.randn_like(mu), torch.randn_like(sigma))
        if self.tracks_stats:  # Algorithm 2, lines 11-12 (only when the layer is active)
            mu_bar, sigma_bar = self.mu_bar, self.sigma_bar
            if mu_bar is None or sigma_bar is None:
                raise RuntimeError("FFA: mu_bar and sigma_bar are set together; only one of them is")
            with torch.no_grad():
                self.mu_bar = momentum_update(mu_bar, mu.detach(), self.momentum)
                self.sigma_bar = momentum_update(sigma_bar, sigma.detach(), self.momentum)
        return out

    def hook(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        """Forward hook: replace a stage's output by its augmentation."""
        return self(output)


class FeatureTap(nn.Module):
    """Forward hook that keeps the last output of a stage while ``recording`` (FedFA^h's features)."""

    features: Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.features = None

    def hook(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        self.features = output if self.recording else None


class FFAAttachment(nn.Module):
    """What :func:`attach_ffa` adds to a model as ``model.fedfa``: FFA layers by stage number and a tap."""

    def __init__(self, stage_names: list[str], layers: dict[int, FFALayer], tap_stage: int) -> None:
        super().__init__()
        self.stage_names = list(stage_names)
        self.layers = nn.ModuleDict({str(k): layer for k, layer in sorted(layers.items())})
        self.tap_stage = tap_stage
        self.tap = FeatureTap()
        #: every stage's output channels where the server measured them (:meth:`stage_channels`), else ``None``
        self.expected_channels: dict[int, int] | None = None

    def items(self) -> list[tuple[int, FFALayer]]:
        return [(int(k), layer) for k, layer in self.layers.items()]  # type: ignore[misc]

    def channels(self) -> dict[int, int]:
        return {k: int(layer.mu_bar.shape[0]) for k, layer in self.items() if layer.mu_bar is not None}

    def stage_channels(self, model: nn.Module, example: Inputs) -> dict[int, int]:
        """Every conv stage's output channels (1-based), from one no-grad eval forward of ``example`` (FFA layers
        and the tap pass it through unchanged in eval mode); the model's train/eval mode is restored."""
        modules = dict(model.named_modules())
        found: dict[int, int] = {}

        def record(k: int) -> Callable[[nn.Module, object, Tensor], None]:
            def hook(module: nn.Module, inputs: object, output: Tensor) -> None:
                found.setdefault(k, int(output.shape[1]))
            return hook

        handles = [modules[name].register_forward_hook(record(k)) for k, name in enumerate(self.stage_names, 1)]
        was_training = model.training
        try:
            model.eval()
            with torch.no_grad():
                model(example)
        finally:
            model.train(was_training)
            for h in handles:
                h.remove()
        return found


def attach_ffa(model: nn.Module, stage_names: list[str], layers: dict[int, FFALayer], tap_stage: int) -> FFAAttachment:
    """Hook FFA layers after the 1-based conv stages ``layers`` and a feature tap after ``tap_stage``.

    The attachment is registered as ``model.fedfa`` (so ``train()``/``eval()``/``to()`` reach it);
    hooks are bound methods of its submodules, so a ``deepcopy`` of the model stays wired.
    """
    if hasattr(model, "fedfa"):
        raise ValueError("the model already has FFA layers attached")
    k_max = len(stage_names)
    bad = sorted(k for k in [*layers, tap_stage] if not 1 <= k <= k_max)
    if bad:
        raise ValueError(f"FFA stages {bad} out of range: the model has conv stages 1..{k_max} ({stage_names})")
    attachment = FFAAttachment(stage_names, layers, tap_stage)
    modules = dict(model.named_modules())
    for k, name in enumerate(stage_names, start=1):
        if name not in modules:
            raise ValueError(f"stage module {name!r} not found in {type(model).__name__}")
        if str(k) in attachment.layers:
            modules[name].register_forward_hook(attachment.layers[str(k)].hook)
        if k == tap_stage:
            modules[name].register_forward_hook(attachment.tap.hook)  # after FFA: augmented features
    model.fedfa = attachment
    return attachment
