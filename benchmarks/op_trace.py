"""Where two CPUs part: trace every PyTorch op of a golden case, then find the first op that got the same inputs
and gave other outputs (docs/reliability.md, "Two kernels no setting pins").

    python benchmarks/op_trace.py trace toy/hfedf > native.txt
    qemu-x86_64 -cpu Skylake-Server .venv/bin/python benchmarks/op_trace.py trace toy/hfedf > emulated.txt
    python benchmarks/op_trace.py first-difference native.txt emulated.txt

``trace`` runs the case as tests/support/golden.py does (portable kernels; under qemu, ``eval "$(feddg env
portable)"`` first, as benchmarks/golden_cpus.sh does) inside a ``TorchDispatchMode`` that writes one line per op:
its name, the sha1 of the float inputs it reads and of its float outputs. Ops that only allocate are left out (their
memory is garbage). numpy's operations are not traced: an op whose inputs differ from the other run's with no
traced op before it that differs points at numpy (or at data read from outside torch).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
ALLOCATING = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided")


def digest(values: Any) -> str:
    """sha1 (12 hex digits) over the bytes of the CPU float tensors among ``values`` (nested lists and dicts)."""
    import torch
    from torch.utils._pytree import tree_flatten

    h = hashlib.sha1()
    for t in tree_flatten(values)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu":
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def op_tracer(out: TextIO) -> Any:
    """A dispatch mode writing ``op inputs-digest outputs-digest`` for every op it sees, to ``out``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tracer(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            # the arguments an op reads: not those it overwrites (``out=``, ``self`` of ``normal_``, ``copy_``)
            written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
            positional = [v for a, v in zip(func._schema.arguments, args, strict=False) if a.name not in written]
            inputs = digest([positional, {k: v for k, v in (kwargs or {}).items() if k not in written}])
            result = func(*args, **(kwargs or {}))
            if not str(func).startswith(ALLOCATING):
                out.write(f"{func} {inputs} {digest(result)}\n")
            return result

    return Tracer()


def trace_case(case: str, out: TextIO) -> None:
    """Run the golden case ``toy/NAME`` or ``digits/NAME`` with every op traced to ``out``."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "support")]
    from golden import digits_federation, run_case
    from toy import toy_federation

    kind, name = case.split("/", 1)
    fixture = json.loads((ROOT / "tests" / "fixtures" / f"golden_{kind}.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "toy":
            fed = toy_federation(*fixture[name]["overrides"])
        else:
            fed = digits_federation(fixture["base"], fixture["cases"][name]["overrides"],
                                    ROOT / ".cache" / "test-data")
        with op_tracer(out):
            run_case(fed, Path(tmp) / "run")


def _lines(path: Path) -> Iterator[tuple[int, str, str, str]]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        op, inputs, outputs = line.rsplit(" ", 2)
        yield n, op, inputs, outputs


def first_difference(a: Path, b: Path) -> str:
    """The first op at which two traces part, said in one line."""
    for (n, op_a, in_a, out_a), (_, op_b, in_b, out_b) in zip(_lines(a), _lines(b), strict=False):
        if op_a != op_b:
            return f"line {n}: the runs took other ops ({op_a} / {op_b})"
        if in_a != in_b:
            return f"line {n}: {op_a} got other inputs with every traced op before it equal (numpy or data?)"
        if out_a != out_b:
            return f"line {n}: {op_a} gave other outputs from the same inputs: this kernel depends on the CPU"
    return "no difference in the ops both traces hold"


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "trace":
        from feddg.reproducibility import exec_pinned

        exec_pinned("portable")
        trace_case(sys.argv[2], sys.stdout)
    elif len(sys.argv) == 4 and sys.argv[1] == "first-difference":
        print(first_difference(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
