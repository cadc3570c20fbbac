"""How many samples stand behind each per-domain accuracy of a run (results.json does not store them).

The run's split and partition are rebuilt from its config.yaml — the same seeds give the same
indices — without building the model or the method.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from feddg.config import ConfigError, ExperimentConfig, build_config, read_yaml
from feddg.federation.setup import load_data, make_clients, make_split


def sample_counts(cfg: ExperimentConfig) -> tuple[dict[str, int], int]:
    """``{"id_acc/<domain>": n, "ood_acc/<domain>": n, "val_acc/<domain>": n}`` and the number of classes.

    id: the union of the clients' holdouts; ood / val: the held-out domains' samples (few-shot
    samples given to clients excluded), as the server evaluates them.
    """
    ds = load_data(cfg)
    split = make_split(ds, cfg)
    holdout = np.concatenate([c.holdout_idx for c in make_clients(ds, split, cfg)])
    counts: dict[str, int] = {}
    for role, idx in (("id_acc", holdout), ("ood_acc", split.test_idx), ("val_acc", split.val_idx)):
        doms, n = np.unique(ds.domain_ids[idx], return_counts=True)
        counts.update({f"{role}/{ds.domains[int(k)]}": int(c) for k, c in zip(doms, n)})
    return counts, ds.num_classes


def counts_for(keys: list[str], counts: dict[str, int]) -> dict[str, int]:
    """``counts`` under the run's own keys: ``global_ood_acc/x`` counts as ``ood_acc/x``."""
    return {k: counts[k.removeprefix("global_")] for k in keys if k.removeprefix("global_") in counts}


def run_counts(run_dir: Path) -> tuple[dict[str, int], int | None, list[str]]:
    """Samples per accuracy key and classes, rebuilt from config.yaml; notes say why when that fails."""
    try:
        return (*sample_counts(build_config(read_yaml(run_dir / "config.yaml"))), [])
    except (ConfigError, FileNotFoundError, ValueError, OSError) as err:
        return {}, None, [f"sample counts and chance level unavailable: {err}"]
