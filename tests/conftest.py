import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """One dataset cache for the whole test session (built-in datasets are built at most once)."""
    path = Path(os.environ.get("FEDDG_TEST_CACHE", Path(__file__).parent.parent / ".cache" / "test-data"))
    path.mkdir(parents=True, exist_ok=True)
    return path
