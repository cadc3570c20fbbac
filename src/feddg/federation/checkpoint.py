"""Checkpoints that cannot be half-written or silently lost.

``checkpoint.pt`` is the latest, ``checkpoint.prev.pt`` the one before. Each file is
``MAGIC + sha256(body) + body`` with ``body`` a ``torch.save`` archive, written to a temporary file,
fsynced, then rotated in with ``os.replace``. Loading verifies the digest: a truncated or damaged
latest falls back to the previous one with a :class:`CheckpointWarning` naming both files; when no
checkpoint is readable, :class:`CheckpointError` names every file tried. See docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
MAGIC = b"feddg-checkpoint-v1\n"
_DIGEST = 32  # sha256 bytes


class CheckpointError(RuntimeError):
    """No readable checkpoint: every candidate file is truncated, damaged or not a checkpoint."""


class CheckpointWarning(UserWarning):
    """The latest checkpoint was unreadable and the previous one was used."""


def save_checkpoint(run_dir: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as ``run_dir/checkpoint.pt``; the former latest becomes ``checkpoint.prev.pt``."""
    run_dir = Path(run_dir)
    latest, tmp = run_dir / CHECKPOINT, run_dir / (CHECKPOINT + ".tmp")
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getbuffer()
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.sha256(body).digest())
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:  # a full disk: no half-written file left behind, and the path in the message
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"{err.strerror} while writing the checkpoint {latest} ({len(body):,} bytes); the "
                      f"previous checkpoint is intact") from None
    if latest.exists():
        os.replace(latest, run_dir / PREVIOUS)  # a crash right here leaves only the previous: load_checkpoint copes
    os.replace(tmp, latest)
    _fsync_dir(run_dir)
    return latest


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint file (latest or previous), readable or not."""
    return any((Path(run_dir) / name).is_file() for name in (CHECKPOINT, PREVIOUS))


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The newest readable checkpoint of ``run_dir``, or ``None`` if it has none.

    Raises :class:`CheckpointError` when checkpoint files exist but none can be read.
    """
    run_dir = Path(run_dir)
    latest, previous = run_dir / CHECKPOINT, run_dir / PREVIOUS
    if not previous.is_file():
        return read_checkpoint(latest) if latest.is_file() else None
    first = _read(latest) if latest.is_file() else "is missing (a crash between two renames)"
    if not isinstance(first, str):
        return first
    second = _read(previous)
    if isinstance(second, str):
        raise CheckpointError(f"no readable checkpoint: {latest} {first}; {previous} {second}")
    warnings.warn(f"{latest} {first}; resuming from the previous checkpoint {previous} (one checkpoint older)",
                  CheckpointWarning, stacklevel=2)
    return second


def read_checkpoint(path: Path) -> dict[str, Any]:
    """One checkpoint file, verified against its digest; :class:`CheckpointError` names the file and the problem."""
    payload = _read(Path(path))
    if isinstance(payload, str):
        raise CheckpointError(f"{path} {payload}")
    return payload


def _read(path: Path) -> dict[str, Any] | str:
    """The payload of ``path``, or what is wrong with it."""
    try:
        data = path.read_bytes()
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if data.startswith(MAGIC):
        digest, body = data[len(MAGIC) : len(MAGIC) + _DIGEST], memoryview(data)[len(MAGIC) + _DIGEST :]
        if len(digest) < _DIGEST or hashlib.sha256(body).digest() != digest:
            return "is damaged (checksum mismatch: truncated or overwritten)"
        source: io.BytesIO | Path = io.BytesIO(body)
    elif data.startswith(b"PK"):  # a plain torch.save archive from before checkpoints carried a digest
        source = path
    else:
        return f"is not a feddg checkpoint ({len(data)} bytes, unknown header)"
    try:
        return torch.load(source, weights_only=False)  # our own file: server/client states hold numpy arrays
    except Exception as err:
        lines = str(err).strip().splitlines()
        return f"cannot be loaded ({type(err).__name__}: {lines[0] if lines else 'no detail'})"


def _fsync_dir(path: Path) -> None:
    """Make the renames durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
