import math

import pytest

from feddg.federation.rounds import client_generator, learning_rate
from feddg.federation.topology import Topology
from feddg.seeds import derived_seed


def sample_clients(num_clients, fraction, seed, round):
    return Topology(num_clients).sample(round, fraction, seed)


def test_sampling_is_seeded_sized_and_distinct():
    a = sample_clients(100, 0.2, seed=3, round=5)
    assert a == sample_clients(100, 0.2, seed=3, round=5)
    assert len(a) == 20 and len(set(a)) == 20 and a == sorted(a)
    assert a != sample_clients(100, 0.2, seed=3, round=6)
    assert a != sample_clients(100, 0.2, seed=4, round=5)  # the seed enters the draw
    assert sample_clients(10, 1.0, 0, 1) == list(range(10))
    assert len(sample_clients(3, 0.01, 0, 1)) == 1


def test_derived_seeds_differ_per_key_and_generators_repeat():
    assert derived_seed(0, 1, 2) != derived_seed(0, 2, 1)
    g1, g2 = client_generator(0, 1, 2), client_generator(0, 1, 2)
    assert g1.initial_seed() == g2.initial_seed() == derived_seed(0, 1, 2)
    others = [client_generator(*keys).initial_seed() for keys in ((0, 2, 2), (0, 1, 3), (1, 1, 2))]
    assert len({g1.initial_seed(), *others}) == 4  # seed, round and client each change the stream


def test_learning_rate_schedules():
    assert learning_rate(0.1, "constant", 7, 10) == 0.1
    assert learning_rate(0.1, "cosine", 1, 10) == pytest.approx(0.1)
    assert learning_rate(0.1, "cosine", 6, 10) == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(0.1, "step", 10, 30, step_size=10, gamma=0.5) == pytest.approx(0.1)
    assert learning_rate(0.1, "step", 11, 30, step_size=10, gamma=0.5) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        learning_rate(0.1, "warmup", 1, 10)


def test_31_bit_seeds_fit_and_differ_from_63_bit_ones():
    assert 0 <= derived_seed(4, 2, bits=31) < 2**31 and derived_seed(4, 2, bits=31) != derived_seed(4, 2)
    assert 2**31 <= max(derived_seed(k) for k in range(8)) < 2**63
