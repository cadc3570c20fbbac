import json

import numpy as np
import pytest
from thread_counts import blas_threads
from toy import toy_federation

from feddg.engines.inprocess import run_inprocess, run_round
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped


def _run(tmp_path, *over, name="run"):
    server = Server(toy_federation(*over), tmp_path / name)
    results = run_inprocess(server)
    return server, results


def _without_times(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


def test_training_learns_and_writes_the_run_directory(tmp_path):
    _, res = _run(tmp_path, "federation.rounds=4")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert res["final"]["id_acc"] > 60  # 4 classes: chance is 25 %
    assert set(res["final"]) >= {"id_acc/a", "id_acc/b", "ood_acc/c", "ood_acc"}
    assert rows[0]["bytes_up"] > 0 and rows[0]["bytes_down"] > 0
    assert (tmp_path / "run" / "config.yaml").is_file() and (tmp_path / "run" / "results.json").is_file()


def test_bytes_are_counted_from_the_messages(tmp_path):
    server, _ = _run(tmp_path, "federation.rounds=1")
    n_params = sum(v.numel() for v in server.fed.model.state_dict().values() if v.dtype.is_floating_point)
    row = server.metrics[0]
    # 4 clients each receive and send all float32 weights (plus small scalars and key names)
    assert 4 * 4 * n_params < row["bytes_down"] < 4 * 4 * n_params + 4 * 600
    assert 4 * 4 * n_params < row["bytes_up"] < 4 * 4 * n_params + 4 * 600


def test_same_seed_same_metrics_other_seed_differs(tmp_path):
    a, _ = _run(tmp_path, name="a")
    b, _ = _run(tmp_path, name="b")
    c, _ = _run(tmp_path, "seed=1", name="c")
    assert _without_times(a.metrics) == _without_times(b.metrics)
    assert _without_times(a.metrics) != _without_times(c.metrics)


def test_resume_after_a_crash_gives_the_uninterrupted_result(tmp_path):
    full, _ = _run(tmp_path, "federation.rounds=4", name="full")
    crashed = Server(toy_federation("federation.rounds=4"), tmp_path / "crash")
    crashed.mark_setup_done()
    for r in (1, 2):
        run_round(crashed, r)
    crashed.configure(3)  # killed in the middle of round 3: nothing of it is saved
    resumed = Server(toy_federation("federation.rounds=4"), tmp_path / "crash", resume=True)
    assert resumed.round == 2
    run_inprocess(resumed)
    assert _without_times(resumed.metrics) == _without_times(full.metrics)
    final_full, final_resumed = full.state["weights"], resumed.state["weights"]
    assert all(np.array_equal(final_full[k], final_resumed[k]) for k in final_full)


def test_checkpoint_every_k_rounds_resumes_from_the_last_checkpoint(tmp_path):
    over = ("federation.rounds=5", "federation.checkpoint_every=2")
    full, _ = _run(tmp_path, *over, name="full")
    crashed = Server(toy_federation(*over), tmp_path / "crash")
    crashed.mark_setup_done()
    for r in (1, 2, 3):
        run_round(crashed, r)  # killed after round 3: round 2 was the last checkpoint
    assert len((tmp_path / "crash" / "metrics.jsonl").read_text().splitlines()) == 3
    resumed = Server(toy_federation(*over), tmp_path / "crash", resume=True)
    assert resumed.round == 2
    assert len((tmp_path / "crash" / "metrics.jsonl").read_text().splitlines()) == 2  # round 3 is redone
    run_inprocess(resumed)
    assert _without_times(resumed.metrics) == _without_times(full.metrics)
    assert Server(toy_federation(*over), tmp_path / "full", resume=True).round == 5  # the last round is saved


def test_fedprox_equals_fedavg_at_mu_zero_and_differs_otherwise(tmp_path):
    avg, _ = _run(tmp_path, name="avg")
    prox0, _ = _run(tmp_path, "method.name=fedprox", "method.params.mu=0.0", name="p0")
    prox1, _ = _run(tmp_path, "method.name=fedprox", "method.params.mu=1.0", name="p1")
    w_avg, w0, w1 = (s.state["weights"] for s in (avg, prox0, prox1))
    assert all(np.array_equal(w_avg[k], w0[k]) for k in w_avg)
    assert max(float(np.abs(w_avg[k] - w1[k]).max()) for k in w_avg) > 1e-4


def test_client_sampling_fraction(tmp_path):
    server, _ = _run(tmp_path, "federation.client_fraction=0.5", "federation.rounds=2")
    assert [m["clients"] for m in server.metrics] == [2, 2]


def test_a_reply_that_breaks_the_contract_is_rejected(tmp_path):
    import torch

    fed = toy_federation()
    original = fed.method.client_update

    def leaky(model, msg, state, ctx):
        reply, st = original(model, msg, state, ctx)
        return {**reply, "raw": torch.zeros(1)}, st

    fed.method.client_update = leaky
    with pytest.raises(RunStopped, match=r"round 1: 0 of 4 clients .*client 0: TypeError: reply of client 0\['raw'\]"):
        run_inprocess(Server(fed, tmp_path / "x"))


def test_every_worker_count_gives_the_same_bits_under_the_default_thread_policy(tmp_path, cache_dir, monkeypatch):
    """A worker runs its clients with one torch thread and the server folds the replies in the order sent;
    ``federation.threads: auto`` gives the server process one thread too, so ``workers`` 1, 2 and ``auto`` (on
    one core: sequential) give exactly the same bits, and the thread count is restored after the run;
    ``threads: 2`` runs the rounds on two."""
    import torch

    from feddg.config import build_config
    from feddg.engines import workers
    from feddg.federation.setup import build_federation

    over = ["data.max_per_domain=60", "partition.num_clients=3", "federation.rounds=2", "model.name=lenet",
            "split.target=uci", f"data.cache_dir={cache_dir}", "device=cpu"]
    threads: list[int] = []
    blas: list[set[int]] = []  # numpy's BLAS threads in the server process: the same policy as torch's

    def weights(name: str, count: str, *extra: str) -> dict:
        cfg = build_config({}, [*over, f"federation.workers={count}", *extra])
        server = Server(build_federation(cfg), tmp_path / name)
        run_inprocess(server, lambda row: threads.append(torch.get_num_threads()) or blas.append(blas_threads()))
        assert [m["round"] for m in server.metrics] == [1, 2]
        return server.state["weights"]

    before, blas_before = torch.get_num_threads(), blas_threads()
    seq = weights("seq", "1")
    assert threads == [1, 1] and blas == [{1}, {1}] and torch.get_num_threads() == before
    weights("two-threads", "1", "federation.threads=2")
    assert threads[-2:] == [2, 2] and blas[-2:] == [{2}, {2}] and torch.get_num_threads() == before
    par = weights("par", "2")
    assert blas[-2:] == [{1}, {1}] and blas_threads() == blas_before
    monkeypatch.setattr(workers, "usable_cores", lambda: 1)
    auto = weights("auto", "auto")
    assert threads[-2:] == [1, 1] and torch.get_num_threads() == before
    for k, v in seq.items():
        assert np.array_equal(par[k], v) and np.array_equal(auto[k], v), k


def test_a_worker_computes_on_one_torch_and_one_blas_thread_whatever_its_parent_had():
    import multiprocessing as mp

    import torch

    from feddg.engines.workers import compute_threads, use_one_thread

    def probe(out: "mp.Queue[tuple[int, set[int]]]") -> None:
        use_one_thread()
        out.put((torch.get_num_threads(), blas_threads()))

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with compute_threads(2):  # a parent with two torch and two BLAS threads (this machine's cores may be fewer)
        process = ctx.Process(target=probe, args=(out,))
        process.start()
        got = out.get(timeout=60)
        process.join()
    assert got == (1, {1})


def test_auto_is_a_worker_per_core_on_the_cpu_and_per_gpu_on_cuda(monkeypatch):
    import torch

    from feddg.engines import workers

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(workers, "usable_cores", lambda: 16)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert workers.resolve_workers("auto", cpu) == 16
    assert [workers.resolve_workers("auto", cpu, clients) for clients in (1, 3, 40)] == [0, 3, 16]  # <= clients
    assert workers.resolve_workers(8, cpu, clients=3) == 8  # a number asked for is a number given
    assert workers.resolve_workers("auto", cuda) == 0  # one GPU: sequential, not 16 processes on it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert workers.resolve_workers("auto", cuda) == 4
    assert workers.resolve_workers("auto", torch.device("cuda:1")) == 0  # every worker would be on GPU 1
    monkeypatch.setattr(workers, "usable_cores", lambda: 1)
    assert workers.resolve_workers("auto", cpu) == 0
    assert [workers.resolve_workers(n, cpu) for n in (1, 2, 3)] == [0, 2, 3]


def test_a_client_seed_draws_what_torch_manual_seed_draws():
    """The per-client seeding skips torch's accelerator backends on the CPU; its random streams are unchanged."""
    import torch

    from feddg.federation.client import seed_torch

    torch.manual_seed(1234)
    want = torch.rand(6), torch.randn(3)
    torch.manual_seed(99)  # another state in between
    seed_torch(1234, torch.device("cpu"))
    got = torch.rand(6), torch.randn(3)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_reply_without_num_examples_fails_that_client_in_one_line():
    from feddg.federation.client import try_client
    from feddg.messages import weights_of

    fed = toy_federation()
    original = fed.method.client_update

    def uncounted(model, msg, state, ctx):
        reply, st = original(model, msg, state, ctx)
        return {k: v for k, v in reply.items() if k != "num_examples"}, st

    fed.method.client_update = uncounted
    outcome = try_client(fed, 0, 1, {**weights_of(fed.model), "lr": 0.1, "round": 1}, {})
    assert outcome.reply is None
    assert outcome.error == "KeyError: \"fedavg: a client reply must contain 'num_examples'\""


def test_an_exception_is_described_on_one_line_within_the_limit():
    from feddg.federation.client import describe

    assert describe(ValueError("bad\n  input\tvalue")) == "ValueError: bad input value"
    long = describe(RuntimeError("x" * 400))
    assert len(long) == 300 and long == "RuntimeError: " + "x" * 283 + "..."
