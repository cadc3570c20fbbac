"""The privacy audit's section of a run's page (``RUN_DIR/audit/privacy.json`` and its grids, written by
``feddg audit privacy``): one table row per attack, attacker and noise multiplier, and the grids."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from feddg.audit.metrics import FID_NAME
from feddg.audit.privacy import PRIVACY_JSON
from feddg.audit.sweep import AUDIT_CSV, AUDIT_MD
from feddg.experiment import AUDIT_DIR
from feddg.reports.figures import png_uri
from feddg.reports.page import file_uri

COLUMNS = ("attack", "attacker", "z", "ε", "PSNR (chance)", "SSIM (chance)", FID_NAME, "re-id (chance)")


def _num(value: Any, fmt: str = ".3g") -> str:
    return "—" if value is None else format(value, fmt)


def _with_chance(row: dict[str, Any], key: str, fmt: str) -> str:
    """A score and, where the audit measured it (since 2026-11-28), its chance level in brackets."""
    chance = row.get(f"{key}_chance")
    return _num(row[key], fmt) + ("" if chance is None else f" ({_num(chance, fmt)})")


def audit_section(run_dir: Path) -> dict[str, Any] | None:
    """The table and grids of the run's audit, or ``None`` when it has none."""
    path = run_dir / AUDIT_DIR / PRIVACY_JSON
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    rows = []
    for r in record["rows"]:
        if r["attack"] == "gram":
            quality = (f"Procrustes err {_num(r['procrustes_rel_err'])}", "—", "—",
                       f"row |cos| {_num(r['row_cosine'], '.2f')} (top eigenvector {_num(r['row_cosine_top'], '.2f')}, "
                       f"random {_num(r['row_cosine_random'], '.2f')})")
        else:
            quality = (_with_chance(r, "psnr", ".1f"), _with_chance(r, "ssim", ".2f"), _num(r[FID_NAME], ".1f"),
                       f"{r['reid']:.2f} ({r['reid_chance']:.2f})")
        rows.append((r["attack"], r["attacker"], _num(r["noise_multiplier"], "g"), _num(r["epsilon"], ".3g"), *quality))
    grids = sorted({r["grid"] for r in record["rows"] if "grid" in r})
    caption = ("top row: the true image each reconstruction at the smallest z is scored against (its own, else the "
               "nearest of its victim's); below: the reconstructions at each z")
    return {"columns": COLUMNS, "rows": rows, "weights": record["weights"],
            "grids": [{"title": g, "uri": file_uri(run_dir / AUDIT_DIR / g), "caption": caption} for g in grids]}


def sweep_audit_section(sweep_dir: Path) -> dict[str, Any] | None:
    """A sweep's audit (audit.md / audit.csv, written by ``feddg sweep`` with ``audit:``): the table and PSNR
    against the noise multiplier, one line per variant, attack and attacker; ``None`` without one."""
    if not (sweep_dir / AUDIT_CSV).is_file():
        return None
    with (sweep_dir / AUDIT_CSV).open() as f:
        rows = [r for r in csv.DictReader(f) if r["psnr_mean"]]  # the Gram audit has no image to score
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        label = f"{r['variant']}: {r['attack']} ({r['attacker']})"
        lines.setdefault(label, []).append((float(r["z"]), float(r["psnr_mean"]), float(r["psnr_std"])))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, points in lines.items():
        z, mean, std = zip(*sorted(points), strict=True)
        ax.errorbar(z, mean, yerr=std, marker="o", capsize=3, label=label)
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set(xlabel="DP noise multiplier z (0: no DP)", ylabel="PSNR of the reconstruction (dB)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    figure = {"title": "attack quality against the noise", "uri": png_uri(fig),
              "caption": "mean over seeds, bars: sample std; each cell's audit/ has its grids"}
    return {"text": (sweep_dir / AUDIT_MD).read_text(), "figure": figure}
