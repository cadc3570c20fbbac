"""Scale (issue 13): the streaming fold is bit-equal to the all-at-once mean and holds O(model); the lazy
method registry; the cnn4 model; the scale configs' partitions; forked workers that rebuild nothing; the
bookkeeping of `feddg bench merge`, `memory` and `scale` on hand-made timings (no test asserts a speed)."""

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.tables import table_cells
from toy import toy_federation, toy_federation_of

from feddg.aggregation.mean import WeightedSum, weighted_mean, weighted_mean_messages
from feddg.algorithms.base import Reply
from feddg.algorithms.registry import METHODS, create_method, method_class
from feddg.bench.memory import model_bytes, peak_extra_bytes, synthetic_reply, synthetic_weights
from feddg.config import build_config, load_config
from feddg.data.partition import make_partition
from feddg.engines.workers import WorkerPool, can_fork
from feddg.messages import weights_of
from feddg.models import create_model
from feddg.models.permutation import apply_permutations, permutation_spec, random_permutations
from feddg.models.stages import conv_stages

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "scale"


def _replies(n: int, params: int = 2_000) -> list[Reply]:
    template = synthetic_weights(params, seed=3)
    rng = np.random.default_rng(1)
    out = []
    for k in range(n):
        msg = synthetic_reply(template, k)
        msg["w/layer0"] = msg["w/layer0"] + rng.standard_normal(msg["w/layer0"].shape).astype(np.float32)
        out.append(Reply(k, {**msg, "num_examples": int(rng.integers(1, 500))}))
    return out


def test_the_streamed_fold_gives_the_bits_of_the_all_at_once_mean():
    replies = _replies(37)
    method = create_method("fedavg")
    acc = method.start(sum(r.num_examples for r in replies))
    for r in replies:  # one at a time, as the server receives them
        acc = method.accumulate(acc, r)
    streamed = method.finish({}, acc)[0]["weights"]
    listed = weighted_mean_messages([r.message for r in replies], [r.num_examples for r in replies], "w/")
    assert streamed.keys() == listed.keys()
    for k in listed:
        assert streamed[k].dtype == listed[k].dtype and np.array_equal(streamed[k], listed[k]), k
    assert np.array_equal(method.aggregate({}, replies)[0]["weights"]["w/layer4"], listed["w/layer4"])


def test_weighted_sum_matches_weighted_mean_bit_for_bit():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((5, 7)).astype(np.float32) for _ in range(11)]
    weights = rng.integers(1, 1000, size=11).tolist()
    fold = WeightedSum("w/", expected=float(sum(weights)))
    for a, w in zip(arrays, weights, strict=True):
        fold.add({"w/a": a}, w)
    assert np.array_equal(fold.mean()["w/a"], weighted_mean(arrays, weights))


def test_a_streamed_round_holds_a_few_models_however_many_clients_reply():
    template = synthetic_weights(100_000)
    one = model_bytes(template)
    streamed, _ = peak_extra_bytes("streaming", template, 50)
    listed, _ = peak_extra_bytes("all-at-once", template, 50)
    assert streamed < 5 * one, f"streamed fold peaked at {streamed / one:.1f} models"
    assert listed > 50 * one  # the old way: the list of replies (this is what the bound catches)


def test_the_method_registry_imports_no_method_until_asked():
    code = ("import sys, feddg.algorithms.registry as r; "
            "print(sorted(m for m in sys.modules if m.startswith(('sklearn', 'finch', 'ot', 'feddg.algorithms.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['feddg.algorithms.base', 'feddg.algorithms.registry']"


def test_every_registry_line_names_its_class():
    for name in list(METHODS):
        assert method_class(name).name == name
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        method_class("nope")


def test_cnn4_is_the_94k_four_conv_cnn_with_stages_and_a_permutation_spec():
    torch.manual_seed(0)
    model = create_model("cnn4", num_classes=10).eval()
    assert sum(p.numel() for p in model.parameters()) == 94_122
    assert conv_stages(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    for m in model.modules():  # non-trivial BatchNorm, so a forgotten statistic shows
        if isinstance(m, torch.nn.BatchNorm2d):
            m.weight.data.normal_()
            m.running_mean.normal_()
    x = torch.randn(2, 3, 28, 28)
    spec = permutation_spec(model)
    with torch.no_grad():
        before = model(x)
        perms = random_permutations(spec, np.random.default_rng(0))
        model.load_state_dict(apply_permutations(model.state_dict(), spec, perms))
        torch.testing.assert_close(model(x), before, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("name", "clients", "sampled"), [("femnist-scale", 3400, 50), ("iwildcam-scale", 243, 24)])
def test_the_scale_configs_give_every_client_data(name, clients, sampled):
    cfg = load_config(CONFIGS / f"{name}.yaml", [])
    assert cfg.partition.num_clients == clients
    assert round(cfg.federation.client_fraction * clients) == sampled
    domain_ids = np.repeat(np.arange(4), [2500, 1797, 5000, 2500])  # Digits-DG: mnist (the target), uci, synth, mnistm
    source = np.flatnonzero(domain_ids != 0)
    p = cfg.partition
    rng = np.random.default_rng(0)
    part = make_partition(p.kind, source, domain_ids, domain_ids % 10, p.num_clients, rng, **p.params)
    sizes = [len(c) for c in part.client_indices]
    assert len(sizes) == clients and min(sizes) >= 2 and sum(sizes) == len(source)


def _refuse(cfg):
    raise AssertionError("a forked worker must not rebuild the federation")


@pytest.mark.skipif(not can_fork(), reason="needs fork")
def test_forked_workers_use_the_servers_federation_as_it_is():
    cfg = build_config({"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
                        "federation": {"batch_size": 16, "workers": 2}, "device": "cpu"})
    fed = toy_federation_of(cfg)
    msg = {**weights_of(fed.model), "lr": 0.1, "round": 1}
    with WorkerPool(cfg, 2, factory=_refuse, fed=fed) as pool:
        outcomes = dict(pool.run_clients(1, {0: msg, 1: msg, 2: msg}, {}))
    assert all(o.reply is not None and o.reply["num_examples"] > 0 for o in outcomes.values()), outcomes


def test_bench_all_memory_rows_count_models_held_and_judge_the_target():
    from feddg.bench.summary import memory_rows

    rows = memory_rows(20_000, [10, 300])
    assert [r.figure.split(", ")[2] for r in rows] == ["10 clients × 20,000 params", "300 clients × 20,000 params"]
    for r in rows:  # the streamed fold holds a few models (float64 sums + the reply being folded), not one per client
        assert r.ratio is not None and 1.0 <= r.ratio <= 8.0 and r.met


def test_bench_all_times_feddg_methods_interleaved_with_its_yardstick(monkeypatch):
    # it ran every bare-python start, then every feddg one (A A A B B B): a load change between the blocks went
    # into the ratio
    from feddg.bench import summary

    order: list[str] = []
    monkeypatch.setattr(summary, "_seconds", lambda cmd, n: order.extend(["feddg" if "feddg" in cmd else "bare"] * n)
                        or [0.1] * n)
    row = summary.methods_row(3)
    assert order == ["feddg", "bare", "feddg", "bare", "feddg", "bare", "feddg"]  # a warm-up, then A B A B A B
    assert row.ratio == 1.0 and row.met


def test_the_merge_bound_counts_exactly_the_flops_of_its_products():
    """M1's exact-cost bound divides the merge's GEMM FLOPs (torch's FlopCounterMode) by the GEMM rate; a
    function doing two known products counts 2·m·k·n each, and a mean adds none."""
    from feddg.bench.merge import merge_gflop

    a, b, c = torch.ones(30, 40), torch.ones(40, 50), torch.ones(50, 7)

    def two_products() -> object:
        return (a @ b) @ c + a.mean()

    assert merge_gflop(two_products) == pytest.approx((2 * 30 * 40 * 50 + 2 * 30 * 50 * 7) / 1e9, rel=1e-12)
    if torch.backends.mkldnn.is_available():  # FOT's products on oneDNN count the same
        from feddg.aggregation.fot import onednn_cross

        out = torch.empty(30, 50)
        assert merge_gflop(lambda: onednn_cross(a, b.T.contiguous(), out)) == pytest.approx(2 * 30 * 40 * 50 / 1e9)


def test_the_gemm_clock_times_every_product_of_a_merge_and_gives_the_kernels_back(monkeypatch):
    """M1's floor times eq. 3's products inside the merge: FOT takes its CPU kernel from the table the clock wraps
    (oneDNN's, MKL's under pinned kernels); with each kernel made 2 ms slower, the lap of a two-station ResNet-18
    alignment (40 products) is at least 80 ms and at most the alignment's wall time, and after the block the table
    holds the kernels it held before."""
    from feddg.aggregation import fot
    from feddg.bench.merge import GemmClock
    from feddg.models.permutation import apply_permutations, permutation_spec, random_permutations
    from feddg.reproducibility import PORTABLE_DEFAULTS, PORTABLE_ENV

    calls = []

    def slower(kernel):
        def run(a, b, out):
            calls.append(a.shape)
            time.sleep(0.002)
            kernel(a, b, out)

        return run

    for name, kernel in list(fot.CPU_CROSS_PRODUCTS.items()):
        monkeypatch.setitem(fot.CPU_CROSS_PRODUCTS, name, slower(kernel))
    kernels = dict(fot.CPU_CROSS_PRODUCTS)
    unpinned = "oneDNN" if "oneDNN" in kernels else "MKL"
    assert fot.cross_product(torch.device("cpu")) is kernels[unpinned]
    with monkeypatch.context() as pinned:
        for k, v in {**PORTABLE_DEFAULTS, **PORTABLE_ENV}.items():
            pinned.setenv(k, str(v))
        assert fot.cross_product(torch.device("cpu")) is kernels["MKL"]
    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=5, image_size=32)
    spec = permutation_spec(model)
    ref = model.state_dict()
    rng = np.random.default_rng(0)
    others = [apply_permutations(ref, spec, random_permutations(spec, rng)) for _ in range(2)]
    clock = GemmClock()
    t0 = time.perf_counter()
    with clock:
        fot.align_to_reference(ref, others, spec, solver="hungarian")
    wall = time.perf_counter() - t0
    assert len(calls) == 40 and 40 * 0.002 <= clock.laps[0] <= wall
    assert fot.CPU_CROSS_PRODUCTS == kernels
    assert clock.shortest() == clock.laps[0]
    with clock:  # a block without products
        pass
    assert clock.laps[1] == 0.0
    with pytest.raises(RuntimeError, match="did not run through the GEMM clock"):  # no floor from it
        clock.shortest()


def test_the_bound_s_gemm_kernels_are_float32_products_and_the_fastest_is_taken(monkeypatch):
    """Every kernel M1's bound may take computes ``a @ b`` in float32 (to float32 rounding), and the bound takes the
    fastest measured rate (on an AMD EPYC oneDNN's, 2.2× MKL's, which ``torch.mm`` runs)."""
    from feddg.bench import merge as bench_merge

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 300, generator=g), torch.randn(48, 300, generator=g)
    exact = a.double() @ b.double().T
    assert "MKL" in bench_merge.CPU_CROSS_PRODUCTS
    for name, gemm in bench_merge.CPU_CROSS_PRODUCTS.items():
        out = torch.full((64, 48), float("nan"))
        gemm(a, b, out)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4, msg=name)
    monkeypatch.setattr(bench_merge, "CPU_CROSS_PRODUCTS", {"slow": torch.mm, "fast": torch.mm, "middle": torch.mm})
    rates = {"slow": 100.0, "fast": 300.0, "middle": 200.0}
    monkeypatch.setattr(bench_merge, "gemm_gflops", lambda threads, kernel="MKL", **_: rates[kernel])
    assert bench_merge.fastest_gemm(2) == ("fast", 300.0)


def test_time_merges_interleave_the_merges_on_the_threads_asked_and_give_the_callers_back():
    from feddg.bench.merge import time_merges

    calls: list[tuple[str, int]] = []
    merges = {name: (lambda name=name: calls.append((name, torch.get_num_threads()))) for name in ("a", "b")}
    times = time_merges(merges, repeats=3, threads=2)
    assert calls == [("a", 2), ("b", 2)] * 3 and torch.get_num_threads() == 1  # A B A B A B; conftest's 1 thread back
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}


def test_merge_summary_is_min_and_median():
    from feddg.bench.merge import summary

    assert summary([3.0, 1.0, 2.0, 10.0]) == (1.0, 2.5)


def test_a_linear_s_flops_are_two_per_multiply_add():
    from feddg.bench.merge import _linear_flop

    assert _linear_flop([4, 5], [7, 5]) == 2 * 4 * 5 * 7  # input [4, 5] · weight [7, 5]ᵀ


def test_the_gemm_rate_is_2mkn_over_the_best_timed_product_after_the_warm_ups(monkeypatch):
    """A fake kernel on a fake clock: 3 warm-ups of 0.01 s, then 0.5, 0.2 and 0.4 s; the rate counts 2·m·k·n FLOPs
    of the best, 0.2 s, on the threads asked."""
    from feddg.bench import merge as bench_merge

    now, seconds, threads = [0.0], iter([0.01, 0.01, 0.01, 0.5, 0.2, 0.4]), []

    def kernel(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        assert (a.shape, b.shape, out.shape) == ((2, 3), (4, 3), (2, 4))
        threads.append(torch.get_num_threads())
        now[0] += next(seconds)

    monkeypatch.setitem(bench_merge.CPU_CROSS_PRODUCTS, "fake", kernel)
    monkeypatch.setattr(bench_merge, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    rate = bench_merge.gemm_gflops(3, shape=(2, 3, 4), repeats=3, kernel="fake")
    assert rate == pytest.approx(2 * 2 * 3 * 4 / 0.2 / 1e9, rel=1e-12)
    assert threads == [3] * 6 and torch.get_num_threads() == 1


def test_the_gemm_clock_adds_up_a_block_s_products_and_its_floor_is_the_shortest_lap(monkeypatch):
    from feddg.bench import merge as bench_merge

    now = [0.0]

    def kernel(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        now[0] += float(out[0, 0])  # each product takes the seconds written in its output

    monkeypatch.setitem(bench_merge.CPU_CROSS_PRODUCTS, "fake", kernel)
    monkeypatch.setattr(bench_merge, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = bench_merge.GemmClock()
    for seconds in ([0.5, 0.25], [0.125]):  # two blocks: products of 0.5 + 0.25 s, then one of 0.125 s
        with clock:
            for s in seconds:
                bench_merge.CPU_CROSS_PRODUCTS["fake"](torch.ones(1), torch.ones(1), torch.full((1, 1), s))
    assert clock.laps == [0.75, 0.125] and clock.shortest() == 0.125
    assert bench_merge.CPU_CROSS_PRODUCTS["fake"] is kernel


def test_the_mean_pass_weights_each_station_by_its_gamma():
    from feddg.bench.merge import MergeCase, mean_pass

    case = MergeCase([{"w/a": np.array([1.0, 2.0])}, {"w/a": np.array([5.0, 6.0])}], [], [1.0, 3.0], None)
    np.testing.assert_allclose(mean_pass(case)()["w/a"], [(1 + 3 * 5) / 4, (2 + 3 * 6) / 4])


def test_synthetic_replies_scale_the_template_and_count_100_plus_k_mod_50_examples():
    from feddg.bench.memory import examples, streaming_fold

    template = synthetic_weights(1_000)
    reply = synthetic_reply(template, 51)
    assert reply["num_examples"] == 101 and reply["w/bn.num_batches_tracked"] == 7 + 51
    np.testing.assert_allclose(reply["w/layer4"], template["w/layer4"] * 1.051, rtol=1e-6)
    assert examples(52) == 50 * 100 + sum(range(50)) + 100 + 101
    # the fold's weights are the example-weighted mean of the scales: Σ (100 + k % 50)(1 + k / 1000) / Σ (100 + k % 50)
    n = [100 + k % 50 for k in range(52)]
    scale = sum(m * (1 + k / 1000) for k, m in enumerate(n)) / sum(n)
    np.testing.assert_allclose(streaming_fold(template, 52)["w/layer2"], template["w/layer2"] * scale, rtol=1e-6)


def test_the_memory_table_measures_a_list_that_fits_and_computes_one_that_does_not(monkeypatch):
    from feddg.bench import memory

    template = synthetic_weights(1_000)
    mb = 4 * (20 + 80 + 150 + 250 + 500) + 8  # five float32 layers and an int64 counter
    assert model_bytes(template) == mb
    monkeypatch.setattr(memory, "peak_extra_bytes", lambda fold, t, n: (2**20 * (n + (fold == "all-at-once")), 0.5))
    rows = memory.memory_table(1_000, [2, 5], max_list_bytes=2 * mb)  # 2 replies fit exactly, 5 do not
    assert rows == [
        {"fold": "streaming", "clients": 2, "peak_mb": 2.0, "models": 2 * 2**20 / mb, "seconds": 0.5, "note": "measured"},
        {"fold": "all-at-once", "clients": 2, "peak_mb": 3.0, "models": 3 * 2**20 / mb, "seconds": 0.5,
         "note": "measured"},
        {"fold": "streaming", "clients": 5, "peak_mb": 5.0, "models": 5 * 2**20 / mb, "seconds": 0.5, "note": "measured"},
        {"fold": "all-at-once", "clients": 5, "peak_mb": 5 * mb / 2**20, "models": 5.0, "seconds": pytest.approx(np.nan,
         nan_ok=True), "note": "computed (clients × model), not allocated"}]


def test_a_round_s_peak_leaves_out_what_was_held_and_freed_before_it():
    import tracemalloc

    template = synthetic_weights(100_000)
    one = model_bytes(template)
    tracemalloc.start()
    try:
        held = np.ones(20 * one // 8)  # held through the round: not the round's
        freed = np.ones(40 * one // 8)  # a peak before the round
        del freed
        streamed, _ = peak_extra_bytes("streaming", template, 5)
        assert tracemalloc.is_tracing()  # the caller's tracing goes on
    finally:
        tracemalloc.stop()
    assert held.size and streamed < 5 * one, f"the streamed fold's peak counted {streamed / one:.1f} models"


def test_the_peak_rss_starts_again_at_each_reset_and_is_ru_maxrss_without_proc(monkeypatch):
    import math
    import mmap
    import resource

    from feddg.bench import scale
    from feddg.bench.memory import reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("the peak cannot be reset here (no /proc/self/clear_refs, or a kernel that keeps the old peak)")
    block = mmap.mmap(-1, 100 * 2**20)  # 100 MiB of its own mapping: unmapped on close, whatever malloc keeps
    for page in range(0, len(block), mmap.PAGESIZE):
        block[page] = 1  # touched: resident
    high = scale.peak_rss_mb()
    block.close()
    if not reset_peak_rss():
        pytest.skip("this kernel takes the write to clear_refs but keeps the old peak")
    assert scale.peak_rss_mb() < high - 50  # a later run's peak no longer shows the 100 MiB freed before it
    monkeypatch.setattr(scale, "rss_mb", lambda field: math.nan)  # no /proc: the process's peak since it started
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=3 * 1024 * 1024))  # KiB
    assert scale.peak_rss_mb() == 3072.0


def test_a_reset_is_one_only_where_the_peak_then_meets_the_resident_memory(monkeypatch):
    from feddg.bench import memory

    writes = []
    monkeypatch.setattr(memory, "Path", lambda path: SimpleNamespace(write_text=lambda text: writes.append((path, text))))
    status = {"VmHWM": 1594.0, "VmRSS": 1494.0}  # CI's kernel: the write was taken, the 100 MiB peak kept
    monkeypatch.setattr(memory, "rss_mb", lambda field: status[field])
    assert not memory.reset_peak_rss()
    status["VmRSS"] = 1594.0 - memory.RESET_SLACK_MB  # freed by another thread between the two reads
    assert memory.reset_peak_rss()
    assert writes == [("/proc/self/clear_refs", "5")] * 2


def test_scale_run_books_each_round_and_leaves_the_rest_to_build(monkeypatch):
    import feddg.experiment
    from feddg.bench import scale, w1

    now, cpu, events = [0.0], [50.0], []

    def run(cfg: object, out: Path, progress: bool) -> None:
        now[0] += 10.0
        cpu[0] += 17.0
        events.append("run")

    monkeypatch.setattr(feddg.experiment, "run_experiment", run)
    monkeypatch.setattr(scale, "read_metrics", lambda path: [{"time_round_s": "1.5", "clients": "50"},
                                                             {"time_round_s": "2.25", "clients": "48"}])
    monkeypatch.setattr(scale, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(w1, "cpu_seconds", lambda: cpu[0])
    monkeypatch.setattr(scale, "reset_peak_rss", lambda: events.append("reset") or False)
    monkeypatch.setattr(scale, "peak_rss_mb", lambda: events.append("peak") or 321.0)
    assert scale.scale_run(None) == {"sampled": [50, 48], "round_s": [1.5, 2.25], "total_s": 10.0, "cpu_s": 17.0,
                                     "build_s": 6.25, "peak_mb": 321.0, "peak_own": False}
    assert events == ["reset", "run", "peak"]  # the run's own peak


def test_the_plain_round_trains_each_client_s_epochs_skipping_batches_of_one_and_evaluates_every_held_out_image():
    from feddg.bench.scale import plain_round_seconds

    # 54 training images a client in batches of 53: one batch of 53 an epoch (the batch of one is skipped);
    # held out: the target domain's 120 images and each client's 6, in batches of 100
    fed = toy_federation("federation.batch_size=53", "federation.local_epochs=2", "eval.batch_size=100")
    assert [len(c.train_idx) for c in fed.clients] == [54] * 4 and [len(c.holdout_idx) for c in fed.clients] == [6] * 4
    before = {k: v.clone() for k, v in fed.model.state_dict().items()}
    seen: list[tuple[bool, int]] = []
    fed.model.register_forward_hook(lambda m, args, out: seen.append((m.training, len(args[0]))))
    seconds = plain_round_seconds(fed, [0, 2], lr=0.1)
    assert seen == [(True, 53)] * 4 + [(False, 100), (False, 44)]  # 2 clients × 2 epochs, then 144 images
    assert set(seconds) == {"train", "eval"}
    for k, v in fed.model.state_dict().items():  # the model is left at its start
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(("own", "peak"), [(True, "1,234"), (False, "1,234 (process so far)")])
def test_scale_report_divides_the_min_last_round_by_the_min_plain_train_plus_eval(monkeypatch, own, peak):
    from feddg.bench import scale, w1

    runs = iter([{"sampled": [50, 50], "round_s": [3.0, 2.5], "total_s": 20.0, "cpu_s": 30.0, "build_s": 14.5,
                  "peak_mb": 1200.0, "peak_own": True},
                 {"sampled": [50, 49], "round_s": [3.1, 2.0], "total_s": 18.0, "cpu_s": 35.0, "build_s": 12.9,
                  "peak_mb": 1234.0, "peak_own": own}])  # own: its peak could be reset
    plain = iter([{"train": 0.6, "eval": 0.4, "clients": 3400.0}, {"train": 0.5, "eval": 0.7, "clients": 3400.0}])
    monkeypatch.setattr(scale, "scale_run", lambda cfg: next(runs))
    monkeypatch.setattr(scale, "yardstick", lambda cfg: next(plain))
    monkeypatch.setattr(w1, "load_average", lambda: "0.10 0.20 0.30")
    path = CONFIGS / "femnist-scale.yaml"
    before, table, after = scale.scale_report([path], 2, [], repeats=2)
    assert before == "load average before: 0.10 0.20 0.30" and after == "load average after: 0.10 0.20 0.30"
    # last rounds 2.5 and 2.0 s against train + eval of 1.0 and 1.2 s: 2.0 / 1.0
    assert table_cells(table) == [[str(path), "3,400", "50 50", "12.9", "2.00 (2.25)", "1.00 (0.50 + 0.40)", "2.00",
                              "18.0 / 30.0", peak, "1,024"]]  # the larger peak; the default budget


def test_the_scale_yardstick_trains_the_last_round_s_clients_at_its_learning_rate_on_one_thread(monkeypatch):
    from feddg.bench import scale

    # 3 rounds, step decay by half each round: the last round's learning rate is 0.1 · 0.5² = 0.025
    fed = toy_federation("seed=1", "federation.client_fraction=0.5", "optim.schedule=step", "optim.step_size=1",
                         "optim.gamma=0.5")
    asked: list[tuple[list[int], float, int]] = []

    def plain(f: object, clients: list[int], lr: float) -> dict[str, float]:
        asked.append((clients, lr, torch.get_num_threads()))
        return {"train": 1.0, "eval": 2.0}

    monkeypatch.setattr(scale, "build_federation", lambda cfg: fed)
    monkeypatch.setattr(scale, "plain_round_seconds", plain)
    assert scale.yardstick(fed.cfg) == {"train": 1.0, "eval": 2.0, "clients": 4}
    last = sorted(fed.topology.sample(3, 0.5, 1))
    assert len(last) == 2 and last != sorted(fed.topology.sample(2, 0.5, 1))  # round 2 samples others
    assert [(sorted(c), lr, t) for c, lr, t in asked] == [(last, pytest.approx(0.025), 1)]
