"""The decoded-image cache of folder datasets: keyed by files, mtimes, sizes and resolution; atomic; parallel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feddg.data import cache, image_cache, iterate_batches, load_dataset
from feddg.data.folders import FolderDomainDataset


def _tree(root: Path, per_class: int = 3, size: int = 12) -> Path:
    """root/<a|b>/<x|y>/<i>.png with random pixels."""
    rng = np.random.default_rng(0)
    for dom in ("a", "b"):
        for cls in ("x", "y"):
            (root / dom / cls).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / dom / cls / f"{i}.png")
    return root


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The cache paths built during the test, in order."""
    built: list[Path] = []
    real = image_cache.build

    def counting(path: Path, *args: object, **kwargs: object) -> None:
        built.append(path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(image_cache, "build", counting)
    return built


def _load(root: Path, cache: Path, size: int = 12) -> FolderDomainDataset:
    ds = load_dataset("folder", root=str(root), cache_dir=cache, image_size=size)
    assert isinstance(ds, FolderDomainDataset)
    return ds


def _pixels(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB")).transpose(2, 0, 1).copy())


def test_cache_is_built_once_and_memory_mapped(tmp_path: Path, builds: list[Path]) -> None:
    root, cache = _tree(tmp_path / "data"), tmp_path / "cache"
    ds = _load(root, cache)
    again = _load(root, cache)
    assert len(builds) == 1 and builds[0].is_file() and builds[0].parent == cache / "folders"
    assert isinstance(np.load(builds[0], mmap_mode="r"), np.memmap)
    for i in (0, 5, len(ds) - 1):
        assert torch.equal(again.images[i], _pixels(ds.files[i])), "cached pixels are the decoded file's"
    _load(root, cache, size=8)
    assert len(builds) == 2, "another resolution is another cache"


@pytest.mark.parametrize("change", ["replace", "touch", "add"])
def test_cache_is_rebuilt_when_a_file_changes(tmp_path: Path, builds: list[Path], change: str) -> None:
    root, cache = _tree(tmp_path / "data"), tmp_path / "cache"
    ds = _load(root, cache)
    target = root / "b" / "y" / "1.png"
    if change == "replace":
        Image.new("RGB", (12, 12), (7, 8, 9)).save(target)
    elif change == "touch":
        st = target.stat()
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    else:
        Image.new("RGB", (12, 12), (1, 1, 1)).save(root / "a" / "x" / "9.png")
    new = _load(root, cache)
    assert len(builds) == 2 and builds[1] != builds[0]
    i = new.files.index(target)
    expected = torch.tensor([7, 8, 9], dtype=torch.uint8).view(3, 1, 1).expand(3, 12, 12)
    assert torch.equal(new.images[i], expected if change == "replace" else ds.images[ds.files.index(target)])
    cached = sorted(p.name for p in (cache / "folders").iterdir())
    assert cached == sorted({builds[1].name} | ({builds[0].name} if change == "add" else set())), (
        "a changed file's stale cache is deleted; another file list keeps its own")


def test_parallel_build_equals_serial_and_resizes(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data", per_class=40, size=20)
    files = sorted(root.rglob("*.png"))
    serial, parallel = tmp_path / "s.npy", tmp_path / "p.npy"
    image_cache.build(serial, files, 9, workers=0)
    image_cache.build(parallel, files, 9, workers=2)
    a, b = np.load(serial), np.load(parallel)
    assert a.shape == (160, 9, 9, 3) and np.array_equal(a, b), "cached channels last"
    want = np.asarray(Image.open(files[7]).convert("RGB").resize((9, 9), Image.Resampling.BILINEAR))
    assert np.abs(a[7].astype(int) - want).max() <= 1, "antialiased bilinear, as PIL's"


def test_interrupted_build_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _tree(tmp_path / "data", per_class=40)
    files = sorted(root.rglob("*.png"))
    calls = 0
    real = image_cache._decode_chunk

    def dying(paths: list[str], size: int) -> tuple[np.ndarray, list[tuple[int, str]]]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return real(paths, size)

    monkeypatch.setattr(image_cache, "_decode_chunk", dying)
    with pytest.raises(KeyboardInterrupt):
        image_cache.build(tmp_path / "cache" / "c.npy", files, 12, workers=0)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_killed_builds_temporary_is_removed_by_the_next_build(tmp_path: Path) -> None:
    """SIGKILL skips every ``finally``: the next build of the same cache removes what the dead process left, and
    keeps a live builder's temporary and another host's."""
    root = _tree(tmp_path / "data")
    files = sorted(root.rglob("*.png"))
    path = tmp_path / "cache" / "c.npy"
    hold = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a live process on this host
    try:
        killed = subprocess.Popen([sys.executable, "-c", (
            "import os, signal, sys; from pathlib import Path; from feddg.data.cache import temporary_beside\n"
            "fd, tmp = temporary_beside(Path(sys.argv[1])); os.write(fd, bytes(1000)); print(tmp, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)"), str(path)], stdout=subprocess.PIPE, text=True)
        left = Path(killed.communicate()[0].strip())
        assert killed.returncode == -signal.SIGKILL and left.is_file()
        host = left.name.split(".")[1]
        live = path.parent / f"c.{host}.{hold.pid}.abc.tmp"
        other_host = path.parent / f"c.elsewhere.{killed.pid}.abc.tmp"
        for kept in (live, other_host):
            kept.write_bytes(b"x")
        image_cache.build(path, files, 8, workers=0)
        assert not left.exists(), "the killed build's temporary is still there"
        assert sorted(p.name for p in path.parent.iterdir()) == sorted(["c.npy", live.name, other_host.name])
        cache.save_arrays(path.with_suffix(".npz"), {"a": np.zeros(2)})  # the same clean-up for the .npz caches
        assert live.exists() and other_host.exists()
    finally:
        hold.kill()
        hold.wait()


def test_loader_workers_give_the_same_batches(tmp_path: Path) -> None:
    root = _tree(tmp_path / "data", per_class=6)
    ds = load_dataset("folder", root=str(root), cache_dir=tmp_path / "cache", image_size=12)
    idx = np.arange(len(ds))

    def epoch(workers: int, seed: int) -> list[torch.Tensor]:
        ds.loader_workers = workers
        g = torch.Generator().manual_seed(seed)
        return [x for x, _ in iterate_batches(ds, idx, 5, shuffle=True, train=True, generator=g)]

    a, b, c = epoch(0, 0), epoch(2, 0), epoch(0, 1)
    assert len(a) == 5 and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_an_interrupted_save_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the arrays are written (a KeyboardInterrupt, no Exception) removes the temporary and goes on."""
    from feddg.data import cache

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cache.np, "savez_compressed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.save_arrays(tmp_path / "a.npz", {"x": np.zeros(2)})
    assert list(tmp_path.iterdir()) == []
