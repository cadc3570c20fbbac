"""Thread counts a test can read in this process."""

from threadpoolctl import threadpool_info


def blas_threads() -> set[int]:
    """The thread counts of the BLAS libraries loaded in this process (numpy's OpenBLAS, SciPy's)."""
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}
