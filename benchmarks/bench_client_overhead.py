"""Per-client overhead (issue 29): feddg's client path against a plain loop of the same compute.

The same sampled clients of one round (femnist-scale: 50 of 3,400, one batch each) from the same global
weights, on one torch thread: A = ``federation/client.py: try_client`` for each (seeding, context, batches
read from the dataset, the method's load / train / reply, validation); B = a plain PyTorch loop of the same
compute (``load_state_dict`` of the global weights, the client's batches read before the clock starts, SGD
steps, reply = a copy of the state_dict). A and B interleave, A B A B; per client, in ms: min and median over
the passes, and the mean over clients of each client's fastest A minus its fastest B (the least noisy figure on a
shared machine).
``--profile N`` prints a cProfile (``tottime``) of N passes of A instead.

    OMP_NUM_THREADS=1 python benchmarks/bench_client_overhead.py               # --repeats 7
    OMP_NUM_THREADS=1 python benchmarks/bench_client_overhead.py --profile 20
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from feddg.config import load_config
from feddg.devices import Inputs
from feddg.engines.workers import torch_threads
from feddg.federation.client import client_context, try_client
from feddg.federation.server import Server
from feddg.federation.setup import Federation, build_federation
from feddg.messages import Message, subset

CONFIG = Path("configs/scale/femnist-scale.yaml")


def feddg_pass(fed: Federation, sent: dict[int, Message], round: int) -> list[float]:
    """Seconds of ``try_client`` for each client of ``sent`` (no client state: FedAvg keeps none)."""
    times = []
    for cid, msg in sent.items():
        t0 = time.perf_counter()
        if try_client(fed, cid, round, msg, {}).reply is None:
            raise RuntimeError(f"client {cid} failed")
        times.append(time.perf_counter() - t0)
    return times


def client_batches(fed: Federation, sent: dict[int, Message], round: int) -> list[list[tuple[Inputs, Tensor]]]:
    """Each client's batches of ``round``, exactly as its context draws them (same order, same samples)."""
    out = []
    for cid in sent:
        ctx = client_context(fed, cid, round)
        out.append([b for _ in range(ctx.local_epochs) for b in ctx.batches()])
    return out


def plain_pass(model: nn.Module, start: dict[str, Tensor], batches: list[list[tuple[Inputs, Tensor]]],
               lr: float, momentum: float, weight_decay: float) -> list[float]:
    """Seconds of the plain loop for each client: load the start, SGD over its pre-read batches, copy the weights."""
    times = []
    for client in batches:
        t0 = time.perf_counter()
        model.load_state_dict(start)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        for x, y in client:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        {k: v.detach().clone() for k, v in model.state_dict().items()}  # the reply's copy
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved passes of each loop (>= 5)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many passes of feddg's path instead")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    cfg = load_config(args.config, [])
    fed = build_federation(cfg)
    with tempfile.TemporaryDirectory() as tmp, torch_threads(1):
        server = Server(fed, Path(tmp) / "run")
        round = 1
        sent = server.configure(round)
        n = len(sent)
        first = next(iter(sent.values()))
        start = {k: torch.from_numpy(v).clone() for k, v in subset(first, "w/").items()}  # type: ignore[arg-type]
        batches = client_batches(fed, sent, round)
        feddg_pass(fed, sent, round)  # warm-up of both (first optimiser, allocator)
        lr, o = float(first["lr"]), cfg.optim
        plain_pass(fed.model, start, batches, lr, o.momentum, o.weight_decay)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile):
                feddg_pass(fed, sent, round)
            prof.disable()
            pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "30")))
            return
        load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
        runs_a, runs_b = [], []  # [repeat][client] seconds
        for _ in range(args.repeats):
            runs_a.append(feddg_pass(fed, sent, round))
            runs_b.append(plain_pass(fed.model, start, batches, lr, o.momentum, o.weight_decay))
        load_after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    a, b = ([sum(run) / n * 1e3 for run in runs] for runs in (runs_a, runs_b))
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    # each client's fastest time of either path over the repeats: the noise of a shared machine only adds time
    best = statistics.fmean(min(r[i] for r in runs_a) - min(r[i] for r in runs_b) for i in range(n)) * 1e3
    print(f"{args.config}: {n} clients of round {round}, {sum(map(len, batches))} batches, "
          f"{args.repeats} interleaved repeats, one torch thread; load average {load_before} -> {load_after}")
    print(f"{'ms per client':>28} {'min':>7} {'median':>7}")
    for name, xs in (("feddg try_client (A)", a), ("plain loop (B)", b), ("overhead, pairwise A - B", diffs)):
        print(f"{name:>28} {min(xs):7.3f} {statistics.median(xs):7.3f}")
    print(f"{'overhead, min A - min B':>28} {min(a) - min(b):7.3f}")
    print(f"{'overhead, per-client minima':>28} {best:7.3f}   (mean over clients of min A_i - min B_i)")


if __name__ == "__main__":
    main()
