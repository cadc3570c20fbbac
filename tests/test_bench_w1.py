"""`feddg bench w1`: the variants it runs, in which order, the load it can hold the machine under, and its
bookkeeping (min, median, ratio to the yardstick, CPU seconds, load average) on hand-made timings."""

import multiprocessing as mp
import time
from types import SimpleNamespace

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


def test_summary_gives_min_median_ratio_to_the_yardsticks_min_and_min_cpu():
    times = {"plain": [(3.0, 1.0), (2.0, 5.0), (4.0, 2.0)], "x": [(5.0, 3.0), (2.5, 0.5), (9.0, 4.0)]}
    assert summary(times) == [("plain", 2.0, 3.0, 1.0, 1.0), ("x", 2.5, 5.0, 1.25, 0.5)]


def test_w1_table_rotates_the_order_each_repeat_and_charges_each_run_its_own_cpu(monkeypatch):
    from feddg.bench import w1

    order: list[str] = []
    cpu = [100.0]

    def run(key: str, wall: float, used: float):
        def timed() -> float:
            order.append(key)
            cpu[0] += used
            return wall

        return timed

    monkeypatch.setattr(w1, "_variants", lambda images: {k: (k, run(k, w, c)) for k, w, c in
                                                         [("plain", 1.0, 0.5), ("1", 2.0, 0.25), ("2", 3.0, 2.0)]})
    monkeypatch.setattr(w1, "cpu_seconds", lambda: cpu[0])
    times = w1_table(3, images=8, variants=("2", "plain", "1"))
    assert order == ["plain", "1", "2", "1", "2", "plain", "2", "plain", "1"]  # no variant always after the same one
    assert times == {"plain": [(1.0, 0.5)] * 3, "1": [(2.0, 0.25)] * 3, "2": [(3.0, 2.0)] * 3}


def test_cpu_seconds_add_user_and_system_time_of_this_process_and_its_children(monkeypatch):
    import resource

    from feddg.bench import w1

    usage = {resource.RUSAGE_SELF: SimpleNamespace(ru_utime=1.0, ru_stime=2.0),
             resource.RUSAGE_CHILDREN: SimpleNamespace(ru_utime=4.0, ru_stime=8.0)}
    monkeypatch.setattr(resource, "getrusage", usage.__getitem__)
    assert w1.cpu_seconds() == 15.0


def test_load_average_gives_the_1_5_and_15_minute_loads(monkeypatch):
    import os

    from feddg.bench import w1

    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 0.25, 3.0))
    assert w1.load_average() == "1.50 0.25 3.00"
