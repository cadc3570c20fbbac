import numpy as np
import pytest
import torch
from torch import nn

from feddg.messages import load_weights, message_nbytes, validate_message, weights_of


def test_validate_accepts_arrays_and_scalars():
    validate_message({"w/a": np.zeros(3, np.float32), "lr": 0.1, "n": 3, "tag": "x"})


@pytest.mark.parametrize("bad", [torch.zeros(2), [1, 2], {"a": 1}, None, True, np.array([object()])])
def test_validate_rejects_everything_else_naming_the_key(bad):
    with pytest.raises(TypeError, match="'k'"):
        validate_message({"k": bad})


def test_nbytes_counts_arrays_scalars_strings_and_keys():
    msg = {"w/a": np.zeros((2, 3), np.float32), "lr": 0.5, "s": "abc"}
    assert message_nbytes(msg) == (3 + 24) + (2 + 8) + (1 + 3)


def test_weights_round_trip_includes_buffers():
    src, dst = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    with torch.no_grad():
        src.weight.uniform_()
        src.running_mean.uniform_()
    src.num_batches_tracked += 7
    load_weights(dst, weights_of(src))
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k


def test_load_weights_rejects_mismatched_keys():
    with pytest.raises(KeyError, match="missing"):
        load_weights(nn.Linear(2, 2), {"w/weight": np.zeros((2, 2), np.float32)})
