"""Server memory of a FedAvg round: the streaming fold (O(model)) against the all-at-once list of replies.

Synthetic replies (no training) go through the method's fold — ``start``, ``accumulate`` one reply at a
time, ``finish``, as ``Server.receive`` drives it — or, all at once, into a list handed to
``Method.aggregate`` (what the server held before the fold). Peaks are tracemalloc's (numpy's buffers
are traced), above what was allocated before the round: the global model and the reply template.
"""

from __future__ import annotations

import math
import time
import tracemalloc
from pathlib import Path

import numpy as np
from rich.table import Table

from feddg.algorithms.base import Reply
from feddg.algorithms.registry import create_method
from feddg.messages import Message


def rss_mb(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` (the peak since the last :func:`reset_peak_rss`) of this process in MiB; NaN where
    /proc is missing."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return math.nan
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith(field + ":")), math.nan)


#: MiB by which ``VmHWM`` may still exceed ``VmRSS`` just after a reset (memory freed meanwhile by another thread)
RESET_SLACK_MB = 4.0


def reset_peak_rss() -> bool:
    """Start this process's ``VmHWM`` again from its ``VmRSS`` (Linux); False where that cannot be done: no
    writable /proc/self/clear_refs, or a kernel that takes the write and keeps the old peak (CI's machine showed an
    unchanged peak after a reset)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return rss_mb("VmHWM") - rss_mb("VmRSS") <= RESET_SLACK_MB


#: fractions of the parameters in each synthetic layer (a CNN-like spread: the largest layer is half)
LAYER_FRACTIONS = (0.02, 0.08, 0.15, 0.25, 0.5)


def synthetic_weights(params: int, seed: int = 0) -> Message:
    """A float32 ``w/`` message of about ``params`` parameters in five layers, plus an integer counter."""
    rng = np.random.default_rng(seed)
    out: Message = {f"w/layer{i}": rng.standard_normal(max(1, int(params * f))).astype(np.float32)
                    for i, f in enumerate(LAYER_FRACTIONS)}
    out["w/bn.num_batches_tracked"] = np.array(7, dtype=np.int64)
    return out


def model_bytes(weights: Message) -> int:
    return int(sum(np.asarray(v).nbytes for v in weights.values()))


def synthetic_reply(template: Message, k: int) -> Message:
    """Client ``k``'s reply: the template scaled by ``1 + k/1000``, ``100 + k % 50`` examples."""
    scale = np.float32(1 + k / 1000)
    arrays = {key: np.asarray(v) for key, v in template.items()}  # synthetic_weights: every value is an array
    w = {key: (a * scale).astype(a.dtype) if a.dtype.kind == "f" else a + k for key, a in arrays.items()}
    return {**w, "num_examples": 100 + k % 50, "train_loss": 0.0}


def examples(n_clients: int) -> int:
    return sum(100 + k % 50 for k in range(n_clients))


def streaming_fold(template: Message, n_clients: int) -> Message:
    """FedAvg's fold, one synthetic reply at a time (each reply is dropped once folded in)."""
    method = create_method("fedavg")
    state = {"weights": template}
    acc = method.start(examples(n_clients))
    for k in range(n_clients):
        acc = method.accumulate(acc, Reply(k, synthetic_reply(template, k)))
    return method.finish(state, acc)[0]["weights"]


def all_at_once(template: Message, n_clients: int) -> Message:
    """The old way: every reply in a list, then the aggregation."""
    replies = [Reply(k, synthetic_reply(template, k)) for k in range(n_clients)]
    return create_method("fedavg").aggregate({"weights": template}, replies)[0]["weights"]


def peak_extra_bytes(fold: str, template: Message, n_clients: int) -> tuple[int, float]:
    """tracemalloc's peak above the allocations before the round, and the seconds the round took."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    if fold == "streaming":
        streaming_fold(template, n_clients)
    else:
        all_at_once(template, n_clients)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    if not was_tracing:
        tracemalloc.stop()
    return peak, seconds


def memory_table(params: int, clients: list[int], max_list_bytes: float) -> list[dict[str, float | str]]:
    """One row per (fold, client count); the list is only allocated when it fits in ``max_list_bytes``
    (else its size, ``clients × model``, is computed: a lower bound of its peak)."""
    template = synthetic_weights(params)
    mb = model_bytes(template)
    rows: list[dict[str, float | str]] = []
    for n in clients:
        for fold in ("streaming", "all-at-once"):
            if fold == "all-at-once" and n * mb > max_list_bytes:
                rows.append({"fold": fold, "clients": n, "peak_mb": n * mb / 2**20, "models": float(n),
                             "seconds": float("nan"), "note": "computed (clients × model), not allocated"})
                continue
            peak, secs = peak_extra_bytes(fold, template, n)
            rows.append({"fold": fold, "clients": n, "peak_mb": peak / 2**20, "models": peak / mb,
                         "seconds": secs, "note": "measured"})
    return rows


def fold_memory_table(params: int, clients: list[int], max_list_mb: float) -> Table:
    """``feddg bench memory``: the rows of :func:`memory_table` (the list only up to ``max_list_mb`` MiB)."""
    t = Table(title=f"FedAvg round, {params:,}-parameter model: server peak above the global model (tracemalloc)")
    for col in ("fold", "clients", "peak MiB", "models", "s", "how"):
        t.add_column(col, justify="left" if col in ("fold", "how") else "right")
    for r in memory_table(params, clients, max_list_mb * 2**20):
        t.add_row(str(r["fold"]), str(r["clients"]), f"{r['peak_mb']:,.1f}", f"{r['models']:.1f}",
                  f"{r['seconds']:.1f}", str(r["note"]))
    return t
