"""HFedATM Table 3 from finished runs: time per server round with Avg vs HFedATM, per client method."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def sweep_results(out_dir: str | Path) -> list[dict[str, Any]]:
    """The results.json of every run of a finished ``feddg sweep`` (listed in its runs.jsonl)."""
    rows = [json.loads(line) for line in (Path(out_dir) / "runs.jsonl").read_text().splitlines() if line]
    return [json.loads((Path(r["run_dir"]) / "results.json").read_text()) for r in rows]


def overhead_table(results: Sequence[dict[str, Any]]) -> str:
    """Paper Table 3 from runs' results.json: mean time per server round with Avg vs HFedATM and the
    increase, per client method (runs with other merges are ignored). For a sweep:
    ``overhead_table(sweep_results("runs/hfedatm-digits-table"))``."""
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    for res in results:
        h = res.get("hierarchy")
        if h and h["merge"] in ("avg", "hfedatm") and "time_s" in h["per_server_round"]:
            times[(h["client_method"], h["merge"])].append(h["per_server_round"]["time_s"])
    lines = ["| client method | Avg (s/round) | HFedATM (s/round) | increase (%) |", "|---|---|---|---|"]
    for method in dict.fromkeys(m for m, _ in times):
        avg, atm = np.mean(times.get((method, "avg"), [np.nan])), np.mean(times.get((method, "hfedatm"), [np.nan]))
        lines.append(f"| {method} | {avg:.3f} | {atm:.3f} | {100 * (atm - avg) / avg:.1f} |")
    return "\n".join(lines)
