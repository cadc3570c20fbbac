"""benchmarks/op_trace.py: a trace holds every op with the digests of its inputs and outputs, and the comparison
names the first op where two runs part, and how."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from op_trace import digest, first_difference, op_tracer, trace_case  # noqa: E402  (a script of benchmarks/)


def _trace(fn) -> list[str]:
    out = io.StringIO()
    with op_tracer(out):
        fn()
    return out.getvalue().splitlines()


def _compute() -> None:
    x = torch.arange(1.0, 5.0)
    (x.sqrt() * 2).sum()


def test_each_op_is_written_with_the_digests_of_its_inputs_and_outputs():
    lines = _trace(_compute)
    ops = [line.split(" ")[0] for line in lines]
    assert "aten.sqrt.default" in ops and "aten.mul.Tensor" in ops and "aten.sum.default" in ops
    x = torch.arange(1.0, 5.0)
    sqrt_line = lines[ops.index("aten.sqrt.default")]
    assert sqrt_line.endswith(f" {digest([[x], {}])} {digest(torch.sqrt(x))}")


def test_the_first_difference_is_named_with_its_kind(tmp_path):
    lines = _trace(_compute)
    a = tmp_path / "a.txt"
    a.write_text("\n".join(lines) + "\n")
    assert first_difference(a, a) == "no difference in the ops both traces hold"
    i = next(n for n, line in enumerate(lines) if line.startswith("aten.sqrt"))
    op, inputs, _ = lines[i].rsplit(" ", 2)
    other = tmp_path / "b.txt"
    other.write_text("\n".join([*lines[:i], f"{op} {inputs} 000000000000", *lines[i + 1:]]) + "\n")
    assert first_difference(a, other) == (f"line {i + 1}: aten.sqrt.default gave other outputs from the same "
                                          "inputs: this kernel depends on the CPU")
    other.write_text("\n".join([*lines[:i], f"{op} 000000000000 000000000000", *lines[i + 1:]]) + "\n")
    assert "got other inputs with every traced op before it equal" in first_difference(a, other)


def test_a_golden_case_traces_end_to_end():
    out = io.StringIO()
    trace_case("toy/local", out)
    ops = {line.split(" ")[0] for line in out.getvalue().splitlines()}
    assert {"aten.convolution.default", "aten.convolution_backward.default", "aten.addmm.default"} <= ops
    assert not any(op.startswith("aten.empty") for op in ops)


def test_what_an_op_overwrites_is_not_among_its_inputs():
    def fill(start: float):
        def run() -> None:
            torch.full((4,), start).normal_(generator=torch.Generator().manual_seed(0))
        return run

    [normal_a] = [line for line in _trace(fill(1.0)) if line.startswith("aten.normal_")]
    [normal_b] = [line for line in _trace(fill(2.0)) if line.startswith("aten.normal_")]
    assert normal_a == normal_b  # the garbage or values it overwrites are not what it reads
