from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# one torch thread, as run_inprocess's server (federation.threads: auto): a test that drives run_round itself then
# gets the bits of a full run whichever test ran before it (2 threads give other float bits)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """One dataset cache for the whole test session (built-in datasets are built at most once)."""
    path = Path(os.environ.get("FEDDG_TEST_CACHE", Path(__file__).parent.parent / ".cache" / "test-data"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(autouse=True)
def _threads_kept() -> object:
    """A test (or the feddg code it calls) that leaves torch's thread count changed fails, and the count goes back
    to 1: otherwise every later test that compares bits would run on other threads and fail instead of it."""
    yield
    left = torch.get_num_threads()
    if left != 1:
        torch.set_num_threads(1)
        pytest.fail(f"the test left torch at {left} threads (expected 1: conftest's)")


@pytest.fixture(autouse=True)
def _no_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.execve`` (``reproducibility: portable``'s re-execution, reachable from a CliRunner test) would replace the
    pytest process with the command, and pytest would end with exit 0 and no report: it fails the test instead."""
    def refuse(path: str, argv: list[str], env: dict[str, str]) -> None:
        pytest.fail(f"the test reached os.execve({argv}): it would replace the pytest process")

    monkeypatch.setattr(os, "execve", refuse)


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower Messages need the identity of the task that creates them (the runtimes set it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """The figures the code under test closes with ``plt.close``, in order (closed, read back afterwards)."""
    import matplotlib.pyplot as plt  # here: most tests draw nothing

    figs: list[Figure] = []
    close = plt.close

    def keep(fig: Figure) -> None:
        figs.append(fig)
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    return figs
