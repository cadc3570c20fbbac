"""The Flower record codec (feddg.engines.flower.records): a Message round-trips under its prefix, keys in order and
numbers as ints or floats; an array's .npy header must declare exactly the bytes that follow it, and a record's
scalar reads as an int or refuses in one line."""

import io
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, RecordDict

from feddg.engines.flower.records import array_value, get_message, put_message, record_int


def npy_array(shape: tuple[int, ...], descr: str, body: bytes, version: bytes = b"\x01\x00") -> Array:
    """An Array whose .npy bytes are a ``version`` header declaring ``shape`` of ``descr``, then ``body``."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    header = out.getvalue()
    return Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=header[:6] + version + header[8:] + body)


def test_two_messages_under_two_prefixes_round_trip_with_their_key_order_and_number_types() -> None:
    z, zero_d = np.arange(6, dtype=np.float16).reshape(2, 3), np.array(2.5)
    a: dict[str, Any] = {"w/z": z, "num_examples": np.int64(7), "loss": np.float32(0.5), "name": "fedavg", "round": 3,
                          "lr": 0.25, "w/0d": zero_d}
    b: dict[str, Any] = {"b": 1.5, "a": "x"}
    records = put_message(put_message(RecordDict(), a, "client-1/"), b, "client-2/")
    got_a, got_b = get_message(records, "client-1/"), get_message(records, "client-2/")
    assert list(got_a) == ["w/z", "num_examples", "loss", "name", "round", "lr", "w/0d"] and list(got_b) == ["b", "a"]
    assert got_b == b and get_message(records, "client-3/") == {}  # no such prefix: a first round's empty state
    assert [(type(got_a[k]), got_a[k]) for k in ("num_examples", "loss", "name", "round", "lr")] == [
        (int, 7), (float, 0.5), (str, "fedavg"), (int, 3), (float, 0.25)]  # NumPy scalars arrive as int / float
    for key, want in (("w/z", z), ("w/0d", zero_d)):  # dtype and shape kept, 0-d included
        got = got_a[key]
        assert isinstance(got, np.ndarray) and (got.dtype, got.shape) == (want.dtype, want.shape)
        assert np.array_equal(got, want)


def test_an_array_whose_header_declares_its_bytes_decodes() -> None:
    body = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32).tobytes()
    got = array_value(npy_array((2, 2), "<f4", body))
    assert got.dtype == np.float32 and np.array_equal(got, [[1.0, 2.0], [3.0, 4.0]])


@pytest.mark.parametrize(("body", "present"), [(bytes(12), 12), (bytes(20), 20)])  # short, or trailing bytes
def test_an_array_whose_header_declares_other_bytes_than_follow_is_refused(body: bytes, present: int) -> None:
    with pytest.raises(ValueError, match=rf"declares shape \(2, 2\) of float32 \(16 bytes\), but {present} bytes"):
        array_value(npy_array((2, 2), "<f4", body))


def test_an_array_with_a_version_2_header_decodes() -> None:
    out = io.BytesIO()
    np.lib.format.write_array(out, np.array([1.0, -2.0, 3.0], np.float32), version=(2, 0))  # 4-byte header length
    got = array_value(Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=out.getvalue()))
    assert np.array_equal(got, np.array([1.0, -2.0, 3.0], np.float32))


def test_an_array_of_another_npy_version_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\.npy version is not 1\.0 or 2\.0"):
        array_value(npy_array((2, 2), "<f4", bytes(16), version=b"\x03\x00"))


def test_a_record_scalar_reads_as_an_int_and_a_list_is_refused_in_one_line() -> None:
    assert [record_int(3), record_int(4.0), record_int("5")] == [3, 4, 5]
    with pytest.raises(TypeError, match="^expected a number in the record, got list$"):
        record_int([1])
