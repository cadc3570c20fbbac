"""DAC's phase-preserving normalisations (Lee, Bae & Kim, "Decompose, Adjust, Compose", CVPR 2023).

Notation (per sample and channel of a feature map ``x [B, C, H, W]``): ``F`` the 2-D DFT over H×W, amplitude
``A(z) = |F(z)|``, phase ``P(z) = ∠F(z)``, and ``compose(A, P) = F⁻¹(A · e^{iP})``. The paper calls the amplitude
a feature's style and the phase its content; a normalisation ``(x − μ)/σ`` rescales every frequency by ``1/σ``
and moves only the DC term, so it changes the phase only at the DC bin (0 ↔ π). The layers:

* PCNorm  ``γ · compose(A(BN(x)), P(x)) + β``: BatchNorm's amplitude with the input's phase;
* CCNorm  ``γ · compose(A(BN(x)), P(x − λ_c μ)) + β``: how much of BN's mean shift reaches the phase
  (λ_c = 0: PCNorm; λ_c = 1: BatchNorm itself; its gradient is 0, see :class:`CCNorm`);
* SCNorm  ``γ · compose(λ_s A(IN(x)) + (1 − λ_s) A(x), P(x)) + β``: how much style (amplitude) is removed is
  learnt, with instance statistics (λ_s = 1: PCNorm's composition with IN; λ_s = 0: the input).

The FFTs run in float32 (also under ``optim.amp``); each layer returns its input's dtype.
``λ = softmax(h / τ)₀`` of two learnable logits ``h`` (initialised 0, so λ = 0.5), τ the layer's ``temperature``.
Since BN/IN scale every non-DC bin by ``1/σ > 0``, each layer has a closed form (tests/test_dac.py checks the FFT
path against it): PCNorm is BN except that each sample's DC term keeps the sign of the input's channel mean, and
SCNorm is ``λ_s IN(x) + (1 − λ_s) x`` before its affine map. docs/methods/dac_sc.md has the choices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: |F(z)| below this takes the phasor ``F/eps`` (keeps the phase, finite gradients; an exact zero stays zero)
PHASE_EPS = 1e-5


def amplitude(z: Tensor) -> Tensor:
    """``A(z) = |F(z)|`` over the last two dims (one-sided real FFT, float32), ``[..., H, W//2 + 1]``."""
    return torch.fft.rfft2(z.float()).abs()


def compose(amp: Tensor, phase_of: Tensor, eps: float = PHASE_EPS) -> Tensor:
    """``F⁻¹(amp · e^{i P(phase_of)})``: ``amp`` (from :func:`amplitude`) with the phase of ``phase_of``, in its
    dtype. The phase enters as the unit phasor ``F/|F|`` (no ``atan2``, so no NaN gradient at ``F = 0``)."""
    spectrum = torch.fft.rfft2(phase_of.float())
    phasor = spectrum / spectrum.abs().clamp_min(eps)
    return torch.fft.irfft2(amp * phasor, s=phase_of.shape[-2:]).to(phase_of.dtype)


def _channel(v: Tensor) -> Tensor:
    return v.view(1, -1, 1, 1)


class _Mix(nn.Module):
    """The learnable mixing weight ``λ = softmax(h / τ)₀`` of CCNorm and SCNorm."""

    def _init_mix(self, temperature: float) -> None:
        if temperature <= 0:
            raise ValueError(f"{type(self).__name__}: temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.h = nn.Parameter(torch.zeros(2))

    @property
    def lam(self) -> Tensor:
        return torch.softmax(self.h / self.temperature, dim=0)[0]


class PCNorm(nn.BatchNorm2d):
    """Phase-consistent normalisation: ``γ · compose(A(BN(x)), P(x)) + β``.

    A ``BatchNorm2d`` (same buffers, affine parameters and state_dict keys; batch statistics in training, running
    ones in ``eval()``) whose normalised map gives only the amplitude; the phase is the input's.
    """

    def forward(self, x: Tensor) -> Tensor:
        out = compose(amplitude(self._normalize(x)), self._phase_source(x))
        return (out * _channel(self.weight) + _channel(self.bias)).to(x.dtype) if self.affine else out

    def _phase_source(self, x: Tensor) -> Tensor:
        return x

    def _mean(self, x: Tensor) -> Tensor:
        """The μ BatchNorm subtracts: the batch mean in training, the running mean in ``eval()``."""
        if self.training or self.running_mean is None:
            return x.mean(dim=(0, 2, 3))
        return self.running_mean

    def _normalize(self, x: Tensor) -> Tensor:
        """``(x − μ)/σ`` as ``nn.BatchNorm2d`` computes it (and with its running-statistics update), no affine."""
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or self.running_mean is None
        keep = not self.training or self.track_running_stats
        return F.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None,
                            None, None, batch_stats, factor, self.eps)


class CCNorm(PCNorm, _Mix):
    """Content-controlling normalisation: ``γ · compose(A(BN(x)), P(x − λ_c μ)) + β``, μ BatchNorm's mean.

    λ_c = 0 is PCNorm, λ_c = 1 is BatchNorm (``x − μ`` has BN's phase). Only the DC bin of ``x − λ_c μ`` depends
    on λ_c, and its phase is a sign (0 or π), so ∂out/∂λ_c = 0 wherever ``m ≠ λ_c μ``: gradient descent cannot move
    λ_c (the authors' ``atan2`` gives exactly 0 too, so their λ_c stays at its initial 0.5). λ_c enters detached,
    so ``h`` gets that exact 0 rather than FFT rounding amplified by 1/τ; set ``h`` to choose λ_c. ``temperature``
    τ of λ_c = softmax(h/τ)₀: 1e-6 as the authors' release.
    """

    def __init__(self, num_features: int, temperature: float = 1e-6, **kwargs: object) -> None:
        super().__init__(num_features, **kwargs)  # type: ignore[arg-type]
        self._init_mix(temperature)

    def _phase_source(self, x: Tensor) -> Tensor:
        return x - self.lam.detach().to(x.dtype) * _channel(self._mean(x).to(x.dtype))


class SCNorm(_Mix):
    """Style-controlling normalisation: ``γ · compose(λ_s A(IN(x)) + (1 − λ_s) A(x), P(x)) + β``.

    IN is instance normalisation (per sample and channel over H×W, no running statistics); γ = 1, β = 0 and
    λ_s = 0.5 at initialisation; ``temperature`` τ of λ_s = softmax(h/τ)₀ (0.1, the authors' release).
    """

    def __init__(self, num_features: int, temperature: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self._init_mix(temperature)

    def forward(self, x: Tensor) -> Tensor:
        lam = self.lam
        amp = lam * amplitude(F.instance_norm(x, eps=self.eps)) + (1 - lam) * amplitude(x)
        return (compose(amp, x) * _channel(self.weight) + _channel(self.bias)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_features}, temperature={self.temperature}, eps={self.eps}"
