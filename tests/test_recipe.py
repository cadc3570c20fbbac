"""Issue 27: the secure Flower recipe (TLS, SuperNode authentication, a roster) is the README's default, is the
same text in docs/flower.md, and runs as written: the block is extracted from the README and run by bash in a
directory laid out like the repository root (``.venv``, ``configs``, ``flower`` linked), with ``PORT`` and
``NODE_PORT`` set to free ports and the test dataset cache."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from feddg.federation.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- recipe: secure -->\n```bash\n"


def recipe(path: Path) -> str:
    """The bash block after the recipe marker of ``path``."""
    text = path.read_text()
    start = text.index(MARKER) + len(MARKER)
    return text[start : text.index("```\n", start)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_and_docs_recipes_are_the_same_secure_recipe():
    readme = recipe(ROOT / "README.md")
    assert readme == recipe(ROOT / "docs" / "flower.md")
    assert "--insecure" not in readme and "insecure = true" not in readme
    for secure in ("--ssl-certfile", "--enable-supernode-auth", "flwr supernode register", "--auth-supernode-private-key",
                   "--root-certificates", "flower.roster=", "feddg flower run"):
        assert secure in readme, secure


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash and the deployment's binaries")
def test_the_secure_recipe_runs_as_written(tmp_path, cache_dir):
    bin_dir = ROOT / ".venv" / "bin"
    if not all((bin_dir / b).exists() for b in ("flower-superlink", "flower-supernode", "flwr", "feddg", "activate")):
        pytest.skip("the recipe needs the repository's .venv with the [flower] extra")
    for name in (".venv", "configs", "flower"):
        (tmp_path / name).symlink_to(ROOT / name)
    node_port = free_port()
    env = {**os.environ, "PORT": str(free_port()), "NODE_PORT": str(node_port), "FEDDG_CACHE": str(cache_dir),
           "OMP_NUM_THREADS": "1"}
    with socket.socket() as a, socket.socket() as b:  # node ports NODE_PORT + 1, + 2 must be free too
        a.bind(("127.0.0.1", node_port + 1)), b.bind(("127.0.0.1", node_port + 2))
    proc = subprocess.Popen(["bash", "-c", recipe(ROOT / "README.md")], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=420)
    finally:  # the recipe's own processes share its session: none may outlive the test
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
    run = tmp_path / "runs" / "secure" / "run"
    assert "error:" not in output, output[-3000:]
    assert json.loads((run / "status.json").read_text())["status"] == "completed", output[-3000:]
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rows] == [3, 3] and (run / "results.json").is_file() and (run / "report.html").is_file()
    assert "identified by the roster" in output, output[-3000:]  # the ServerApp's log, streamed by flwr run
    [session] = json.loads((run / "provenance.json").read_text())["flower_nodes"]  # who trained the model
    assert {c: (n["by"], n["name"], n["state_dir"]) for c, n in session["clients"].items()} == {
        str(p): ("roster key", f"Hospital {'ABC'[p]}", True) for p in range(3)} and session["refused"] == []
    key = load_checkpoint(run)["run_key"]  # each hospital keeps its client's state of rounds 1 and 2 on its disk
    for p in range(3):
        held = tmp_path / "runs" / "secure" / "state" / f"hospital{p}" / key / f"client-{p}"
        assert sorted(f.name for f in held.iterdir()) == ["round-1.pb", "round-2.pb"], output[-3000:]
