"""On-disk cache of built datasets: where it lives, and atomic ``.npz`` save/load."""

from __future__ import annotations

import glob
import os
import socket
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import numpy as np

Arrays = dict[str, np.ndarray]


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir`` if given, else ``$FEDDG_CACHE``, else ``~/.cache/feddg``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("FEDDG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "feddg"


def cache_file(cache_dir: Path, *parts: object) -> Path:
    """``cache_dir/<part1>_<part2>_....npz``, each part made file-name safe (``+90%`` -> ``%2B90%25``)."""
    return cache_dir / ("_".join(quote(str(p), safe="") for p in parts) + ".npz")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def temporary_beside(path: Path) -> tuple[int, str]:
    """``mkstemp`` in ``path``'s folder, named ``<stem>.<host>.<pid>.<random>.tmp``; first removes the temporaries
    that a killed build of ``path`` on this host left (their process is gone), which ``try``/``finally`` cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().replace(".", "_")
    for old in path.parent.glob(f"{glob.escape(path.stem)}.{glob.escape(host)}.*.tmp"):
        pid = old.name[len(path.stem) + len(host) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            old.unlink(missing_ok=True)
    return tempfile.mkstemp(prefix=f"{path.stem}.{host}.{os.getpid()}.", suffix=".tmp", dir=path.parent)


@contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` (:func:`temporary_beside`) for the block to write; it replaces ``path``
    (``os.replace``) when the block ends, and is removed when it raises (Ctrl-C included)."""
    fd, tmp = temporary_beside(path)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_arrays(path: Path, arrays: Arrays) -> None:
    """Write ``arrays`` to ``path`` atomically: a temporary file in the same folder, then ``os.replace``."""
    with replaced_atomically(path) as tmp, tmp.open("wb") as f:
        np.savez_compressed(f, **arrays)  # type: ignore[arg-type]  # numpy's stub matches **arrays to allow_pickle


def load_arrays(path: Path, keys: tuple[str, ...]) -> Arrays | None:
    """The arrays stored at ``path``; ``None`` if it is missing, unreadable or lacks one of ``keys``."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in keys}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None


def cached(path: Path, keys: tuple[str, ...], build: Callable[[], Arrays]) -> Arrays:
    """Load ``path``, or (if missing or corrupt) ``build()`` the arrays and save them there."""
    arrays = load_arrays(path, keys)
    if arrays is None:
        arrays = build()
        save_arrays(path, arrays)
    return arrays
