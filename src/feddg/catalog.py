"""What ``feddg methods`` lists: every client method and station merge with its hyper-parameters.

Listing means importing every method module, and with it torch (seconds). The listing is therefore
cached as JSON in feddg's cache folder under a digest of the contents of all of feddg's source files
and the feddg, Python and pydantic versions: an edited source (anywhere in the package) gives another
digest and rebuilds it, so a cached listing is never stale, and a warm call imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, get_args

import pydantic

import feddg

PACKAGE = Path(feddg.__file__).resolve().parent
Catalog = dict[str, Any]  # {"methods": [[name, params]], "merges": [[name, what]], "hierarchy": params,
#                            "augmentations": [[name, params]]}
KEYS = {"methods", "merges", "hierarchy", "augmentations"}
KEEP = 16  # listings kept (the newest): checkouts and versions sharing the cache folder each keep theirs


def user_cache_dir() -> Path:
    """``$FEDDG_CACHE``, else ``~/.cache/feddg``: ``feddg.data.cache.resolve_cache_dir()``, without importing
    ``feddg.data`` (which imports torch)."""
    env = os.environ.get("FEDDG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "feddg"


def source_digest(root: Path) -> str:
    """sha256 of the versions and of every ``*.py`` under ``root`` (relative path, length, contents)."""
    h = hashlib.sha256(f"feddg {feddg.__version__}; python {sys.version}; pydantic {pydantic.VERSION}".encode())
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        h.update(f"\0{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _defaults(params: type[pydantic.BaseModel], skip: str = "") -> str:
    return ", ".join(f"{k}={f.default}" for k, f in params.model_fields.items() if k != skip)


def build_catalog() -> Catalog:
    """The listing from the registry itself (imports every method, hence torch)."""
    from feddg.aggregation.merges import MERGES, HFedATMParams
    from feddg.algorithms.components.augment import AUGMENTATIONS
    from feddg.algorithms.registry import list_methods, method_class, method_label

    merges = []
    for name, merge in sorted(MERGES.items()):
        parts = ["FOT alignment (eqs. 2–6)"] * merge.uses_alignment
        parts += ["RegMean of linear layers (eqs. 8–12)"] * merge.uses_grams
        merges.append([name, " + ".join(parts) or "γ-weighted mean of the station models (HFedAvg)"])
    augmentations = [[get_args(spec.model_fields["name"].annotation)[0], _defaults(spec, skip="name")]
                     for spec in AUGMENTATIONS]  # each spec's name is a Literal of its one name
    return {"methods": [[method_label(name), _defaults(method_class(name).Params)] for name in list_methods()],
            "merges": merges, "hierarchy": _defaults(HFedATMParams), "augmentations": augmentations}


def catalog(cache_dir: Path | None = None, root: Path | None = None) -> Catalog:
    """The listing: read from ``cache_dir/methods/`` (default: :func:`user_cache_dir`) when cached for these
    sources (default: :data:`PACKAGE`), else built and cached there; an unwritable folder only skips the caching."""
    folder = (cache_dir if cache_dir is not None else user_cache_dir()) / "methods"
    path = folder / f"{source_digest(root or PACKAGE)[:32]}.json"
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and set(cached) == KEYS:
            return cached
    except (OSError, ValueError):
        pass
    listing = build_catalog()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(listing))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        for old in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-KEEP]:
            old.unlink(missing_ok=True)
    except OSError:
        pass
    return listing
