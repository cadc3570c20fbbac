"""`feddg bench all` and `feddg bench models`/`engine`: the bookkeeping behind each row (which repeat is the min and
which the median, the ratio's direction, the target's bound, whose CPU seconds), on hand-made timings: no test here
runs a benchmark or asserts a speed."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from support.tables import table_cells

from feddg.bench import memory, merge, scale, summary, throughput, w1
from feddg.bench.summary import Row


def _cpu_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A fake :func:`~feddg.bench.w1.cpu_seconds`: the returned one-element list is the CPU seconds so far."""
    cpu = [100.0]
    monkeypatch.setattr(w1, "cpu_seconds", lambda: cpu[0])
    return cpu


def test_w1_rows_judge_only_auto_against_the_bound_inclusive_and_the_loaded_row_by_its_ratio(monkeypatch):
    auto, one, plain = "feddg workers: auto (= 2)", "feddg workers: 1 (threads: auto = 1)", "plain PyTorch, 2 × 1 thread"
    idle = {plain: [(10.0, 3.0), (12.0, 2.0), (14.0, 4.0)], one: [(12.0, 5.0), (13.0, 6.0), (20.0, 7.0)],
            auto: [(11.0, 8.0), (15.0, 9.0), (12.0, 1.5)]}
    loaded = {plain: [(0.5, 1.0), (0.7, 1.0), (0.9, 1.0)], auto: [(0.8, 2.0), (0.6, 2.5), (0.9, 2.25)]}

    def table(repeats: int, images: int, variants: tuple[str, ...] | None = None) -> dict[str, Any]:
        assert (repeats, images) == (3, 40)
        return idle if variants is None else (loaded if variants == ("plain", "auto") else {})

    monkeypatch.setattr(w1, "w1_table", table)
    monkeypatch.setattr(w1, "background_load", lambda n: nullcontext())
    rows = summary.w1_rows(40, 3)
    by_figure = {r.figure: r for r in rows}
    # auto's min is 11 s against the yardstick's 10 s: 1.1× meets "≤ 1.1×" exactly; workers: 1 has no target
    assert by_figure[f"W1 {auto} (40 img/client)"] == Row(f"W1 {auto} (40 img/client)", "11.0 / 12.0 s",
                                                          "plain PyTorch 2 × 1 thread", 1.1, "≤ 1.1×", True, "1.5")
    assert by_figure[f"W1 {one} (40 img/client)"] == Row(f"W1 {one} (40 img/client)", "12.0 / 13.0 s",
                                                         "plain PyTorch 2 × 1 thread", 1.2, "", None, "5.0")
    # under load: 0.6 s against the loaded yardstick's 0.5 s is 1.2×, over the bound (though 0.6 s is under 1.1)
    assert rows[-1] == Row(f"W1 {auto} under 1 busy loop (40 img/client)", "0.6 / 0.8 s",
                           "plain PyTorch 2 × 1 thread, same load (0.5 s)", pytest.approx(1.2), "≤ 1.1×", False, "2.0")
    assert len(rows) == 3


class _Clock:
    """A stand-in for :class:`~feddg.bench.merge.GemmClock` whose shortest lap is 0.25 s."""

    def __init__(self) -> None:
        self.laps: list[float] = []

    def __enter__(self) -> _Clock:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def shortest(self) -> float:
        return 0.25


def test_m1_rows_divide_the_min_merge_by_the_gemm_bound_and_meet_1_5x_inclusive(monkeypatch):
    from feddg.aggregation import merges

    # per solver, the 3 timed repeats of the merge and of the mean pass, and each merge call's CPU seconds
    timed = iter([{"m1": [0.75, 0.6, 0.9], "mean": [0.2, 0.15, 0.3]}, {"m1": [0.75, 0.9, 0.8], "mean": [0.15]}])
    cpu_per_call = iter([0.5, 1.0, 4.0, 2.0, 0.5, 3.0, 3.0, 6.0])  # warm-up, then 3 timed calls, per solver: the
    # least of the timed calls' CPU seconds, as every row gives it (not the warm-up's)
    process_time = [0.0]

    def merge_stations(*_: object, solver: str) -> object:
        process_time[0] += next(cpu_per_call)
        return solver

    def time_merges(runs: dict[str, Callable[[], object]], repeats: int, threads: int) -> dict[str, list[float]]:
        assert threads == 2
        for _ in range(repeats):
            for run in runs.values():
                run()
        return {"m1": [1.0], "mean": [1.0]} if repeats == 1 else next(timed)

    monkeypatch.setattr(merges, "merge_stations", merge_stations)
    monkeypatch.setattr(merge, "resnet18_stations", lambda n: SimpleNamespace(weights=[], grams=[], gammas=[], spec=None))
    monkeypatch.setattr(merge, "GemmClock", _Clock)
    monkeypatch.setattr(merge, "mean_pass", lambda case: lambda: None)
    monkeypatch.setattr(merge, "time_merges", time_merges)
    monkeypatch.setattr(merge, "fastest_gemm", lambda threads: ("MKL", 100.0))  # GFLOP/s
    monkeypatch.setattr(merge, "merge_gflop", lambda run: 50.0)  # GFLOP: the bound is 0.5 s
    monkeypatch.setattr(summary, "time", SimpleNamespace(process_time=lambda: process_time[0]))
    hungarian, sinkhorn = summary.m1_rows(4, 3)
    assert hungarian.figure == "M1 HFedATM merge, ResNet-18 × 4 stations, Hungarian, 2 threads"
    assert sinkhorn.figure == "M1 HFedATM merge, ResNet-18 × 4 stations, Sinkhorn (HFedATM's default), 2 threads"
    assert (hungarian.value, hungarian.ratio, hungarian.met, hungarian.cpu) == ("0.60 / 0.75 s", 1.2, True, "1.00")
    assert hungarian.yardstick == ("GEMM bound 0.50 s (100 GFLOP/s, MKL); exact floor 0.40 s = 0.80× "
                                   "(its products 0.25 + float64 mean 0.15 s)")
    assert (sinkhorn.value, sinkhorn.ratio, sinkhorn.met, sinkhorn.cpu) == ("0.75 / 0.80 s", 1.5, True, "3.00")


def _one_merge(monkeypatch: pytest.MonkeyPatch, m1_seconds: float, gflop: float) -> None:
    """M1's collaborators stubbed: each timed repeat of the merge takes ``m1_seconds`` (the mean pass 0.1 s), its
    products count ``gflop`` GFLOP, and the machine's GEMM rate is 100 GFLOP/s on MKL."""
    from feddg.aggregation import merges

    monkeypatch.setattr(merges, "merge_stations", lambda *_, solver: None)
    monkeypatch.setattr(merge, "resnet18_stations", lambda n: SimpleNamespace(weights=[], grams=[], gammas=[], spec=None))
    monkeypatch.setattr(merge, "GemmClock", _Clock)
    monkeypatch.setattr(merge, "mean_pass", lambda case: lambda: None)
    monkeypatch.setattr(merge, "time_merges", lambda runs, repeats, threads: {k: [m1_seconds if k == "m1" else 0.1]
                                                                           for k in runs if runs[k]() or 1})
    monkeypatch.setattr(merge, "fastest_gemm", lambda threads: ("MKL", 100.0))
    monkeypatch.setattr(merge, "merge_gflop", lambda run: gflop)


def test_m1_rows_refuse_a_merge_with_no_counted_flops(monkeypatch):
    _one_merge(monkeypatch, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="no GEMM FLOPs counted"):
        summary.m1_rows(2, 1, ("hungarian",))


def test_m1_rows_fail_just_above_1_5x(monkeypatch):
    _one_merge(monkeypatch, 0.76, 50.0)  # the bound is 0.5 s: 0.76 s is 1.52×
    (row,) = summary.m1_rows(2, 1, ("hungarian",))
    assert (row.ratio, row.target, row.met) == (pytest.approx(1.52), "≤ 1.5×", False)


def test_memory_rows_keep_the_streamed_fold_and_meet_1_gib_inclusive(monkeypatch):
    cpu = _cpu_clock(monkeypatch)

    def table(params: int, clients: list[int], max_list_bytes: float) -> list[dict[str, float | str]]:
        (n,) = clients
        cpu[0] += 2.5 if n == 10 else 4.0
        return [{"fold": "streaming", "clients": n, "peak_mb": 1024.0 if n == 10 else 1024.5, "models": 3.0 + n},
                {"fold": "all-at-once", "clients": n, "peak_mb": 1.0, "models": 1.0}]

    monkeypatch.setattr(memory, "memory_table", table)
    rows = summary.memory_rows(2_000, [10, 3000])
    assert rows == [Row("server peak, FedAvg round, 10 clients × 2,000 params", "1,024 MiB", "one model", 13.0,
                        "≤ 1 GiB above the model", True, "2.5"),
                    Row("server peak, FedAvg round, 3,000 clients × 2,000 params", "1,024 MiB", "one model", 3003.0,
                        "≤ 1 GiB above the model", False, "4.0")]


def test_methods_row_takes_the_min_start_over_bare_pythons_min_and_the_min_cpu(monkeypatch):
    cpu = _cpu_clock(monkeypatch)
    feddg, bare, feddg_cpu = iter([5.0, 1.2, 1.0, 1.1]), iter([0.05, 0.04, 0.06]), iter([9.0, 0.9, 0.7, 0.8])

    def seconds(cmd: list[str], repeats: int) -> list[float]:
        assert repeats == 1
        if "feddg" not in cmd:
            return [next(bare)]
        cpu[0] += next(feddg_cpu)
        return [next(feddg)]

    monkeypatch.setattr(summary, "_seconds", seconds)
    row = summary.methods_row(3)  # the warm-up (5 s) counts nowhere
    assert row == Row("feddg methods (warm)", "1.00 / 1.10 s", "bare python 0.04 s", 25.0, "≤ 1 s", True, "0.70")


def test_methods_row_fails_just_above_1_s(monkeypatch):
    _cpu_clock(monkeypatch)
    monkeypatch.setattr(summary, "_seconds", lambda cmd, repeats: [1.01 if "feddg" in cmd else 0.05])
    assert summary.methods_row(2).met is False


def test_worker_start_row_meets_2_s_inclusive(monkeypatch):
    cpu = _cpu_clock(monkeypatch)

    def start(cfg: object, fed: object, workers: int, factory: object, fork: bool) -> float:
        assert (cfg, fed, workers, fork) == ("cfg", "fed", 2, True)
        cpu[0] += 0.5
        return 2.0

    monkeypatch.setattr(w1, "w1_config", lambda workers, images: "cfg")
    monkeypatch.setattr(w1, "w1_federation", lambda cfg: "fed")
    monkeypatch.setattr(scale, "worker_start_seconds", start)
    assert summary.worker_start_row() == Row("worker pool start (2 workers, forked)", "2.00 s", "", None, "≤ 2 s", True,
                                             "0.50")
    monkeypatch.setattr(scale, "worker_start_seconds", lambda *_, fork: 2.01)
    assert summary.worker_start_row().met is False


def test_scale_row_compares_the_min_last_round_with_the_min_train_plus_eval(monkeypatch):
    runs = iter([{"round_s": [9.0, 2.6], "cpu_s": 30.0}, {"round_s": [9.5, 2.4], "cpu_s": 20.0},
                 {"round_s": [8.0, 3.0], "cpu_s": 25.0}])
    plain = iter([{"train": 1.5, "eval": 0.5, "clients": 3060.0}, {"train": 1.0, "eval": 1.2, "clients": 3060.0},
                  {"train": 1.4, "eval": 0.9, "clients": 3060.0}])
    monkeypatch.setattr(scale, "scale_run", lambda cfg: next(runs))
    monkeypatch.setattr(scale, "yardstick", lambda cfg: next(plain))
    row = summary.scale_row(3)
    # the last rounds' min 2.4 s against min(2.0, 2.2, 2.3) = 2.0 s: 1.2×, on the bound
    assert row == Row("writers-scale (FEMNIST's shape): last round, 3,060 clients, 50 sampled + evaluation",
                      "2.40 / 2.60 s", "plain loop 2.00 s", 1.2, "≤ 1.2×", True, "20.0 per run")
    runs = iter([{"round_s": [9.0, 2.42], "cpu_s": 1.0}])
    plain = iter([{"train": 1.5, "eval": 0.5, "clients": 3060.0}])
    assert summary.scale_row(1).met is False  # 2.42 s against 2.0 s: 1.21×


def test_summary_table_says_yes_no_or_nothing_and_the_report_reads_the_load_before_the_rows(monkeypatch):
    rows = [Row("a", "1 s", "y", 0.5, "≤ 1×", True, "1.0"), Row("b", "2 s", "y", 2.0, "≤ 1×", False, "2.0"),
            Row("c", "3 s", "", None, "", None, "3.0")]
    assert [[c[0], c[4], c[6]] for c in table_cells(summary.summary_table(rows, False, 3))] == [
        ["a", "0.50", "yes"], ["b", "2.00", "no"], ["c", "", ""]]
    load = ["0.50 0.40 0.30"]

    def summary_rows(quick: bool, repeats: int, progress: object) -> list[Row]:
        load[0] = "9.00 8.00 7.00"  # the benchmark itself loads the machine
        return rows

    monkeypatch.setattr(w1, "load_average", lambda: load[0])
    monkeypatch.setattr(summary, "summary_rows", summary_rows)
    _, text = summary.summary_report(True, 3)
    assert text == "load average before: 0.50 0.40 0.30; after: 9.00 8.00 7.00"


def _fake_clock(monkeypatch: pytest.MonkeyPatch, module: object) -> list[float]:
    """``module``'s ``time.perf_counter`` made a fake clock: the returned one-element list is its reading."""
    now = [0.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def test_engine_seconds_per_round_leave_the_warm_up_round_out_of_mean_and_min(monkeypatch):
    import feddg.experiment

    now = _fake_clock(monkeypatch, throughput)
    per_round: list[float] = []
    monkeypatch.setattr(feddg.experiment, "run_experiment", lambda cfg, out, progress: now.__setitem__(0, 10.0))
    monkeypatch.setattr(throughput, "read_metrics", lambda run: [{"time_round_s": s} for s in per_round])
    per_round[:] = [1.5, 2.0, 3.0]
    assert throughput.engine_seconds_per_round(None) == {
        "rounds": 3, "mean_round_s": 2.5, "min_round_s": 2.0, "total_s": 10.0, "overhead_s": 3.5}
    now[0], per_round[:] = 0.0, [4.0]  # one round: it is the steady state
    assert throughput.engine_seconds_per_round(None) == {
        "rounds": 1, "mean_round_s": 4.0, "min_round_s": 4.0, "total_s": 10.0, "overhead_s": 6.0}


def test_train_images_per_second_counts_images_not_steps(monkeypatch):
    ticks = iter(np.arange(0.0, 100.0, 0.25))  # each reading 0.25 s on: 3 steps fit in 1 s
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    assert throughput.train_images_per_second("cnn4", 28, batch=2, seconds=1.0, rounds=1) == 2 * 3 / 1.0


class _Bench:
    """A :class:`~feddg.bench.throughput.LoopBench` stand-in that records each run's loop and seed."""

    def __init__(self, plain_seconds: float = 0.0) -> None:
        self.calls: list[tuple[str, int]] = []
        self.plain_seconds, self.steps = plain_seconds, 3
        self.task, self.units = SimpleNamespace(name="classification"), ("img", 64.0)

    def feddg(self, seed: int) -> float:
        self.calls.append(("feddg", seed))
        return float(seed)

    def plain(self, seed: int) -> float:
        self.calls.append(("plain", seed))
        return self.plain_seconds or float(seed)


def test_time_loops_interleave_the_two_loops_with_a_fresh_seed_each_repeat():
    bench = _Bench()
    times = throughput.time_loops(bench, 2)
    assert bench.calls == [("feddg", 0), ("plain", 0), ("feddg", 1), ("plain", 1), ("feddg", 2), ("plain", 2)]
    assert times == {"feddg train_local": [1.0, 2.0], "plain PyTorch": [1.0, 2.0]}


def test_calibrated_steps_divide_the_seconds_by_one_plain_step(monkeypatch):
    monkeypatch.setattr(throughput, "loop_bench", lambda *_: _Bench(plain_seconds=0.3))  # 3 steps: 0.1 s each
    assert throughput._calibrated_steps("cnn4", 28, 8, 2.0, None) == 20
    assert throughput._calibrated_steps("cnn4", 28, 8, 0.05, None) == 2  # at least 2


def test_loops_table_gives_per_second_from_min_and_median_and_feddg_over_plain(monkeypatch):
    times = {"feddg train_local": [2.0, 1.0, 4.0], "plain PyTorch": [0.5, 0.8, 2.0]}
    monkeypatch.setattr(throughput, "loop_bench", lambda *_: _Bench())
    monkeypatch.setattr(throughput, "time_loops", lambda bench, repeats: times)
    fed, plain = table_cells(throughput.loops_table(["cnn4@28"], 1, 1.0, batch=8, repeats=3, steps=5))
    # 64 images: feddg 64 / 1 s best, 64 / 2 s median; plain 64 / 0.5 s and 64 / 0.8 s
    assert fed == ["cnn4", "28", "classification", "5", "feddg train_local", "64 img", "32 img", "0.50, 0.40"]
    assert plain == ["cnn4", "28", "classification", "5", "plain PyTorch", "128 img", "80 img", ""]


def test_a_loop_bench_counts_whole_batches_and_the_images_it_trains_on():
    bench = throughput.LoopBench(torch.nn.Identity(), {}, None, None, np.arange(70), torch.zeros(10, 3), torch.zeros(10),
                                 32)
    assert bench.steps == 2 and bench.units == ("img", 70.0)

