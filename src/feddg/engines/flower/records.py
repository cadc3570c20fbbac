"""Lossless conversion between a feddg :data:`~feddg.messages.Message` and Flower records.

A Message becomes four records of a ``RecordDict`` (names prefixed, so several Messages, e.g.
the client states of several clients in one ``Context.state``, can share one RecordDict):

=================  ==============  ===================================================
record             Flower type     holds
=================  ==============  ===================================================
``<p>arrays``      ArrayRecord     every ``np.ndarray`` (``np.save`` bytes: dtype and
                                   shape are kept, 0-d arrays included)
``<p>numbers``     MetricRecord    ints stay ints (sint64), floats stay floats (double)
``<p>text``        ConfigRecord    strings
``<p>layout``      ConfigRecord    ``order``: the Message's keys in their original order
=================  ==============  ===================================================

NumPy scalars (``np.int64``, ``np.float32``) arrive as Python ``int`` / ``float`` of the same
value; everything else round-trips exactly.
"""

from __future__ import annotations

import math
from io import BytesIO
from typing import cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from feddg.messages import Message, validate_message

ARRAYS, NUMBERS, TEXT, LAYOUT = "arrays", "numbers", "text", "layout"


def put_message(records: RecordDict, msg: Message, prefix: str = "") -> RecordDict:
    """Write ``msg`` into ``records`` under ``prefix`` (replacing what was there); returns ``records``."""
    validate_message(msg)
    arrays, numbers, text = ArrayRecord(), MetricRecord(), ConfigRecord()
    for key, value in msg.items():
        if isinstance(value, np.ndarray):
            arrays[key] = Array(value)
        elif isinstance(value, str):
            text[key] = value
        elif isinstance(value, (int, np.integer)):
            numbers[key] = int(value)
        else:
            numbers[key] = float(value)
    records[prefix + ARRAYS] = arrays
    records[prefix + NUMBERS] = numbers
    records[prefix + TEXT] = text
    records[prefix + LAYOUT] = ConfigRecord({"order": list(msg)})
    return records


def message_records(msg: Message, prefix: str = "") -> RecordDict:
    """A new RecordDict holding ``msg``."""
    return put_message(RecordDict(), msg, prefix)


def get_message(records: RecordDict, prefix: str = "") -> Message:
    """The Message stored under ``prefix``; ``{}`` if there is none (a client's first round)."""
    if prefix + LAYOUT not in records:
        return {}
    arrays = records.array_records[prefix + ARRAYS]
    numbers = records.metric_records[prefix + NUMBERS]
    text = records.config_records[prefix + TEXT]
    out: Message = {}
    # put_message wrote these records: the order is the Message's keys, numbers are ints or floats, text is strings
    for key in cast(list[str], records.config_records[prefix + LAYOUT]["order"]):
        if key in arrays:
            out[key] = array_value(arrays[key])
        elif key in numbers:
            out[key] = cast(int | float, numbers[key])
        else:
            out[key] = cast(str, text[key])
    return out


#: the .npy header readers of the versions ``np.save`` writes for numeric arrays
NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def array_value(array: Array) -> np.ndarray:
    """``array`` as an ndarray once its .npy header agrees with the bytes that follow it (``ValueError`` otherwise):
    ``np.load`` allocates what the header declares, so a forged 128-byte header could ask for petabytes."""
    data = BytesIO(array.data)
    read_header = NPY_HEADERS.get(np.lib.format.read_magic(data))
    if read_header is None:
        raise ValueError("an array's .npy version is not 1.0 or 2.0")
    shape, _, dtype = read_header(data)
    declared, present = math.prod(shape) * dtype.itemsize, len(array.data) - data.tell()
    if declared != present:
        raise ValueError(f"an array's .npy header declares shape {shape} of {dtype} ({declared} bytes), "
                         f"but {present} bytes follow it")
    return array.numpy()


def record_int(value: object) -> int:
    """``int(value)`` of a scalar read from a record (Flower types record values as a union that includes lists);
    ``TypeError`` for anything else, as ``int()`` raises."""
    if isinstance(value, (int, float, str, bytes)):
        return int(value)
    raise TypeError(f"expected a number in the record, got {type(value).__name__}")
