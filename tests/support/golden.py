"""Short runs whose metrics (times stripped) and final-weight digests are recorded (tests/fixtures/golden_*.json):
a refactor must reproduce them bit for bit.

The figures are computed with the kernels of ``reproducibility: portable`` (feddg/reproducibility.py), which gives
the same bits on any x86-64 CPU with AVX2, so this script runs in a process of its own with that environment::

    python tests/support/golden.py [--cache DIR] [--only NAME ...]      # JSON of every case on stdout
    python tests/support/golden.py --record                              # rewrite the fixtures (a deliberate change)

It re-executes itself with the pinned environment when started without it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent
FIXTURES = TESTS / "fixtures"
sys.path[:0] = [str(TESTS)]


def digest(msg: dict[str, Any]) -> str:
    """sha256 over the arrays of a message, in key order."""
    import numpy as np

    h = hashlib.sha256()
    for key in sorted(msg):
        value = msg[key]
        if isinstance(value, np.ndarray):
            h.update(key.encode())
            h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def without_times(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("time_") and "/time_" not in k} for r in rows]


def run_case(fed: Any, run_dir: Path) -> dict[str, Any]:
    from feddg.engines.inprocess import run_inprocess
    from feddg.federation.server import Server

    server = Server(fed, run_dir)
    run_inprocess(server)
    return {"metrics": without_times(server.metrics), "weights": digest(server.fed.method.eval_weights(server.state))}


def digits_federation(base: dict[str, Any], overrides: list[str], cache_dir: Path) -> Any:
    """The recorded digits case, sequential (``workers: 1``) with the process's single thread."""
    from feddg.config import build_config
    from feddg.federation.setup import build_federation

    fed = {**base.get("federation", {}), "workers": 1}
    return build_federation(build_config({**base, "data": {**base["data"], "cache_dir": str(cache_dir)},
                                          "federation": fed}, overrides))


def compute(cache_dir: Path, only: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{"toy": {name: case}, "digits": {name: case}}`` for the fixtures' cases (all, or those in ``only``)."""
    from toy import toy_federation

    toy = json.loads((FIXTURES / "golden_toy.json").read_text())
    digits = json.loads((FIXTURES / "golden_digits.json").read_text())
    out: dict[str, dict[str, Any]] = {"toy": {}, "digits": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in toy.items():
            if only is None or f"toy/{name}" in only:
                got = run_case(toy_federation(*case["overrides"]), Path(tmp) / f"toy-{name}")
                out["toy"][name] = {"overrides": case["overrides"], **got}
        for name, case in digits["cases"].items():
            if only is None or f"digits/{name}" in only:
                fed = digits_federation(digits["base"], case["overrides"], cache_dir)
                out["digits"][name] = {"overrides": case["overrides"], **run_case(fed, Path(tmp) / f"digits-{name}")}
    return out


def record(got: dict[str, dict[str, Any]]) -> None:
    digits = json.loads((FIXTURES / "golden_digits.json").read_text())
    (FIXTURES / "golden_toy.json").write_text(json.dumps(got["toy"], indent=1) + "\n")
    (FIXTURES / "golden_digits.json").write_text(json.dumps({"base": digits["base"], "cases": got["digits"]},
                                                            indent=1) + "\n")


def main() -> None:
    from feddg.reproducibility import exec_pinned

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=TESTS.parent / ".cache" / "test-data")
    parser.add_argument("--only", nargs="*", help="toy/NAME or digits/NAME")
    parser.add_argument("--record", action="store_true", help="rewrite tests/fixtures/golden_*.json")
    parser.add_argument("--kernels", choices=["portable", "native"], default="portable",
                        help="native: this CPU's own kernels (to show what portable changes)")
    args = parser.parse_args()
    if args.kernels == "portable":
        exec_pinned("portable")
    got = compute(args.cache, set(args.only) if args.only else None)
    if args.record:
        record(got)
    else:
        json.dump(got, sys.stdout)


if __name__ == "__main__":
    main()
