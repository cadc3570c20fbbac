"""The attacker's vector-to-image generator (PARDON §IV-B3, docs/privacy.md): its standardisation by the attacker's own
vectors, its output range and size, and its training as Adam on MSE over random batches of the attacker's pairs."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from feddg.audit.generator import VectorGenerator, invert, train_generator

RNG = np.random.default_rng(0)
IMAGES = RNG.uniform(size=(6, 1, 4, 4))
VECTORS = RNG.standard_normal((6, 3)) * np.array([1.0, 5.0, 0.1]) + np.array([2.0, -1.0, 0.0])


def test_vectors_are_standardised_by_the_attackers_mean_and_population_std() -> None:
    gen = train_generator(IMAGES, VECTORS, steps=0)
    np.testing.assert_allclose(gen.v_mean.numpy(), VECTORS.mean(0), rtol=1e-6)
    np.testing.assert_allclose(gen.v_std.numpy(), VECTORS.std(0), rtol=1e-6)  # ddof 0
    # the network sees (v − μ) / σ: a generator with identity buffers, fed the standardised vectors, agrees
    plain = VectorGenerator(3, 1, 4, 4)
    plain.load_state_dict({**gen.state_dict(), "v_mean": torch.zeros(3), "v_std": torch.ones(3)})
    z = torch.as_tensor((VECTORS - VECTORS.mean(0)) / VECTORS.std(0), dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(invert(gen, VECTORS), plain(z).double().numpy(), rtol=1e-5, atol=1e-6)


def test_a_single_pair_is_centred_but_not_divided_by_its_zero_spread() -> None:
    gen = train_generator(IMAGES[:1], VECTORS[:1], steps=0)
    np.testing.assert_allclose(gen.v_mean.numpy(), VECTORS[0], rtol=1e-6)
    assert gen.v_std.tolist() == [1.0, 1.0, 1.0]  # not 1e-6: a victim's vector 1 away would land 1e6 away


def test_images_are_in_0_1_at_the_requested_odd_size_for_any_vector() -> None:
    gen = train_generator(RNG.uniform(size=(4, 3, 7, 5)), VECTORS[:4], steps=0)
    out = invert(gen, 1e4 * RNG.standard_normal((5, 3)))  # far outside the attacker's vectors: saturated
    assert out.shape == (5, 3, 7, 5) and out.dtype == np.float64
    assert out.min() >= 0.0 and out.max() <= 1.0 and ((out == 0.0) | (out == 1.0)).any()


def test_training_is_adam_on_the_mse_of_seeded_random_batches() -> None:
    steps, batch, lr, seed = 3, 4, 1e-2, 5
    gen = train_generator(IMAGES, VECTORS, steps=steps, batch=batch, lr=lr, seed=seed)
    # the same loop from torch's parts: initial weights and batch draws from the seed, a fresh gradient each step
    torch.manual_seed(seed)
    ref = VectorGenerator(3, 1, 4, 4)
    ref.v_mean.copy_(torch.as_tensor(VECTORS.mean(0)))
    ref.v_std.copy_(torch.as_tensor(VECTORS.std(0)))
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    rng = torch.Generator().manual_seed(seed)
    x, v = torch.as_tensor(IMAGES, dtype=torch.float32), torch.as_tensor(VECTORS, dtype=torch.float32)
    for _ in range(steps):
        pick = torch.randint(6, (batch,), generator=rng)
        opt.zero_grad()
        F.mse_loss(ref(v[pick]), x[pick]).backward()
        opt.step()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(gen.get_parameter(name), p, rtol=1e-4, atol=1e-6, msg=name)
    assert not gen.training  # returned ready to invert


def test_pairs_must_match_and_be_non_empty() -> None:
    with pytest.raises(ValueError, match="as many vectors as images"):
        train_generator(IMAGES, VECTORS[:5])
    with pytest.raises(ValueError, match="as many vectors as images"):
        train_generator(IMAGES[:0], VECTORS[:0])
