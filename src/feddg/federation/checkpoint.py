"""Atomic checkpoints: a crash never leaves a half-written file behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"


def save_checkpoint(run_dir: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``run_dir/checkpoint.pt`` via a temporary file and ``os.replace``."""
    path = Path(run_dir) / CHECKPOINT
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The last checkpoint of ``run_dir``, or ``None`` if it has none."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        return None
    return torch.load(path, weights_only=False)  # our own file: server/client states hold numpy arrays
