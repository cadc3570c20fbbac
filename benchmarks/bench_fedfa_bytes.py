"""FedFA+'s extra communication per client per round with AlexNet, measured from the messages (§6.1).

Usage: ``python benchmarks/bench_fedfa_bytes.py [--threads 1]``. Runs two rounds of FedFA+ (AlexNet,
five FFA layers, histograms at conv5) on a tiny Digits-DG subset, then prints the per-client bytes of
round 2 (the first round in which γ and π also travel down) next to the paper's arithmetic:

* statistics: ``4 × Σ_k C_k × 4 B = 4 × (64+192+384+256+256) × 4 B = 18 KB`` (μ̄, σ̄ up; γ_μ, γ_σ down)
* histograms: ``2 × L × C_K × 4 B = 2 × 8 × 256 × 4 B = 16 KB`` (π_m up, π down)
* weights: ``2 × 49.5 MB`` (up and down)
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from feddg.config import build_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.federation.setup import build_federation

KB, MB = 1024, 1024**2
ALEXNET_CHANNELS = (64, 192, 384, 256, 256)
PAPER = {
    "statistics": 4 * sum(ALEXNET_CHANNELS) * 4,
    "histograms": 2 * 8 * 256 * 4,
}


def measure() -> dict[str, float]:
    """Round-2 per-client byte metrics of a two-round FedFA+ run with AlexNet."""
    cfg = build_config(
        {
            "name": "bench-fedfa-bytes",
            "device": "cpu",
            "data": {"dataset": "digits-dg", "max_per_domain": 24},
            "split": {"target": "mnist"},
            "partition": {"kind": "by_domain", "num_clients": 3},
            "model": {"name": "alexnet"},
            "method": {"name": "fedfa", "params": {"lambda_h": 0.1}},
            "federation": {"rounds": 2, "batch_size": 8},
            "eval": {"every": 2},
        }
    )
    with tempfile.TemporaryDirectory() as run_dir:
        server = Server(build_federation(cfg), run_dir)
        run_inprocess(server)
    return server.metrics[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m = measure()
    rows = [
        ("statistics (μ̄,σ̄ up)", m["fedfa/bytes_stats_up"]),
        ("statistics (γ down)", m["fedfa/bytes_stats_down"]),
        ("histogram (π_m up)", m["fedfa/bytes_hist_up"]),
        ("histogram (π down)", m["fedfa/bytes_hist_down"]),
    ]
    print("FedFA+ / AlexNet, bytes per client in round 2 (arrays + key names, from the messages)")
    for name, value in rows:
        print(f"  {name:<24} {value:>10,.0f} B = {value / KB:6.2f} KB")
    stats = m["fedfa/bytes_stats_up"] + m["fedfa/bytes_stats_down"]
    hist = m["fedfa/bytes_hist_up"] + m["fedfa/bytes_hist_down"]
    print(f"  {'statistics, total':<24} {stats / KB:6.2f} KB   paper: {PAPER['statistics'] / KB:.1f} KB")
    print(f"  {'histograms, total':<24} {hist / KB:6.2f} KB   paper: {PAPER['histograms'] / KB:.1f} KB")
    weights = m["fedfa/bytes_weights_up"]
    print(f"  {'weights (one way)':<24} {weights / MB:6.2f} MB   paper: 49.5 MB")
    print(f"  extra / (weights up + down) = {m['fedfa/bytes_extra'] / (2 * weights):.2e}")


if __name__ == "__main__":
    main()
