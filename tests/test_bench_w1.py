"""`feddg bench w1`: the variants it runs, in which order, and the load it can hold the machine under."""

import multiprocessing as mp
import time

import pytest

from feddg.bench.w1 import background_load, cpu_seconds, summary, w1_table


def _load_children() -> list[mp.process.BaseProcess]:
    return [p for p in mp.active_children() if p.name == "feddg-bench-load"]


def test_background_load_runs_busy_loops_and_stops_them():
    with background_load(2):
        procs = _load_children()
        time.sleep(0.3)
        assert len(procs) == 2 and all(p.is_alive() for p in procs)  # still looping
    assert not _load_children() and all(p.exitcode is not None for p in procs)


def test_background_load_refuses_figures_after_a_busy_loop_died():
    with pytest.raises(RuntimeError, match="not under load"), background_load(1):
        (proc,) = _load_children()
        proc.kill()
        proc.join()
    assert not _load_children()


def test_background_load_of_zero_starts_nothing():
    with background_load(0):
        assert not _load_children()


def test_w1_table_runs_the_chosen_variants_yardstick_first():
    c0 = cpu_seconds()
    times = w1_table(1, images=8, variants=("1", "plain"))
    assert list(times) == ["plain PyTorch, 2 × 1 thread", "feddg workers: 1 (threads: auto = 1)"]
    assert all(len(t) == 1 and t[0][0] > 0 and t[0][1] > 0 for t in times.values())
    assert cpu_seconds() - c0 >= sum(c for t in times.values() for _, c in t) - 1e-6
    rows = summary(times)
    assert rows[0][3] == 1.0 and rows[1][3] == pytest.approx(rows[1][1] / rows[0][1])


@pytest.mark.parametrize("variants", [("1", "auto"), ("plain", "3")])
def test_w1_table_refuses_variants_without_the_yardstick_or_unknown(variants):
    with pytest.raises(ValueError, match="W1 variants must include 'plain'"):
        w1_table(1, images=8, variants=variants)
