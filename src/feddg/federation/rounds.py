"""Per-round randomness and schedules, derived from (seed, round, client) so resumes are exact."""

from __future__ import annotations

import math

import numpy as np
import torch


def derived_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (``np.random.SeedSequence``), stable across runs and engines."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def client_generator(seed: int, round: int, client_id: int) -> torch.Generator:
    """The random stream of one client in one round (shuffling, augmentation)."""
    return torch.Generator().manual_seed(derived_seed(seed, round, client_id))


def sample_clients(num_clients: int, fraction: float, seed: int, round: int) -> list[int]:
    """``max(1, round(fraction·K))`` distinct clients, sorted; all clients when fraction == 1."""
    if fraction >= 1.0:
        return list(range(num_clients))
    m = max(1, int(round_half_up(fraction * num_clients)))
    rng = np.random.default_rng(derived_seed(seed, round, 1_000_003))
    return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def learning_rate(base: float, schedule: str, round: int, rounds: int, step_size: int = 10, gamma: float = 0.1) -> float:
    """Client learning rate in 1-based ``round``: constant, cosine over ``rounds``, or step decay."""
    if schedule == "constant":
        return base
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * (round - 1) / rounds))
    if schedule == "step":
        return base * gamma ** ((round - 1) // step_size)
    raise ValueError(f"unknown lr schedule {schedule!r}; expected constant, cosine or step")
