"""Independent numpy calls on Python threads: numpy's BLAS calls and its ufuncs over large arrays release the GIL."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def map_on_threads(fn: Callable[[T], R], items: Sequence[T], name: str) -> list[R]:
    """``[fn(x) for x in items]`` on as many threads as torch has (the process's thread budget), results in order;
    in the calling thread when that budget is one. The calls share nothing, so each result is the serial one's,
    bit for bit."""
    threads = min(torch.get_num_threads(), len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads, thread_name_prefix=name) as pool:
        return list(pool.map(fn, items))
