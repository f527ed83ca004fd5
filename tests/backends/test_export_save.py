"""Saving over a package is atomic: the new package is written whole under a temporary name,
the old one renamed aside, the new one renamed in, then the old one removed. A fault at any
step leaves a complete package (old or new) that loads; what a killed save leaves beside it is
put back or removed by the next save, and named when ``load`` finds the package missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxpass.aot import write
from fxpass.aot.package import PackageError
from fxpass.backends.bpu import export, load

ROOT = Path(__file__).resolve().parents[2]


class Fault(OSError):
    """The injected failure (an OSError: what a rename or a removal raises)."""


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).eval()


X = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def programs():
    """Two programs of one signature and different weights: the old and the new package."""
    made = []
    for seed in (1, 2):
        model = _mlp(seed)
        with torch.no_grad():
            ref = model(X)
        made.append((export(model, (X,), options={"min_compute_macs": 0}), ref))
    return made


def _which(path: Path, programs) -> str:
    """'old' or 'new': which of the two programs the package at ``path`` is (it must load)."""
    out = load(path)(X)
    for name, (_, ref) in zip(("old", "new"), programs, strict=True):
        if torch.allclose(out, ref, atol=1e-5):
            return name
    raise AssertionError("the package is neither the old nor the new program")


def _beside(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def _failing(real, fail_at: int):
    """``real`` that raises Fault on its ``fail_at``-th call (1-based), then works again."""
    calls = [0]

    def fn(*a, **k):
        calls[0] += 1
        if calls[0] == fail_at:
            raise Fault(f"injected at call {fail_at}")
        return real(*a, **k)

    return fn


@pytest.mark.parametrize("step", ["aside", "in"])
def test_a_rename_that_fails_leaves_the_old_package(programs, tmp_path, monkeypatch, step):
    path = tmp_path / "pkg"
    programs[0][0].save(path)
    monkeypatch.setattr(os, "replace", _failing(os.replace, {"aside": 1, "in": 2}[step]))
    with pytest.raises(Fault):
        programs[1][0].save(path)
    monkeypatch.undo()
    assert _which(path, programs) == "old"
    assert _beside(path) == []  # the temporary copy removed, the old one put back
    programs[1][0].save(path)
    assert _which(path, programs) == "new"


def test_removing_the_old_package_fails_after_the_new_is_in(programs, tmp_path, monkeypatch):
    path = tmp_path / "pkg"
    programs[0][0].save(path)
    monkeypatch.setattr(shutil, "rmtree", _failing(shutil.rmtree, 1))
    with pytest.warns(RuntimeWarning, match=r"pkg is saved, but .*\.pkg\.old-.* could not be "
                                            "removed"):
        programs[1][0].save(path)
    monkeypatch.undo()
    assert _which(path, programs) == "new"
    assert [n.split("-")[0] for n in _beside(path)] == [".pkg.old"]
    programs[0][0].save(path)  # the next save removes what the last one left
    assert _which(path, programs) == "old" and _beside(path) == []


def test_a_fault_while_writing_leaves_the_old_package(programs, tmp_path, monkeypatch):
    path = tmp_path / "pkg"
    programs[0][0].save(path)
    monkeypatch.setattr(write, "_write_program", _failing(write._write_program, 1))
    with pytest.raises(Fault):
        programs[1][0].save(path)
    monkeypatch.undo()
    assert _which(path, programs) == "old" and _beside(path) == []


def test_a_first_save_that_fails_leaves_nothing(programs, tmp_path, monkeypatch):
    path = tmp_path / "pkg"
    monkeypatch.setattr(os, "replace", _failing(os.replace, 1))
    with pytest.raises(Fault):
        programs[0][0].save(path)
    monkeypatch.undo()
    assert not path.exists() and _beside(path) == []


_KILLED = """
import os, sys
from pathlib import Path
from fxpass.aot import write
tmp, dest, step = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
real_replace, real_rmtree = os.replace, write.shutil.rmtree
calls = []
def replace(a, b):
    calls.append(1)
    if (step, len(calls)) in (("aside", 1), ("in", 2)):
        os._exit(9)  # killed: no handler, no finally
    real_replace(a, b)
def rmtree(p, *a, **k):
    if step == "remove":
        os._exit(9)
    real_rmtree(p, *a, **k)
os.replace, write.shutil.rmtree = replace, rmtree
write._install(tmp, dest)
write._tidy(dest)
"""


@pytest.mark.slow
@pytest.mark.parametrize("step", ["aside", "in", "remove"])
def test_a_save_killed_at_each_step_leaves_a_complete_package(programs, tmp_path, step):
    """A process killed between the renames runs no handler: the old package is then set
    aside, complete; ``load`` names it, and the next save puts it back before it writes."""
    path = tmp_path / "pkg"
    programs[0][0].save(path)
    new = Path(programs[1][0].save(tmp_path / "staged"))
    tmp = new.rename(tmp_path / ".pkg.tmp-999999999-abcd")  # no such pid: stale once killed
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED), str(tmp), str(path),
                        step], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr[-2000:]
    if step == "aside":
        assert _which(path, programs) == "old"
    elif step == "in":
        assert not path.exists()
        with pytest.raises(PackageError, match=r"pkg does not exist; a save into it was "
                                               r"interrupted and set the previous package "
                                               r"aside at .*\.pkg\.old-"):
            load(path)
        old = next(p for p in tmp_path.iterdir() if p.name.startswith(".pkg.old-"))
        assert _which(old, programs) == "old"
    else:
        assert _which(path, programs) == "new"
    # the next save: what was set aside is put back first, leftovers removed after
    programs[1][0].save(path)
    assert _which(path, programs) == "new" and _beside(path) == []
