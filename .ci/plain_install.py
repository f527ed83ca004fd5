"""The plain-install check of ``.ci/run``: what ``pip install fxpass`` (no extras) promises.

Why: CI's own environment installs ``.[test]``, so a core module that imports Hypothesis,
pytest or transformers at import time passes every test there and crashes a user's plain
install (issue 45). ``.ci/run`` builds a wheel from a copy of the checkout, installs it with no
extras in a fresh venv (no system site-packages) and runs this file with that venv's Python,
isolated (``-I``) and from a directory outside the checkout, so that nothing of the checkout
can be imported in place of the installed package. It checks, in about 20 s:

- the install is the plain one: no extras importable, fxpass imported from the venv's
  site-packages, installed as a wheel (not editable), every plugin loaded;
- ``torch.compile(model, backend="fxpass_bpu")`` of a small model gets a region and equals
  eager;
- ``export`` -> ``save`` -> ``load`` in a fresh process -> the same outputs;
- the shell: ``fxpass rules`` (no ``FAILED`` plugin), ``fxpass export`` and ``fxpass run`` of
  a ``file.py:factory``, and ``fxpass demo`` refusing in one line that names the extra.

Usage: ``python -I plain_install.py`` (exit status 0 when every check holds).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the test and demo extras; a plain install has none of them
EXTRAS = ("transformers", "hypothesis", "pytest")
#: float32 against eager: onnxruntime's kernels reassociate sums (the test suite's tolerance)
TOL = {"rtol": 1e-4, "atol": 1e-4}

FACTORY = '''
import torch


def make():
    """A small MLP: (model, args), the file.py:factory contract."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 16)).eval()
    return model, (torch.randn(4, 64),)
'''

#: a fresh process: load the package and run it, print the outputs as JSON (nothing of the
#: exporting process, its region table or its compiled sessions, is there)
LOAD_CHILD = """
import json, sys, torch
from fxpass.backends.bpu import load
x = torch.load(sys.argv[2])
with torch.no_grad():
    print(json.dumps(load(sys.argv[1])(x).tolist()))
"""


def check(ok: bool, what: str, detail: str = "") -> None:
    """Fail the run with ``what`` and ``detail`` (a child's output) unless ``ok`` (plain
    asserts vanish under ``python -O``)."""
    if not ok:
        raise SystemExit(f"plain install: FAILED: {what}\n{detail}")
    print(f"plain install: ok: {what}", flush=True)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``argv`` in ``cwd`` with this venv's tools, isolated from the checkout."""
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


def check_install() -> None:
    """The venv is the plain install of a wheel, and fxpass comes from its site-packages."""
    missing = [m for m in EXTRAS if importlib.util.find_spec(m) is None]
    check(missing == list(EXTRAS), f"no extras installed ({', '.join(EXTRAS)})")
    import fxpass
    import fxpass.backends.bpu
    import fxpass.rules
    from fxpass.plugins import load

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for mod in (fxpass, fxpass.rules, fxpass.backends.bpu):
        path = Path(mod.__file__).resolve()
        check(path.is_relative_to(site), f"{mod.__name__} imported from {path}")
    direct = importlib.metadata.distribution("fxpass").read_text("direct_url.json") or "{}"
    editable = json.loads(direct).get("dir_info", {}).get("editable", False)
    check(not editable, "fxpass installed as a wheel, not editable")
    failures = load().failures
    check(not failures, f"every plugin loads (failures: {failures})")


def check_compile(x: torch.Tensor, model: torch.nn.Module, cache: Path) -> None:
    """``torch.compile(backend="fxpass_bpu")`` (an entry point, no fxpass import needed)."""
    import torch

    import fxpass

    compiled = torch.compile(model, backend="fxpass_bpu",
                             options={"min_compute_macs": 0, "cache_dir": str(cache)})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    regions = [len(r.regions) for r in fxpass.compile_reports()]
    check(regions == [1], f"torch.compile: one graph, one region, equal to eager ({regions})")


def check_export(x: torch.Tensor, model: torch.nn.Module, tmp: Path) -> None:
    """``export`` -> ``save`` -> ``load`` and run in a fresh process."""
    import torch

    from fxpass.backends.bpu import export

    program = export(model, (x,), options={"min_compute_macs": 0})
    check(len(program.regions) == 1, "export: one region")
    path = program.save(str(tmp / "pkg"))
    torch.save(x, tmp / "x.pt")
    res = run([sys.executable, "-I", "-c", LOAD_CHILD, path, str(tmp / "x.pt")], tmp)
    check(res.returncode == 0, "load and run in a fresh process", res.stderr[-3000:])
    got = torch.tensor(json.loads(res.stdout.strip().splitlines()[-1]))
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), **TOL)
    check(True, "the loaded package equals eager")


def check_shell(tmp: Path) -> None:
    """The console script: ``rules``, ``export`` / ``run`` of a factory file, ``demo``."""
    fxpass = str(Path(sys.executable).with_name("fxpass"))
    res = run([fxpass, "rules"], tmp)
    out = res.stdout + res.stderr
    check(res.returncode == 0 and "FAILED" not in out and "PluginLoadWarning" not in out
          and "target bpu" in out, "fxpass rules, no FAILED plugin", res.stderr[-3000:])
    (tmp / "factory.py").write_text(textwrap.dedent(FACTORY))
    res = run([fxpass, "export", "factory.py:make", "cli-pkg", "--min-compute-macs", "0"], tmp)
    check(res.returncode == 0 and "1 region(s)" in res.stdout,
          "fxpass export factory.py:make", res.stdout[-2000:] + res.stderr[-3000:])
    res = run([fxpass, "run", "cli-pkg", "--repeat", "2"], tmp)
    check(res.returncode == 0 and "output 0: torch.float32[4, 16]" in res.stdout,
          "fxpass run", res.stdout[-2000:] + res.stderr[-3000:])
    res = run([fxpass, "demo"], tmp)
    err = res.stderr.strip()
    check(res.returncode == 2 and "\n" not in err and 'pip install "fxpass[demo]"' in err,
          f"fxpass demo without transformers: one line naming the extra: {err[-3000:]}")


def main() -> int:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fxpass-plain-") as d:
        tmp = Path(d)
        os.environ["FXPASS_CACHE_DIR"] = str(tmp / "cache")  # the children's too
        check_install()
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 16)).eval()
        x = torch.randn(4, 64)
        check_compile(x, model, tmp / "cache")
        check_export(x, model, tmp)
        check_shell(tmp)
    print(f"plain install: every check passed in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
