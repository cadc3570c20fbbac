"""The robust rules of feddg.aggregation.robust on hand-made messages: which keys they combine, the dtypes they give
back, float64 arithmetic, trimming nothing, and Krum's nearest-neighbour count and ``keep`` bounds when replies are few.
(tests/test_integrity.py has the rules' values on five one-number clients and their agreement with Flower's.)"""

import numpy as np
import pytest

from feddg.aggregation.robust import coordinate_median, krum_scores, krum_select, trimmed_mean


def _messages(key: str, values, dtype) -> list[dict]:
    """One message per value, ``key`` a one-entry array of ``dtype``."""
    return [{key: np.array([v], dtype)} for v in values]


def test_only_the_prefix_keys_are_combined():
    msgs = [{"w/a": np.array([float(v)]), "stat/s": np.array([10.0 * v]), "num_examples": v} for v in (1, 2, 6)]
    for out in (coordinate_median(msgs, "w/"), trimmed_mean(msgs, "w/", 0.0)):
        assert list(out) == ["w/a"]
    assert coordinate_median(msgs, "w/")["w/a"][0] == 2.0 and trimmed_mean(msgs, "w/", 0.0)["w/a"][0] == 3.0


@pytest.mark.parametrize("rule", [lambda m: coordinate_median(m, "w/"), lambda m: trimmed_mean(m, "w/", 0.1)])
def test_no_messages_is_a_value_error(rule):
    with pytest.raises(ValueError, match="need at least one message"):
        rule([])


def test_a_trim_fraction_of_zero_is_the_plain_mean():
    got = trimmed_mean(_messages("w/a", (1.0, 2.0, 4.0, 9.0), np.float64), "w/", 0.0)
    assert got["w/a"][0] == 4.0  # (1 + 2 + 4 + 9) / 4, nothing cut


def test_integer_and_bool_arrays_are_rounded_to_nearest_not_truncated():
    # means 1.75 and -1.75 round to 2 and -2 (a cast would give 1 and -1); a bool mean of 0.25 to False (not True)
    assert trimmed_mean(_messages("w/n", (1, 2, 2, 2), np.int64), "w/", 0.0)["w/n"].tolist() == [2]
    assert trimmed_mean(_messages("w/n", (-1, -2, -2, -2), np.int64), "w/", 0.0)["w/n"].tolist() == [-2]
    mask = trimmed_mean(_messages("w/m", (True, False, False, False), np.bool_), "w/", 0.0)["w/m"]
    assert mask.dtype == np.bool_ and mask.tolist() == [False]


def test_float32_arrays_are_combined_in_float64_and_given_back_as_float32():
    # the two middle values sum to 6e38, past float32's 3.4e38: in float32 the median of finite weights would be inf
    got = coordinate_median(_messages("w/a", (3e38, 3e38), np.float32), "w/")["w/a"]
    assert got.dtype == np.float32 and got[0] == np.float32(3e38)
    mean = trimmed_mean(_messages("w/a", (2.0**24, 1.0, 1.0), np.float32), "w/", 0.0)["w/a"]
    assert mean.dtype == np.float32 and mean[0] == np.float32(5592406.0)  # 16777218 / 3, exact in float32
    med = coordinate_median(_messages("w/a", (1.0, 2.0, 3.0, 4.0), np.float16), "w/")["w/a"]
    assert med.dtype == np.float16 and med[0] == 2.5


def test_krum_distances_are_float64_differences():
    # (1 + 2^-12)² = 1 + 2^-11 + 2^-24 is exact in float64; float32 arithmetic would round away the 2^-24
    msgs = _messages("w/a", (0.0, 1.0 + 2.0**-12, 3.0), np.float32)
    scores = krum_scores(msgs, "w/", malicious=0)  # 3 - 0 - 2 = 1 nearest other
    d01, d12 = (1.0 + 2.0**-12) ** 2, (2.0 - 2.0**-12) ** 2
    assert scores.tolist() == [d01, min(d01, d12), d12]


def test_krum_with_few_replies_still_scores_the_nearest_other():
    # n - f - 2 = 3 - 1 - 2 = 0: each message is scored by its one nearest other (Flower's num_closest = max(1, ...))
    msgs = _messages("w/a", (10.0, 0.0, 1.0), np.float64)
    assert krum_scores(msgs, "w/", malicious=1).tolist() == [81.0, 1.0, 1.0]
    assert krum_select(msgs, "w/", malicious=1) == [1]


def test_krum_ignores_integer_arrays():
    # the int buffers would make message 2 the closest to everyone; only the float arrays count
    msgs = [{"w/a": np.array([a]), "w/n": np.array([n], np.int64)} for a, n in ((0.0, 0), (1.0, 100), (5.0, 50))]
    assert krum_scores(msgs, "w/", malicious=0).tolist() == [1.0, 1.0, 16.0]


def test_krum_keeps_between_one_and_all_replies():
    msgs = _messages("w/a", (0.0, 1.0, 3.0), np.float64)
    assert krum_select(msgs, "w/", 0, keep=3) == [0, 1, 2]
    for keep in (0, 4):
        with pytest.raises(ValueError, match=f"krum keeps between 1 and 3 replies, got {keep}"):
            krum_select(msgs, "w/", 0, keep=keep)


def test_krum_breaks_ties_by_the_lowest_index_among_many_replies():
    # 19 replies at 0, then 21 at 1; f = 18: each is scored by its 40 - 18 - 2 = 20 nearest others, 0 for the 21
    # (20 equal others) and 18·0 + 2·1 = 2 for the 19. Of the 21 tied lowest, the first ones are kept (a stable
    # sort: numpy's quicksort of 40 scores picks 24, 25, 26)
    msgs = _messages("w/a", [0.0] * 19 + [1.0] * 21, np.float64)
    assert krum_scores(msgs, "w/", 18).tolist() == [2.0] * 19 + [0.0] * 21
    assert krum_select(msgs, "w/", 18) == [19] and krum_select(msgs, "w/", 18, keep=3) == [19, 20, 21]
