"""Predictions that a test may compare exactly with feddg's on any CPU.

Another CPU's float kernels (AVX2 against AVX-512, another batch size) move a logit by about 1e-6 of its size,
which can flip an argmax only where the two top logits are that close. ``decisive_argmax`` refuses such a near
tie, so a prediction it returns is the same under any kernel."""

from __future__ import annotations

from torch import Tensor

KERNEL_SLACK = 1e-4  # of the largest |logit|: far above any kernel's rounding, far below a model's typical gaps


def decisive_argmax(logits: Tensor) -> Tensor:
    """``logits.argmax(1)``, after checking that every row's top logit leads the next by more than the slack."""
    top = logits.topk(2, dim=1).values
    gap = float((top[:, 0] - top[:, 1]).min())
    slack = KERNEL_SLACK * max(1.0, float(logits.abs().max()))
    assert gap > slack, f"a near tie (gap {gap:.1e} ≤ {slack:.1e}): the argmax could differ on another CPU"
    return logits.argmax(1)
