import numpy as np
import pytest

from feddg.aggregation.mean import weighted_mean, weighted_mean_messages


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
