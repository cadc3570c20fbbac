"""The architecture as a test (issue 11): every module's feddg imports — at the top, inside functions,
under TYPE_CHECKING — point down the layer order, and there is no import circle."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "feddg"

#: lower number = lower layer; a module may import its own layer or lower ones
LAYERS = {
    "messages": 0, "settings": 0, "seeds": 0, "reproducibility": 0, "numerics": 0, "devices": 0, "data": 0, "models": 0,
    "tasks": 1, "aggregation": 1, "evaluation": 1,
    "algorithms": 2,
    "config": 3, "catalog": 3,
    "federation": 4,
    "engines": 5,
    "tracking": 6, "experiment": 6,
    "sweep": 7, "bench": 7,
    "reports": 8, "audit": 8,
    "cli": 9, "__main__": 9,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    if top not in LAYERS:
        raise KeyError(f"{module}: no layer for feddg.{top}; add it to LAYERS")
    return LAYERS[top]


def feddg_imports(path: Path, package: str | None = None) -> set[str]:
    """Every ``feddg.*`` module imported anywhere in the file (function bodies included), relative imports resolved
    against ``package`` (default: the file's own package under ``SRC``) and ``from feddg.x import y`` counted as
    ``feddg.x.y`` where ``y`` is a module or a subpackage."""
    if package is None:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("feddg.")}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join([*parts, *([node.module] if node.module else [])])
            if base != "feddg" and not base.startswith("feddg."):
                continue
            folder = SRC.parent / base.replace(".", "/")
            submodules = {f"{base}.{a.name}" for a in node.names
                          if (folder / f"{a.name}.py").is_file() or (folder / a.name / "__init__.py").is_file()}
            out |= submodules if len(submodules) == len(node.names) else {base, *submodules}
    return out


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
GRAPH = {m: {i for i in feddg_imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "feddg"))
def test_nothing_imports_upward(module):
    upward = sorted(i for i in GRAPH[module] if i != "feddg" and layer(i) > layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports higher layers: {upward}"


def test_no_import_circle():
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(n):], n]))
            if n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("line", ["from feddg.experiment import run_experiment", "from ..experiment import run_experiment",
                                  "from feddg import reports", "from .. import reports", "import feddg.experiment"])
def test_the_layer_test_catches_an_upward_import(tmp_path, line):
    """Absolute, relative and ``from feddg import <subpackage>`` imports, inside a function, of a higher layer."""
    bad = tmp_path / "bad.py"
    bad.write_text(f"def f():\n    {line}\n")
    found = [i for i in feddg_imports(bad, package="feddg.aggregation") if i != "feddg"]
    assert found and all(layer(i) > layer("feddg.aggregation.mean") for i in found)


def test_the_server_knows_no_topology_details():
    text = (SRC / "federation" / "server.py").read_text()
    assert "hierarchy" not in text and "station" not in text
