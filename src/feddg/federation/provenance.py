"""What produced a run: ``provenance.json`` with the config hash, versions, git commit and machine.

``config_hash`` is the sha256 of the canonical JSON of the resolved config without the keys in
:data:`HASH_EXCLUDES`, which change where or how fast a run computes, or float summation order, but
not what it computes. Sweeps compare it to decide whether a finished cell still answers the current
config (docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

import feddg
from feddg.config import ConfigError, ExperimentConfig, build_config, read_yaml
from feddg.data.cache import resolve_cache_dir
from feddg.reproducibility import kernel_record

PROVENANCE = "provenance.json"
CONFIG = "config.yaml"  # the run's resolved config, written by federation/server.py

HASH_EXCLUDES = (
    "name",  # a label; the sweep's directory layout already separates names
    "output_dir",  # where, not what
    "data.cache_dir",  # where the built-in datasets are cached
    "data.loader_workers",  # DataLoader processes: the batches are the same for any value
    "device",  # cpu / cuda: float rounding only, like workers; provenance.json records the device used
    "reproducibility",  # which CPU kernels: float rounding only; provenance.json records the kernels used
    "federation.workers",  # sequential vs worker processes: float summation order only (docs/architecture.md)
    "federation.checkpoint_every",  # resumes are bit-identical whatever the checkpoint interval
    "federation.client_timeout_s",  # a time limit, not a computation
    "federation.client_state_budget_mb",  # where client state is kept (RAM or disk), not what it is: same bits
    "flower.client_num_cpus",  # Ray resources and time limits of the Flower engine; not flower.secure_aggregation,
    "flower.client_num_gpus",  # whose quantisation changes the aggregate (docs/flower.md, "Secure aggregation")
    "flower.ray_num_cpus",
    "flower.round_timeout_s",
    "flower.node_wait_s",
    "flower.roster",  # who each client is (which node proves its key), not what it computes
    "logging",  # copies of the metrics for TensorBoard / MLflow
    "audit",  # the privacy audit after training: post-processing of the run, not the run
)


def config_hash(cfg: ExperimentConfig) -> str:
    """sha256 (hex) of ``cfg`` without :data:`HASH_EXCLUDES`: equal hashes mean the same computation. The method's
    and the hierarchy's parameters are hashed resolved, defaults filled in: ``{}`` and the defaults written out are
    the same computation, and a changed default changes the hash."""
    from feddg.aggregation.merges import HFedATMParams  # every hierarchy key (config.py: _hierarchy_fits)
    from feddg.algorithms.registry import method_class

    tree = cfg.model_dump(mode="json")
    tree["method"]["params"] = method_class(cfg.method.name).Params(**cfg.method.params).model_dump(mode="json")
    if cfg.hierarchy is not None:
        tree["hierarchy"]["params"] = HFedATMParams(**cfg.hierarchy.params).model_dump(mode="json")
    if cfg.flower.secure_aggregation == "none":  # SecAgg+'s settings change nothing without it
        tree["flower"].pop("secaggplus", None)
    for dotted in HASH_EXCLUDES:
        *parents, leaf = dotted.split(".")
        node = tree
        for p in parents:
            node = node.get(p) or {}
        node.pop(leaf, None)
    canonical = json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def input_paths(cfg: ExperimentConfig) -> dict[str, str]:
    """The files and folders a run of ``cfg`` reads beside its config, by config key."""
    named = {"data.root": cfg.data.root, "data.tokenizer": cfg.data.tokenizer, "model.weights": cfg.model.weights,
             "model.path": cfg.model.path, **{f"eval.extra.{e.name}.root": e.root for e in cfg.eval.extra}}
    return {key: path for key, path in named.items() if path}


def inputs_stamp(cfg: ExperimentConfig) -> dict[str, str]:
    """Per input path (:func:`input_paths`): sha256 over every file under it of its relative path, size and
    modification time (``"missing"`` where nothing is). The config hash covers the paths, this their content: a
    sweep reruns a cell whose data or weights were rewritten in place."""
    cache = resolve_cache_dir(cfg.data.cache_dir).resolve()  # feddg's own writes, should it lie under a root
    out = {}
    for key, path in input_paths(cfg).items():
        root = Path(path).expanduser()
        files = ([root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file()
                                                      and not f.resolve().is_relative_to(cache))
                 if root.is_dir() else [])
        h = hashlib.sha256()
        for f in files:
            st = f.stat()
            h.update(f"{f.relative_to(root) if f != root else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        out[key] = h.hexdigest() if files else "missing"
    return out


def provenance(cfg: ExperimentConfig) -> dict[str, Any]:
    """The provenance record of a run of ``cfg`` started now, on this machine."""
    return {
        "config_hash": config_hash(cfg),
        "inputs": inputs_stamp(cfg),
        "hash_excludes": list(HASH_EXCLUDES),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "feddg": feddg.__version__,
        **git_state(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "flwr": _version("flwr"),
        "platform": platform.platform(),
        "machine": {"cpus": os.cpu_count(), "device": _device(cfg.device), "hostname": socket.gethostname()},
        "reproducibility": kernel_record(cfg.reproducibility),
        "command": sys.argv,
        "resumed": [],
    }


def write_provenance(run_dir: str | Path, cfg: ExperimentConfig) -> Path:
    """Write ``run_dir/provenance.json`` for a fresh run of ``cfg``."""
    return _write(Path(run_dir) / PROVENANCE, provenance(cfg))


#: a resumed run's hash when it is not what a fresh run of its config computes: equal to no config's
CHANGED_ON_RESUME = "changed-on-resume:"


def record_resume(run_dir: str | Path, cfg: ExperimentConfig, overrides: list[str], same_as_fresh: bool = True) -> None:
    """Note a resume (when, with which feddg, which overrides) in ``provenance.json``. The hash follows ``cfg`` where
    the resumed run is what a fresh run of ``cfg`` computes (``same_as_fresh``), else it is marked so that no sweep
    takes the run for one of ``cfg`` (an ``eval.every`` changed on resume, an extension whose old last round was not
    due for evaluation)."""
    path = Path(run_dir) / PROVENANCE
    record = _read(path)
    if record is None:
        return  # a run from before provenance.json: its config.yaml is re-hashed instead
    marked = str(record.get("config_hash", "")).startswith(CHANGED_ON_RESUME)
    record["config_hash"] = config_hash(cfg) if same_as_fresh and not marked else CHANGED_ON_RESUME + config_hash(cfg)
    record.setdefault("resumed", []).append(
        {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "overrides": overrides, "feddg": feddg.__version__, **git_state(),
         "torch": torch.__version__, "numpy": np.__version__,
         "machine": {"cpus": os.cpu_count(), "device": _device(cfg.device), "hostname": socket.gethostname()},
         "reproducibility": kernel_record(cfg.reproducibility)}
    )
    _write(path, record)


def record_nodes(run_dir: str | Path, after_round: int, clients: dict[int, dict[str, Any]], refused: list[str]) -> None:
    """Note in ``provenance.json`` who took part in a Flower run from ``after_round`` on (0: its start; a resume adds
    another entry): per client its node and how it was identified (a roster name and key, or a declared partition),
    and the nodes refused on the way. The record a consortium signs off: which sites trained the model."""
    path = Path(run_dir) / PROVENANCE
    record = _read(path)
    if record is None:
        return  # a run from before provenance.json
    record.setdefault("flower_nodes", []).append(
        {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "after_round": after_round,
         "clients": {str(cid): clients[cid] for cid in sorted(clients)}, "refused": refused})
    _write(path, record)


def changed_inputs(run_dir: str | Path, cfg: ExperimentConfig) -> list[str]:
    """The input paths (:func:`inputs_stamp`) whose files changed since the run in ``run_dir`` recorded them (none
    for a run from before the record)."""
    record = _read(Path(run_dir) / PROVENANCE) or {}
    stored = record.get("inputs")
    if not isinstance(stored, dict):
        return []
    now = inputs_stamp(cfg)
    return sorted(k for k in set(stored) | set(now) if stored.get(k) != now.get(k))


def stored_config_hash(run_dir: str | Path) -> str | None:
    """The config hash a run directory was computed for: provenance.json's, else config.yaml re-hashed."""
    run_dir = Path(run_dir)
    record = _read(run_dir / PROVENANCE)
    if record is not None and isinstance(record.get("config_hash"), str):
        return record["config_hash"]
    if not (run_dir / CONFIG).is_file():
        return None
    try:  # device is not hashed: pin it so a CUDA run's config also validates on a machine without CUDA
        return config_hash(build_config(read_yaml(run_dir / CONFIG), ["device=cpu"]))
    except ConfigError:
        return None


def git_state() -> dict[str, Any]:
    """``git_commit`` and ``git_dirty`` of the feddg source tree; ``None`` outside a git checkout of feddg."""
    src = Path(feddg.__file__).parent
    tracked = _git(src, "ls-files", "--error-unmatch", "__init__.py")  # not some enclosing repository's commit
    commit = _git(src, "rev-parse", "HEAD") if tracked is not None else None
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": bool(_git(src, "status", "--porcelain", "--untracked-files=no", "."))}


def _git(cwd: Path, *args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _device(name: str) -> str:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and torch.cuda.is_available():
        return f"{name} ({torch.cuda.get_device_name(torch.device(name))})"
    return name


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write(path: Path, record: dict[str, Any]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path
