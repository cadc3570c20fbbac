"""Float operations whose bits do not depend on the CPU, where PyTorch's x86 build leaves them to it.

PyTorch's x86 wheels take ``torch.sqrt`` (so ``pow(0.5)``, the default Adam/AdamW step and ``cdist``; also acos,
asin, atan) from MKL's vector math, whose results are not the correctly rounded ones and come out differently on an
Intel and an AMD processor, whatever ``MKL_CBWR`` says (measured on an AMD EPYC: ≈ 20 % of float32 square roots one
ulp from the correctly rounded value, and other bits again under an emulated Intel CPU; docs/reliability.md).
feddg therefore takes square roots with :func:`sqrt` — the IEEE instruction, correctly rounded on every CPU — and
builds Adam with :func:`adam`, whose fused step also uses it. ``tests/test_numerics.py`` keeps ``src`` off the
others.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

#: dtypes numpy computes in (its ``sqrt`` is the IEEE instruction); others go through float32
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


class _Sqrt(torch.autograd.Function):
    """``√x`` computed by numpy on CPU tensors; the gradient is PyTorch's own formula ``grad / (2 √x)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = torch.from_numpy(np.asarray(np.sqrt(x.detach().contiguous().numpy())))  # a 0-d result is a scalar
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        return grad / (2 * out)


def sqrt(x: Tensor) -> Tensor:
    """The correctly rounded square root of every element (on a CPU the same bits everywhere; elsewhere
    ``torch.sqrt``), differentiable as ``torch.sqrt``. Other float dtypes (bfloat16) are computed in float32 and
    rounded back, which is still correctly rounded; integer and bool tensors give float32, as ``torch.sqrt``."""
    if x.device.type != "cpu":
        return torch.sqrt(x)
    if x.dtype not in _NUMPY_FLOATS:
        root = sqrt(x.float())
        return root.to(x.dtype) if x.is_floating_point() else root
    return _Sqrt.apply(x)


def adam(params: Iterable[Any], *, decoupled: bool = False, **kwargs: Any) -> torch.optim.Optimizer:
    """``torch.optim.Adam`` (``AdamW`` when ``decoupled``) with the fused step wherever PyTorch has one (float
    parameters on CPU or CUDA): its square root is the IEEE instruction, the default step's is MKL's."""
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in tensors)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(groups, fused=True if fused else None, **kwargs)
