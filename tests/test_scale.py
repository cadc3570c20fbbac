"""Scale (issue 13): the streaming fold is bit-equal to the all-at-once mean and holds O(model); the lazy
method registry; the cnn4 model; the scale configs' partitions; forked workers that rebuild nothing."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from toy import toy_federation_of

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
