import numpy as np
import pytest
import torch
from torch import nn

from feddg.messages import (
    entries,
    like_slot,
    load_weights,
    message_nbytes,
    state_to_message,
    subset,
    validate_message,
    weights_of,
    without,
)


def test_validate_accepts_arrays_and_scalars():
    validate_message({"w/a": np.zeros(3, np.float32), "lr": 0.1, "n": 3, "tag": "x"})


@pytest.mark.parametrize("bad", [torch.zeros(2), [1, 2], {"a": 1}, None, True, np.array([object()]),
                                 np.array([], dtype=object)])
def test_validate_rejects_everything_else_naming_the_key(bad):
    with pytest.raises(TypeError, match="'k'"):
        validate_message({"k": bad})


def test_validate_rejects_a_message_that_is_no_dict_or_has_a_key_that_is_no_string() -> None:
    with pytest.raises(TypeError, match="^reply must be a dict, got list$"):
        validate_message([("k", 1)], "reply")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^message key 1 is not a string$"):
        validate_message({1: 2})  # type: ignore[dict-item]


def test_nbytes_counts_arrays_scalars_strings_and_keys():
    msg = {"w/a": np.zeros((2, 3), np.float32), "lr": 0.5, "s": "abc"}
    assert message_nbytes(msg) == (3 + 24) + (2 + 8) + (1 + 3)
    assert message_nbytes({"ü": "é€"}) == 2 + (2 + 3)  # UTF-8 bytes, not characters


def test_weights_round_trip_includes_buffers():
    src, dst = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    with torch.no_grad():
        src.weight.uniform_()
        src.running_mean.uniform_()
    src.num_batches_tracked += 7
    load_weights(dst, weights_of(src))
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_message_is_a_copy_that_later_training_does_not_change() -> None:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
    msg = state_to_message(model.state_dict(), "p/")
    with torch.no_grad():
        model.weight.add_(5.0)
    np.testing.assert_array_equal(msg["p/weight"], [[1.0, 1.0]])


def test_load_weights_rejects_mismatched_keys():
    with pytest.raises(KeyError, match="missing"):
        load_weights(nn.Linear(2, 2), {"w/weight": np.zeros((2, 2), np.float32)})
    full = {"w/weight": np.zeros((2, 2), np.float32), "w/bias": np.zeros(2, np.float32)}
    with pytest.raises(KeyError, match=r"missing \[\], unexpected \['extra'\]"):
        load_weights(nn.Linear(2, 2), {**full, "w/extra": np.zeros(1, np.float32)})


def test_subset_entries_and_without_split_a_message_by_key_prefix() -> None:
    msg = {"w/a": 1, "gram/w/b": 2, "w/c": 3, "lr": 0.5}
    assert subset(msg, "w/") == {"a": 1, "c": 3}  # a prefix, not a substring
    assert entries(msg, "w/") == {"w/a": 1, "w/c": 3}
    assert without(msg, "w/") == {"gram/w/b": 2, "lr": 0.5}


def test_like_slot_is_an_array_of_the_values_shape_and_dtype() -> None:
    slot = like_slot(np.zeros((2, 3), np.float16))
    assert (slot.dtype, slot.shape, slot.number) == (np.dtype(np.float16), (2, 3), False)
