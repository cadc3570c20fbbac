"""HarmoFL (Jiang, Wang, Dou, "HarmoFL: Harmonizing Local and Global Drifts in Federated Learning on Heterogeneous
Medical Images", AAAI 2022; authors' code ``med-air/HarmoFL``: ``utils/amp_utils.pyx``, ``utils/layers.py``,
``utils/weight_perturbation.py``, ``federated/fed_train.py``).

**Local update harmonisation: amplitude normalisation.** An image ``x`` (``C×H×W``) is Fourier-transformed per
channel, ``F(x) = A ∘ e^{iP}`` (amplitude ``A = |F(x)|``, phase ``P = ∠F(x)``). Once, before training, client ``k``
uploads the mean amplitude of its training images, ``Ā_k = (1/n_k) Σ_i A(x_i)``; the server averages them,
``A_g = (1/K) Σ_k Ā_k`` (the code's ``client_weights = 1/K``). Every image — in training and evaluation, seen or
unseen client — is then normalised in its low frequencies and rebuilt with its own phase::

    Â = (1 − λ M) ∘ A + λ M ∘ A_g          x̂ = Re F⁻¹(Â ∘ e^{iP})

``M`` is the ``(2b+1)×(2b+1)`` window around the zero frequency (``fftshift`` layout, the code's ``mutate``) and
``λ = strength`` (1: the low frequencies are replaced, as the code does; < 1 interpolates). The code calls it
with ``L = 0``, i.e. ``b = ⌊min(H, W)·L⌋ = 0``: only the zero-frequency term (each channel's sum) is replaced.
Since only the window of ``A_g`` is ever used, a client uploads ``Ā_k`` restricted to the window: ``C·(2b+1)²``
numbers. The normaliser is a buffer of the network (``w/amp``), as the code's ``AmpNorm.running_amp``.

**Global update harmonisation: weight perturbation** (``WPOptim``). On every batch, with ``g = ∇L(w)``::

    δ = α g / (‖g‖₂ + 1e−12)          ‖g‖₂ over all parameters together
    w ← w − η · opt(∇L(w + δ))        the optimiser's step from w, with the gradient taken at w + δ

(``generate_delta``: ``w += δ``; second forward/backward on the same batch; ``step``: ``w −= δ``, then the base
optimiser). ``α = 0.05`` (``--alpha``). FedAvg aggregation. ``docs/methods/harmofl.md``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from feddg.algorithms.base import (
    Accumulator,
    ClientContext,
    ClientState,
    Method,
    Metrics,
    Params,
    Reply,
    ServerState,
    weights_reply,
)
from feddg.algorithms.components.local import grad_scaler, local_batches, make_optimizer, scaled_step
from feddg.devices import Inputs, images
from feddg.messages import Layout, Message, Shapes, array_slot, load_weights
from feddg.models.base import FedModel
from feddg.tasks import IMAGES

AMP_MEAN = "amp/mean"
AMP_KEY = "amp"  # the normaliser's buffer: ``w/amp`` in the weights

# --------------------------------------------------------------------------- the frequency-space math


def low_freq_radius(height: int, width: int, ratio: float) -> int:
    """The authors' window half-width ``b = ⌊min(H, W)·L⌋`` for a ratio ``L`` (``mutate`` / ``low_freq_mutate_np``)."""
    return int(math.floor(min(height, width) * ratio))


def _window(height: int, width: int, radius: int) -> tuple[slice, slice]:
    """Rows and columns of the ``(2b+1)²`` window around the zero frequency of an ``fftshift``-ed spectrum."""
    ch, cw = height // 2, width // 2
    if radius < 0 or ch - radius < 0 or cw - radius < 0 or ch + radius + 1 > height or cw + radius + 1 > width:
        raise ValueError(f"a low-frequency window of half-width {radius} does not fit {height}×{width} images")
    return slice(ch - radius, ch + radius + 1), slice(cw - radius, cw + radius + 1)


def low_freq_mask(height: int, width: int, radius: int) -> Tensor:
    """``M`` in the unshifted layout of ``torch.fft.fft2``: True at the frequencies ``|u|, |v| ≤ b``."""
    rows, cols = _window(height, width, radius)
    mask = torch.zeros(height, width, dtype=torch.bool)
    mask[rows, cols] = True
    return torch.fft.ifftshift(mask)


def _spectrum(x: Tensor) -> tuple[Tensor, Tensor]:
    """``F(x)`` as amplitude and phase, the zero frequency signed: ``F(x)(0, 0) = Σx`` (real) with phase 0.

    The papers (and the authors' code) transform raw, non-negative pixels, whose ``Σx`` is its own amplitude; feddg's
    images arrive normalised, ``(x − m)/s`` per channel, where ``Σx`` can be negative and ``|Σx|`` would lose its
    sign: interpolating it would brighten a bright image toward a dark one. Mixing the signed sum instead is the
    same as mixing the raw images' amplitudes, in any such normalisation (the other frequencies only scale by 1/s).
    """
    spec = torch.fft.fft2(x.float())
    amp, phase = spec.abs(), spec.angle()
    amp[..., 0, 0], phase[..., 0, 0] = spec[..., 0, 0].real, 0.0
    return amp, phase


def amplitude_window(x: Tensor, radius: int) -> Tensor:
    """``[..., C, 2b+1, 2b+1]``: the amplitude ``|F(x)|`` of each channel in the window, ``fftshift`` layout (float32),
    its centre the signed ``Σx`` (:func:`_spectrum`)."""
    with torch.autocast(x.device.type, enabled=False):
        amp = torch.fft.fftshift(_spectrum(x)[0], dim=(-2, -1))
    rows, cols = _window(x.shape[-2], x.shape[-1], radius)
    return amp[..., rows, cols]


def mix_low_frequency(x: Tensor, target: Tensor, lam: Tensor | float, radius: int) -> Tensor:
    """``Re F⁻¹(Â e^{iP})`` with ``Â = (1 − λ)A + λT`` in the window, ``A`` outside it, the phase ``P`` kept; at the
    zero frequency the signed sums are interpolated (:func:`_spectrum`): raw pixels' amplitude there.

    ``x``: ``[B, C, H, W]``; ``target``: ``[B or 1, C, 2b+1, 2b+1]`` (``fftshift`` layout, as :func:`amplitude_window`);
    ``lam``: a number or one per image ``[B]``. The result has ``x``'s dtype; the FFT runs in float32.
    """
    with torch.autocast(x.device.type, enabled=False):
        amp, phase = _spectrum(x)
        amp = torch.fft.fftshift(amp, dim=(-2, -1))
        rows, cols = _window(x.shape[-2], x.shape[-1], radius)
        weight = torch.as_tensor(lam, dtype=amp.dtype, device=amp.device).reshape(-1, *([1] * (amp.dim() - 1)))
        amp[..., rows, cols] = (1 - weight) * amp[..., rows, cols] + weight * target.to(amp)
        amp = torch.fft.ifftshift(amp, dim=(-2, -1))
        out = torch.fft.ifft2(torch.polar(amp, phase)).real
    return out.to(x.dtype)


# --------------------------------------------------------------------------- weight perturbation


def perturb(params: Sequence[Tensor], alpha: float) -> list[Tensor]:
    """Add ``δ = α g / (‖g‖ + 1e−12)`` to every parameter with a gradient (``‖g‖`` over all of them) and return the
    ``δ``s (zeros where there is no gradient, or when the gradient is not finite: an fp16 overflow step)."""
    grads = [p.grad for p in params if p.grad is not None]
    deltas = [torch.zeros_like(p) for p in params]
    if not grads:
        return deltas
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if not torch.isfinite(norm):
            return deltas
        scale = alpha / (norm + 1e-12)
        for p, d in zip(params, deltas, strict=True):
            if p.grad is not None:
                d.copy_(p.grad * scale.to(p.dtype))
                p.add_(d)
    return deltas


def perturbed_step(
    params: Sequence[Tensor],
    loss_fn: Callable[[], Tensor],
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    alpha: float,
    autocast: Callable[[], AbstractContextManager[Any]],
    clip: float | None = None,
) -> Tensor:
    """One step of ``WPOptim``: the gradient at ``w + δ`` (:func:`perturb`), applied by ``opt`` from ``w``. Returns
    the loss at ``w`` (detached). ``alpha = 0`` is one plain step."""
    opt.zero_grad(set_to_none=True)
    with autocast():
        loss = loss_fn()
    if alpha == 0:
        scaled_step(loss, opt, scaler, clip=clip)
        return loss.detach()
    scaler.scale(loss).backward()
    deltas = perturb(params, alpha)
    opt.zero_grad(set_to_none=True)
    with autocast():
        perturbed = loss_fn()

    def restore() -> None:  # back to w before the optimiser steps (the gradient stays the one at w + δ)
        with torch.no_grad():
            for p, d in zip(params, deltas, strict=True):
                p.sub_(d)

    scaled_step(perturbed, opt, scaler, edit_grads=restore, clip=clip)
    return loss.detach()


# --------------------------------------------------------------------------- the network


class AmpNormNet(FedModel):
    """A zoo model behind HarmoFL's amplitude normalisation: ``net(x̂)``, ``x̂`` normalised to the buffer ``amp``
    (``[C, 2b+1, 2b+1]``, the global amplitude window; all zeros — before the setup exchange — leaves ``x`` as is)."""

    stages_in = "net"  # where models/stages.py finds the conv stages (augmentations hook them)

    def __init__(self, net: FedModel, radius: int, strength: float) -> None:
        super().__init__()
        convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
        if not convs:
            raise TypeError(f"HarmoFL needs an image model: {type(net).__name__} has no nn.Conv2d to read channels from")
        self.net = net
        self.radius, self.strength = radius, strength
        self.feature_dim = net.feature_dim
        k = 2 * radius + 1
        self.register_buffer(AMP_KEY, torch.zeros(convs[0].in_channels, k, k))

    @property
    def classifier(self) -> nn.Module:  # type: ignore[override]  # the wrapped model's head, not a second copy
        return self.net.classifier

    def normalise(self, x: Tensor) -> Tensor:
        amp: Tensor = getattr(self, AMP_KEY)
        if self.strength == 0 or not bool(amp.any()):
            return x
        return mix_low_frequency(x, amp[None], self.strength, self.radius)

    def features(self, x: Tensor) -> Tensor:
        return self.net.features(self.normalise(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.normalise(x))


# --------------------------------------------------------------------------- the method


class HarmoFLParams(Params):
    alpha: float = Field(0.05, ge=0.0, description="weight-perturbation radius α (code --alpha; 0: no perturbation)")
    radius: int = Field(0, ge=0, description="half-width b of the low-frequency window (code L = 0: b = 0, DC only)")
    strength: float = Field(1.0, ge=0.0, le=1.0, description="λ: 1 replaces the window's amplitude (code), < 1 "
                                                             "interpolates, 0 switches the normalisation off")


class HarmoFL(Method):
    """Amplitude normalisation to a shared amplitude (one setup upload) + weight-perturbed local steps; FedAvg."""

    name = "harmofl"
    Params = HarmoFLParams
    params: HarmoFLParams
    search_space = {"alpha": [0.01, 0.05, 0.1], "radius": [0, 1, 3]}
    requires = frozenset({IMAGES})  # Fourier amplitudes of image inputs

    @property
    def normalises(self) -> bool:
        return self.params.strength > 0

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if not isinstance(model, FedModel):
            raise TypeError("HarmoFL needs a zoo model (classifier(features(x)))")
        return AmpNormNet(model, self.params.radius, self.params.strength)

    # --- setup exchange ------------------------------------------------------------------
    def setup_request(self, state: ServerState) -> Message | None:
        if not self.normalises:
            return None
        state["setup_started"] = time.perf_counter()
        return {"amp/radius": self.params.radius}

    def setup_layout(self, model: nn.Module, request: Message, weights: Shapes) -> Layout:
        return {AMP_MEAN: array_slot(weights[f"w/{AMP_KEY}"][0], np.float32)}  # Ā_k, the normaliser's window

    def client_setup(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        """``Ā_k`` in the window: the mean amplitude window of the client's training images (no augmentation)."""
        b = int(msg["amp/radius"])
        total: Tensor | None = None
        count = 0
        for x, _ in ctx.batches(shuffle=False, train=False):
            batch = images(x)
            amp = amplitude_window(batch, b).double().sum(0)
            total = amp if total is None else total + amp
            count += batch.shape[0]
        if total is None:
            raise ValueError(f"client {ctx.client_id} has no training images to take an amplitude from")
        mean = (total / count).cpu().numpy().astype(np.float32)
        expected = tuple(getattr(model, AMP_KEY).shape)
        if mean.shape != expected:
            raise ValueError(f"HarmoFL: the images give an amplitude window {mean.shape}, the model's normaliser "
                             f"is {expected} (image channels vs the first convolution's in_channels)")
        return {AMP_MEAN: mean}, client_state

    def server_setup(self, state: ServerState, replies: list[Reply]) -> ServerState:
        """``A_g``: the unweighted mean of the clients' windows (the code's ``client_weights = 1/K``)."""
        amps = np.stack([np.asarray(r.message[AMP_MEAN], dtype=np.float64) for r in replies])
        weights = {**state["weights"], f"w/{AMP_KEY}": amps.mean(0).astype(np.float32)}
        started = state.pop("setup_started", None)
        return {**state, "weights": weights,
                "time_amp_setup_s": time.perf_counter() - started if started is not None else float("nan")}

    def finish(self, state: ServerState, acc: Accumulator) -> tuple[ServerState, Metrics]:
        """FedAvg (``w/amp`` comes back unchanged from every client, so it stays ``A_g``)."""
        state, _ = super().finish(state, acc)
        if "time_amp_setup_s" not in state:
            return state, {}
        return state, {"time_amp_setup_s": float(state["time_amp_setup_s"])}

    # --- rounds --------------------------------------------------------------------------
    def client_update(
        self, model: nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        load_weights(model, msg)
        if self.normalises and not bool(getattr(model, AMP_KEY).any()):
            raise ValueError(f"client {ctx.client_id} got no global amplitude (w/{AMP_KEY} is zero): the setup "
                             "exchange did not run, or every client's inputs are all zero (nothing to normalise by)")
        model.train()
        opt = make_optimizer(model.parameters(), ctx.optim, float(msg["lr"]))
        scaler = grad_scaler(ctx)
        params = [p for p in model.parameters() if p.requires_grad]
        total, steps = 0.0, 0
        for _, x, y in local_batches(model, ctx):
            def loss_fn(x: Inputs = x, y: Tensor = y) -> Tensor:
                return ctx.task.loss(model(x), y)

            total += float(perturbed_step(params, loss_fn, opt, scaler, self.params.alpha, ctx.autocast,
                                                  ctx.optim.grad_clip))
            steps += 1
        return weights_reply(model, ctx.num_examples, total / max(steps, 1)), client_state
