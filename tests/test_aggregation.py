import tracemalloc

import numpy as np
import pytest

from feddg.aggregation.mean import CHUNK, weighted_mean, weighted_mean_messages


def test_weighted_mean_matches_hand_computation():
    a, b = np.array([0.0, 3.0], np.float32), np.array([6.0, 0.0], np.float32)
    out = weighted_mean([a, b], [1, 2])  # (1·a + 2·b) / 3
    np.testing.assert_allclose(out, [4.0, 1.0])
    assert out.dtype == np.float32


def test_integer_buffers_are_rounded_means():
    out = weighted_mean([np.array(10, np.int64), np.array(13, np.int64)], [1, 1])
    assert out.dtype == np.int64 and int(out) == 12  # 11.5 rounds to even


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
