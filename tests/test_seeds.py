"""Derived seeds: every key counts in its own place, stay what numpy's SeedSequence makes of the keys (a resumed
run redraws the same streams), fit their bit width; DP noise roots: the run's seed, or fresh 63-bit OS entropy."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from feddg.seeds import derived_seed, noise_seed


def test_a_derived_seed_is_the_halved_first_word_of_its_keys_seed_sequence():
    keys = (7, 12, 3, 1)
    seq = np.random.SeedSequence(list(keys))
    assert derived_seed(*keys) == int(seq.generate_state(2, dtype=np.uint64)[0]) // 2
    assert derived_seed(*keys, bits=31) == int(seq.generate_state(1)[0]) // 2
    with pytest.raises(ValueError, match="bits must be 63 or 31, got 32"):
        derived_seed(*keys, bits=32)


def test_every_key_changes_the_seed_in_its_own_place():
    base = (5, 17, 2, 1)  # seed, round, client, purpose (federation/client.py's method stream)
    bumped = [derived_seed(*base[:i], base[i] + 1, *base[i + 1:]) for i in range(len(base))]
    assert len({derived_seed(*base), *bumped}) == 5
    assert derived_seed(5, 17, 2, 1) != derived_seed(5, 17, 2)  # vs the client's data generator (rounds.py)


@pytest.mark.parametrize("bits", [63, 31])
def test_derived_seeds_fill_their_bit_width(bits: int):
    seeds = [derived_seed(k, bits=bits) for k in range(64)]
    assert all(0 <= s < 2**bits for s in seeds) and max(seeds) >= 2 ** (bits - 1)


def test_seeded_noise_is_rooted_in_the_run_seed_secret_noise_in_63_fresh_bits(monkeypatch: pytest.MonkeyPatch):
    assert noise_seed(5, "seeded") == 5
    drawn = [noise_seed(5, "secret") for _ in range(2)]
    assert len({5, *drawn}) == 3 and all(0 <= s < 2**63 for s in drawn)
    asked: list[int] = []
    monkeypatch.setattr(secrets, "randbits", lambda k: asked.append(k) or 2**k - 1)
    assert noise_seed(5, "secret") == 2**63 - 1 and asked == [63]
