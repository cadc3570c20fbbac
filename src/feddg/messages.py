"""The client/server message contract.

A :data:`Message` is a flat ``dict`` of named numpy arrays and scalars. Nothing else crosses
between a client and the server: no Python objects, no tensors with autograd history, no
dataset handles. That keeps every method runnable on any engine (in-process or Flower) and
makes the privacy audit a matter of reading message keys.

Key conventions: model weights travel under ``"w/<state_dict key>"``; other arrays use a
method-specific prefix (``"gram/"``, ``"stat/"``, ...); scalars have plain names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

Scalar = float | int | str
Value = np.ndarray | float | int | str
Message = dict[str, Value]

WEIGHT_PREFIX = "w/"


@dataclass(frozen=True)
class Slot:
    """A value a reply carries beside its ``w/`` arrays (``Method.reply_layout``, ``Method.setup_layout``): an array
    of ``dtype`` and ``shape`` (``None``: any shape, for a group of arrays under a key ending in ``/``; a dimension
    of -1: any size, the same in every client's setup reply but for the first), or with ``number`` a number
    (``dtype`` float takes an int too) that equals ``value`` where given (an echo of what was sent)."""

    dtype: np.dtype
    shape: tuple[int, ...] | None = None
    number: bool = False
    required: bool = True
    value: float | None = None


Layout = dict[str, Slot]  # key (or prefix ending in "/") -> what the reply must carry there
Shapes = dict[str, tuple[tuple[int, ...], np.dtype]]  # w/ key -> (shape, dtype)


def array_slot(shape: tuple[int, ...] | None, dtype: Any, required: bool = True) -> Slot:
    return Slot(np.dtype(dtype), None if shape is None else tuple(shape), required=required)


def like_slot(value: Value) -> Slot:
    """An array of ``value``'s shape and dtype."""
    return Slot(np.asarray(value).dtype, tuple(np.shape(value)))


def number_slot(kind: type = float, required: bool = True, value: float | None = None) -> Slot:
    return Slot(np.dtype(kind), number=True, required=required, value=value)


def validate_message(msg: Mapping[str, object], who: str = "message") -> None:
    """Raise ``TypeError`` naming the key if ``msg`` holds anything but arrays and scalars."""
    if not isinstance(msg, Mapping):
        raise TypeError(f"{who} must be a dict, got {type(msg).__name__}")
    for key, value in msg.items():
        if not isinstance(key, str):
            raise TypeError(f"{who} key {key!r} is not a string")
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise TypeError(f"{who}[{key!r}] is an object array; only numeric arrays may cross")
        elif isinstance(value, bool) or not isinstance(value, (int, float, str, np.integer, np.floating)):
            raise TypeError(f"{who}[{key!r}] has type {type(value).__name__}; only arrays and scalars may cross")


def message_nbytes(msg: Mapping[str, Value]) -> int:
    """Payload size: array bytes, 8 bytes a number, UTF-8 length of strings, plus key names."""
    total = 0
    for key, value in msg.items():
        total += len(key.encode())
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, str):
            total += len(value.encode())
        else:
            total += 8
    return total


def state_to_message(state: Mapping[str, torch.Tensor], prefix: str = WEIGHT_PREFIX) -> Message:
    """Copy a state_dict into message arrays under ``prefix``."""
    return {prefix + k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def weights_of(model: nn.Module, prefix: str = WEIGHT_PREFIX) -> Message:
    """All parameters and buffers of ``model`` as message arrays."""
    return state_to_message(model.state_dict(), prefix)


def subset(msg: Mapping[str, Value], prefix: str) -> dict[str, Value]:
    """The entries of ``msg`` whose key starts with ``prefix``, prefix stripped."""
    return {k[len(prefix) :]: v for k, v in msg.items() if k.startswith(prefix)}


def entries(msg: Mapping[str, Value], prefix: str) -> dict[str, Value]:
    """The entries of ``msg`` whose key starts with ``prefix``, keys kept."""
    return {k: v for k, v in msg.items() if k.startswith(prefix)}


def without(msg: Mapping[str, Value], prefix: str) -> dict[str, Value]:
    """``msg`` without the entries whose key starts with ``prefix``."""
    return {k: v for k, v in msg.items() if not k.startswith(prefix)}


def load_weights(model: nn.Module, msg: Mapping[str, Value], prefix: str = WEIGHT_PREFIX) -> None:
    """Load the ``prefix`` arrays of ``msg`` into ``model`` in place (all keys must match)."""
    arrays = subset(msg, prefix)
    ref = model.state_dict()
    missing = sorted(set(ref) - set(arrays))
    unexpected = sorted(set(arrays) - set(ref))
    if missing or unexpected:
        raise KeyError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for k, t in ref.items():
            t.copy_(torch.from_numpy(np.asarray(arrays[k])).to(dtype=t.dtype))
