"""feddg.numerics: the correctly rounded square root and the fused Adam, and no other square root in ``src``.

(That they give the same bits on other CPUs is what the golden cases check: tests/test_golden.py and, under
emulated CPUs, benchmarks/golden_cpus.sh.)"""

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from feddg.numerics import adam, sqrt

SRC = Path(__file__).resolve().parent.parent / "src" / "feddg"


def test_sqrt_is_the_correctly_rounded_root_in_float32_and_float64():
    g = torch.Generator().manual_seed(0)
    x32 = torch.rand(100_000, generator=g) * 10.0 ** torch.randint(-8, 8, (100_000,), generator=g)
    # float32: the float64 root rounded to float32 is the correctly rounded one (53 ≥ 2·24 + 2 bits)
    exact32 = np.sqrt(x32.numpy().astype(np.float64)).astype(np.float32)
    assert np.array_equal(sqrt(x32).numpy(), exact32)
    x64 = x32[:2000].double() * (1 + 1e-9)
    assert [float(v) for v in sqrt(x64)] == [math.sqrt(float(v)) for v in x64]  # C's sqrt: IEEE 754, exact


def test_sqrt_of_zero_dim_non_contiguous_and_bfloat16_tensors():
    assert sqrt(torch.tensor(2.25, dtype=torch.float64)).item() == 1.5
    m = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(sqrt(m), torch.from_numpy(np.sqrt(m.numpy())))
    b = torch.tensor([2.0, 3.0, 1e-3], dtype=torch.bfloat16)
    assert sqrt(b).dtype == torch.bfloat16
    assert torch.equal(sqrt(b), torch.from_numpy(np.sqrt(b.float().numpy())).to(torch.bfloat16))


def test_sqrt_off_the_cpu_is_torchs() -> None:
    x = torch.empty(3, 2, device="meta")  # no data: numpy cannot take it, torch.sqrt can
    y = sqrt(x)
    assert y.device.type == "meta" and y.shape == (3, 2)


def test_sqrt_gradient_is_torchs_formula():
    x = torch.tensor([0.25, 4.0, 9.0], dtype=torch.float64, requires_grad=True)
    (sqrt(x) * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    assert x.grad.tolist() == [1.0, 0.5, 0.5]  # d√x/dx = 1/(2√x), times the weights
    assert torch.autograd.gradcheck(sqrt, (torch.rand(5, dtype=torch.float64, requires_grad=True) + 0.1,))


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_is_fused_on_cpu_and_takes_one_closed_form_step(decoupled):
    p0 = torch.tensor([1.0, -2.0, 0.5])
    p = torch.nn.Parameter(p0.clone())
    opt = adam([p], decoupled=decoupled, lr=0.1, weight_decay=0.01)
    assert opt.param_groups[0]["fused"] is True
    assert isinstance(opt, torch.optim.AdamW if decoupled else torch.optim.Adam)
    g = torch.tensor([0.3, -0.1, 2.0])
    p.grad = g.clone()
    opt.step()
    # first step: the bias-corrected moments are g and g², so the update is lr · g / (|g| + eps)
    eps = 1e-8
    if decoupled:  # AdamW: the weights decay by lr · wd first
        expected = p0 * (1 - 0.1 * 0.01) - 0.1 * g / (g.abs() + eps)
    else:  # Adam: wd · p joins the gradient
        gw = g + 0.01 * p0
        expected = p0 - 0.1 * gw / (gw.abs() + eps)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)


def test_adam_is_not_fused_when_any_parameter_is_on_a_device_without_a_fused_step() -> None:
    cpu, meta = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, device="meta"))
    assert adam([cpu, meta], lr=0.1).param_groups[0]["fused"] is None
    assert adam([{"params": [cpu]}, {"params": [meta]}], lr=0.1).param_groups[0]["fused"] is None  # across groups


#: methods and functions whose result depends on the CPU's vendor in PyTorch's x86 build (MKL's vector math)
_VML = {"sqrt", "sqrt_", "acos", "acos_", "asin", "asin_", "atan", "atan_", "arccos", "arcsin", "arctan", "cdist"}
_EXACT_MODULES = {"math", "cmath", "np", "numpy"}  # their sqrt is the IEEE one


def non_portable_calls(source: str) -> list[int]:
    """Lines of ``source`` that take a square root (or acos/asin/atan/cdist) with torch, ``x ** 0.5`` or
    ``x.pow(0.5)``, build ``torch.optim.Adam``/``AdamW`` directly, or import one of those names from torch."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(a.name in _VML or a.name in ("Adam", "AdamW") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Attribute):
            exact = isinstance(node.value, ast.Name) and node.value.id in _EXACT_MODULES
            adam_cls = node.attr in ("Adam", "AdamW") and isinstance(node.value, ast.Attribute) and node.value.attr == "optim"
            if (node.attr in _VML and not exact) or adam_cls:
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pow", "pow_"):
            if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0.5:
                lines.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            if isinstance(node.right, ast.Constant) and node.right.value == 0.5:
                lines.append(node.lineno)
    return sorted(lines)


def test_src_takes_square_roots_and_adam_only_from_numerics():
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name != "numerics.py":
            text = path.read_text()
            hits += [f"{path.relative_to(SRC)}:{n}: {text.splitlines()[n - 1].strip()}" for n in non_portable_calls(text)]
    assert not hits, "use feddg.numerics.sqrt / adam:\n" + "\n".join(hits)


def test_the_source_scan_finds_what_it_forbids():
    for line in ["y = x.sqrt()", "y = torch.sqrt(x)", "y = x ** 0.5", "o = torch.optim.Adam(ps)", "o = torch.optim.AdamW(ps)",
                 "d = torch.cdist(a, b)", "y = x.pow(.5)", "x.sqrt_()", "y = x.atan()",
                 "from torch import sqrt", "from torch.optim import Adam", "from torch.linalg import cdist as d"]:
        assert non_portable_calls(line) == [1], line
    for line in ["y = math.sqrt(2)", "y = np.sqrt(a)", "y = sqrt(x)", "s = (a ** -2 - b) ** -0.5", "o = adam(ps)",
                 '"""mentions torch.sqrt in prose"""', "y = x.pow(2)", "from numpy import sqrt", "from torch import nn"]:
        assert non_portable_calls(line) == [], line
