"""Per-round randomness and schedules, derived from (seed, round, client) so resumes are exact."""

from __future__ import annotations

import math

import numpy as np
import torch

from feddg.seeds import derived_seed


def client_generator(seed: int, round: int, client_id: int) -> torch.Generator:
    """The random stream of one client in one round (shuffling, augmentation)."""
    return torch.Generator().manual_seed(derived_seed(seed, round, client_id))


def sample_size(n: int, fraction: float) -> int:
    """How many of ``n`` members :func:`sample_members` draws: ``max(1, round_half_up(fraction·n))``, all of them
    when fraction >= 1."""
    return n if fraction >= 1.0 else max(1, round_half_up(fraction * n + 1e-9))  # 0.35 · 90 is 31.4999…: 32


def sample_members(members: np.ndarray, fraction: float, rng: np.random.Generator) -> list[int]:
    """:func:`sample_size` distinct ``members``, sorted, drawn without replacement; all of them when fraction >= 1.
    The one sampler of every topology (clients of a flat federation, stations, a station's clients)."""
    if fraction >= 1.0:
        return sorted(int(c) for c in members)
    return sorted(int(c) for c in rng.choice(members, size=sample_size(len(members), fraction), replace=False))


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def learning_rate(base: float, schedule: str, round: int, rounds: int, step_size: int = 10, gamma: float = 0.1,
                  warmup: int = 0) -> float:
    """Client learning rate in 1-based ``round``: with ``warmup`` k, ``base · r / (k + 1)`` for rounds r ≤ k, then
    constant, cosine over the remaining ``rounds − k``, or step decay counted from the end of the warm-up."""
    if round <= warmup:
        return base * round / (warmup + 1)
    round, rounds = round - warmup, max(rounds - warmup, 1)
    if schedule == "constant":
        return base
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * (round - 1) / rounds))
    if schedule == "step":
        return base * gamma ** ((round - 1) // step_size)
    raise ValueError(f"unknown lr schedule {schedule!r}; expected constant, cosine or step")
