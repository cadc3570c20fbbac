"""The privacy audit over a sweep's cells (``audit:`` in a sweep config): each cell's run audited after training
(skipped when its ``audit/privacy.json`` was written with the same settings), then ``audit.md`` and
``audit.csv`` in the sweep directory: every (variant, target, attack, attacker, z) row as mean ± sample std
over the seeds."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from feddg.audit.metrics import FID_NAME
from feddg.audit.privacy import PRIVACY_JSON
from feddg.config import AuditConfig
from feddg.experiment import AUDIT_DIR

#: (column, key in a privacy.json row): the inversions' scores, then the Gram audit's
METRICS = (("PSNR dB", "psnr"), ("PSNR chance", "psnr_chance"), ("SSIM", "ssim"), ("SSIM chance", "ssim_chance"),
           (FID_NAME, FID_NAME), ("re-id", "reid"), ("re-id chance", "reid_chance"),
           ("Procrustes err", "procrustes_rel_err"), ("row |cos|", "row_cosine"),
           ("top eigenvector |cos|", "row_cosine_top"))  # what the Gram's common direction alone gets
KEYS = ("variant", "target", "attack", "attacker", "z")
AUDIT_MD, AUDIT_CSV = "audit.md", "audit.csv"


def audit_is_current(run_dir: Path, settings: AuditConfig) -> bool:
    """``run_dir`` has an audit written with exactly ``settings``."""
    try:
        record = json.loads((run_dir / AUDIT_DIR / PRIVACY_JSON).read_text())
    except (OSError, ValueError):
        return False
    return bool(record.get("settings") == settings.model_dump(mode="json"))


def audit_cells(rows: Sequence[dict[str, Any]], settings: Sequence[AuditConfig | None],
                audit: Callable[[Path, AuditConfig], Path]) -> list[dict[str, Any]]:
    """Audit every cell whose config has ``audit:`` (``audit(run_dir, settings)``; current audits are reused) and
    return one row per cell, variant and audit row: the sweep's keys and the audit's scores."""
    out = []
    for row, s in zip(rows, settings, strict=True):
        if s is None:
            continue
        run_dir = Path(row["run_dir"])
        if not audit_is_current(run_dir, s):
            audit(run_dir, s)
        record = json.loads((run_dir / AUDIT_DIR / PRIVACY_JSON).read_text())
        for r in record["rows"]:
            out.append({"variant": row["variant"], "target": row["target"], "seed": row["seed"],
                        "attack": r["attack"], "attacker": r["attacker"], "z": r["noise_multiplier"],
                        "epsilon": r.get("epsilon"), **{key: r.get(key) for _, key in METRICS}})
    return out


def summarise(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (variant, target, attack, attacker, z) in first-seen order: the seeds, ε, and each metric's
    mean and sample std (ddof=1; 0 for one seed) over the seeds that have it."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault(tuple(c[k] for k in KEYS), []).append(c)
    out = []
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(KEYS, key, strict=True))
        row["seeds"] = len(members)
        row["epsilon"] = members[0]["epsilon"]
        for _, m in METRICS:
            values = np.array([c[m] for c in members if c[m] is not None], dtype=float)
            row[m] = (float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0) if len(values) else None
        out.append(row)
    return out


def _cell(value: tuple[float, float] | None, fmt: str) -> str:
    return "—" if value is None else f"{value[0]:{fmt}} ± {value[1]:{fmt}}"


def markdown(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a markdown table (metrics no row has are left out)."""
    present = [(name, key) for name, key in METRICS if any(r[key] is not None for r in summary)]
    head = ["variant", "target", "attack", "attacker", "z", "ε", "seeds", *(name for name, _ in present)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 5 + "---:|" * (len(head) - 5)]
    for r in summary:
        eps = "—" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
        cells = [str(r[k]) for k in KEYS[:4]] + [f"{r['z']:g}", eps, str(r["seeds"])]
        cells += [_cell(r[key], ".1f" if key in ("psnr", "psnr_chance", FID_NAME) else ".2f") for _, key in present]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_tables(out_dir: Path, summary: Sequence[dict[str, Any]], title: str) -> Path:
    """``audit.md`` (the table) and ``audit.csv`` (mean and std columns) in ``out_dir``; returns audit.md."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([*KEYS, "epsilon", "seeds", *(f"{key}_{s}" for _, key in METRICS for s in ("mean", "std"))])
    for r in summary:
        stats = [x for _, key in METRICS for x in (r[key] if r[key] is not None else ("", ""))]
        writer.writerow([*(r[k] for k in KEYS), "" if r["epsilon"] is None else r["epsilon"], r["seeds"], *stats])
    (out_dir / AUDIT_CSV).write_text(buf.getvalue())
    path = out_dir / AUDIT_MD
    path.write_text(f"# {title}: privacy audit\n\nmean ± sample std (ddof=1) over the seeds; each cell's "
                    f"{AUDIT_DIR}/{PRIVACY_JSON} has its grids\n\n{markdown(summary)}\n")
    return path
