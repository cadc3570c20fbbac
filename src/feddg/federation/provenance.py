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
    """sha256 (hex) of ``cfg`` without :data:`HASH_EXCLUDES`: equal hashes mean the same computation."""
    tree = cfg.model_dump(mode="json")
    for dotted in HASH_EXCLUDES:
        *parents, leaf = dotted.split(".")
        node = tree
        for p in parents:
            node = node.get(p) or {}
        node.pop(leaf, None)
    canonical = json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def provenance(cfg: ExperimentConfig) -> dict[str, Any]:
    """The provenance record of a run of ``cfg`` started now, on this machine."""
    return {
        "config_hash": config_hash(cfg),
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


def record_resume(run_dir: str | Path, cfg: ExperimentConfig, overrides: list[str]) -> None:
    """Note a resume (when, with which feddg, which overrides) in ``provenance.json``; the hash follows ``cfg``."""
    path = Path(run_dir) / PROVENANCE
    record = _read(path)
    if record is None:
        return  # a run from before provenance.json: its config.yaml is re-hashed instead
    record["config_hash"] = config_hash(cfg)
    record.setdefault("resumed", []).append(
        {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "overrides": overrides, "feddg": feddg.__version__, **git_state(),
         "reproducibility": kernel_record(cfg.reproducibility)}
    )
    _write(path, record)


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
