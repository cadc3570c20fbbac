import tracemalloc

import numpy as np
import pytest

from feddg.aggregation.mean import CHUNK, WeightedSum, weighted_mean, weighted_mean_messages


def test_weighted_mean_matches_hand_computation():
    a, b = np.array([0.0, 3.0], np.float32), np.array([6.0, 0.0], np.float32)
    out = weighted_mean([a, b], [1, 2])  # (1·a + 2·b) / 3
    np.testing.assert_allclose(out, [4.0, 1.0])
    assert out.dtype == np.float32


def test_integer_buffers_are_rounded_means():
    out = weighted_mean([np.array(10, np.int64), np.array(13, np.int64)], [1, 1])
    assert type(out) is np.int64 and int(out) == 12  # a numpy scalar, as WeightedSum gives it; 11.5 rounds to even


def test_message_mean_uses_only_prefixed_keys_and_checks_agreement():
    m1 = {"w/x": np.ones(2), "num_examples": 1}
    m2 = {"w/x": 3 * np.ones(2), "num_examples": 3}
    out = weighted_mean_messages([m1, m2], [1, 3], "w/")
    assert set(out) == {"w/x"}
    np.testing.assert_allclose(out["w/x"], 2.5)
    with pytest.raises(KeyError):
        weighted_mean_messages([m1, {"w/y": np.ones(2)}], [1, 1], "w/")


@pytest.mark.parametrize("w", [[0, 0], [-1, 2], []])
def test_bad_weights_rejected(w):
    with pytest.raises(ValueError):
        weighted_mean([np.ones(1)] * len(w) or [np.ones(1)], w)


def test_weighted_mean_holds_a_few_chunks_of_float64_beyond_its_result_not_a_float64_copy():
    arrays = [np.full(1 << 20, k, np.float32) for k in range(3)]  # 4 MiB each; a float64 sum of them is 8 MiB
    tracemalloc.start()  # numpy reports its data allocations to tracemalloc
    try:
        out = weighted_mean(arrays, [1, 1, 2])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(out, np.full(1 << 20, 1.25, np.float32))  # (0 + 1 + 2·2) / 4
    assert peak < out.nbytes + 4 * CHUNK * 8, f"peak {peak} bytes"


def test_weighted_sum_folds_the_weighted_mean_rounds_counts_and_rescales_a_short_round():
    fold = WeightedSum("w/", expected=4.0)  # two clients of weight 1 and 3 expected
    fold.add({"w/x": np.array([0.0, 4.0], np.float32), "w/n": np.array(10, np.int64), "loss": 9.0}, 1)
    fold.add({"w/x": np.array([4.0, 0.0], np.float32), "w/n": np.array(13, np.int64), "loss": 9.0}, 3)
    out = fold.mean()
    assert set(out) == {"w/x", "w/n"} and out["w/x"].dtype == np.float32 and out["w/n"].dtype == np.int64
    np.testing.assert_allclose(out["w/x"], [3.0, 1.0])  # (1·a + 3·b) / 4
    assert int(out["w/n"]) == 12  # (10 + 3·13) / 4 = 12.25, rounded
    short = WeightedSum("w/", expected=4.0)  # only the first client (weight 1) replied: its own values
    short.add({"w/x": np.array([0.0, 4.0], np.float32), "w/n": np.array(11, np.int64)}, 1)
    np.testing.assert_allclose(short.mean()["w/x"], [0.0, 4.0])
    assert int(short.mean()["w/n"]) == 11
    half = WeightedSum("w/", expected=2.0)  # 11.5 rounds to even, not truncated
    for n in (10, 13):
        half.add({"w/n": np.array(n, np.int64)}, 1)
    assert int(half.mean()["w/n"]) == 12


def test_weighted_sum_refuses_bad_weights_and_disagreeing_keys():
    with pytest.raises(ValueError, match="expected total weight"):
        WeightedSum("w/", expected=0.0)
    fold = WeightedSum("w/")
    with pytest.raises(ValueError, match="non-negative"):
        fold.add({"w/x": np.ones(1)}, -0.5)
    fold.add({"w/x": np.ones(1)}, 1)
    with pytest.raises(KeyError, match="disagree"):
        fold.add({"w/y": np.ones(1)}, 1)
    with pytest.raises(ValueError, match="positive sum"):
        WeightedSum("w/").mean()
