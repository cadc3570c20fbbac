"""The Flower record codec's checks (feddg.engines.flower.records): an array's .npy header must declare exactly the
bytes that follow it, and a record's scalar reads as an int or refuses in one line."""

import io

import numpy as np
import pytest
from flwr.app import Array

from feddg.engines.flower.records import array_value, record_int


def npy_array(shape: tuple[int, ...], descr: str, body: bytes, version: bytes = b"\x01\x00") -> Array:
    """An Array whose .npy bytes are a ``version`` header declaring ``shape`` of ``descr``, then ``body``."""
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    header = out.getvalue()
    return Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=header[:6] + version + header[8:] + body)


def test_an_array_whose_header_declares_its_bytes_decodes() -> None:
    body = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32).tobytes()
    got = array_value(npy_array((2, 2), "<f4", body))
    assert got.dtype == np.float32 and np.array_equal(got, [[1.0, 2.0], [3.0, 4.0]])


@pytest.mark.parametrize(("body", "present"), [(bytes(12), 12), (bytes(20), 20)])  # short, or trailing bytes
def test_an_array_whose_header_declares_other_bytes_than_follow_is_refused(body: bytes, present: int) -> None:
    with pytest.raises(ValueError, match=rf"declares shape \(2, 2\) of float32 \(16 bytes\), but {present} bytes"):
        array_value(npy_array((2, 2), "<f4", body))


def test_an_array_of_another_npy_version_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\.npy version is not 1\.0 or 2\.0"):
        array_value(npy_array((2, 2), "<f4", bytes(16), version=b"\x03\x00"))


def test_a_record_scalar_reads_as_an_int_and_a_list_is_refused_in_one_line() -> None:
    assert [record_int(3), record_int(4.0), record_int("5")] == [3, 4, 5]
    with pytest.raises(TypeError, match="^expected a number in the record, got list$"):
        record_int([1])
