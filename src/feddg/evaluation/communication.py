"""A run's communication per round, from its metrics rows (results.json's ``bytes_per_round``, the report's table)."""

from __future__ import annotations

from typing import Any


def bytes_per_round(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Every byte count of metrics ``rows`` (engine totals, methods' own such as ``fedfa/bytes_stats_up``) summed
    and divided by the rounds: a round without the key sent none of it (a hierarchy's station traffic happens at
    server-round ends only; its mean over those rounds alone read as twice the traffic per round at N = 2)."""
    keys = sorted({k for r in rows for k in r if "bytes" in k})  # no rows: no keys
    return {k: float(sum(r.get(k, 0) for r in rows)) / len(rows) for k in keys}
