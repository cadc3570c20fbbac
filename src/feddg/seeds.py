"""Seeds derived from integer keys (seed, round, client, purpose...), so every random stream is
reproducible on its own: resumes, engines and worker processes see the same draws. The one exception is the DP
noise under ``dp_noise: secret`` (:func:`noise_seed`), which must not be reproducible from the config."""

from __future__ import annotations

import secrets

import numpy as np


def derived_seed(*keys: int, bits: int = 63) -> int:
    """A ``bits``-bit seed (63 or 31) from integer keys via ``np.random.SeedSequence``.

    SeedSequence pads its keys with zeros, so ``(s, a)`` and ``(s, a, 0)`` give one seed: the model's init stream
    ``(seed, 23)`` (torch) is client 0's round-23 data stream ``(seed, 23, 0)`` (torch); setup's numpy streams 17,
    29, 31 and 37 share their seeds with client 0's rounds 17, 29, 31 and 37 but draw with another generator. Kept:
    another derivation would change every stream of every existing run (resumes, golden tests)."""
    seq = np.random.SeedSequence([int(k) for k in keys])
    if bits == 63:
        return int(seq.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))
    if bits == 31:
        return int(seq.generate_state(1)[0] >> 1)
    raise ValueError(f"bits must be 63 or 31, got {bits}")


def noise_seed(seed: int, dp_noise: str) -> int:
    """The root of a run's DP noise streams: its ``seed`` (``dp_noise: seeded``: anyone holding config.yaml can
    redraw and subtract the noise) or a fresh 63-bit key from the OS's entropy, written nowhere (``secret``)."""
    return seed if dp_noise == "seeded" else secrets.randbits(63)
