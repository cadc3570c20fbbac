"""Tiny image files for the folder-layout tests."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def png(path: Path, colour: tuple[int, int, int] = (10, 20, 30), size: int = 4) -> Path:
    """A flat ``colour`` RGB PNG of ``size`` px at ``path`` (its folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), colour).save(path)
    return path
