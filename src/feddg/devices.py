"""Where a batch lives and in which precision it runs: device placement (a tensor, or a dict of tensors such as
``{"input_ids", "attention_mask"}``), channels-last image batches, and ``optim.amp``'s autocast. Shared by the
local training loops and evaluation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

import torch
from torch import Tensor

#: a batch's model input: an image tensor, or named tensors (token ids and attention masks)
Inputs: TypeAlias = Tensor | Mapping[str, Tensor]

#: ``optim.amp`` -> autocast dtype
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device | str, amp: str = "off") -> torch.autocast:
    """``torch.autocast`` on ``device``'s type with ``amp``'s dtype (bf16 | fp16); disabled for ``off``."""
    if amp != "off" and amp not in AMP_DTYPES:
        raise ValueError(f"unknown amp {amp!r}; expected off, bf16 or fp16")
    return torch.autocast(torch.device(device).type, dtype=AMP_DTYPES.get(amp, torch.bfloat16), enabled=amp != "off")


def to_device(x: Inputs, device: torch.device | str, channels_last: bool = False) -> Inputs:
    """``x`` on ``device`` (each tensor of a dict); an image batch (4-d) in ``torch.channels_last`` format when
    asked."""
    if isinstance(x, Mapping):
        return {k: to_device(v, device, channels_last) for k, v in x.items()}  # type: ignore[misc]
    fmt = torch.channels_last if channels_last and x.dim() == 4 else torch.preserve_format
    return x.to(device, non_blocking=True, memory_format=fmt)


def images(x: Inputs) -> Tensor:
    """``x`` as the image tensor it is for a method or component that requires images (``Method.requires``: the
    config check guarantees it); a dict of token tensors is refused."""
    if isinstance(x, Mapping):
        raise TypeError(f"expected an image tensor, got inputs {sorted(x)}: this needs a task with image inputs")
    return x


def batch_size(x: Inputs) -> int:
    """Samples in a batch's inputs (the first dimension of its tensor, or of any of its tensors)."""
    return int(next(iter(x.values())).shape[0]) if isinstance(x, Mapping) else int(x.shape[0])
