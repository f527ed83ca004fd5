"""docs/writing-a-backend.md: its example device, the way a vendor would ship it.

The guide's excerpts are the example's files (docs/examples/fxpass_openvino), in order and
complete; the fast tests check that, the device's size bar (at most 200 lines), and its
contract in this process. The slow test builds the example as a wheel, installs it into a
directory of its own and runs the guide's usage blocks as written, each in a fresh interpreter
that finds the plugin only through that directory: ``torch.compile`` against eager, export and
save, load in another process, the CLI, generation; then a process without the plugin refuses
the package.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "writing-a-backend.md"
EXAMPLE = ROOT / "docs" / "examples" / "fxpass_openvino"
DEVICE = EXAMPLE / "fxpass_openvino" / "__init__.py"
BACKEND = EXAMPLE / "fxpass_openvino" / "backend.py"
#: a fenced block, with the file name the test runs it as when a ``<!-- run: NAME -->`` precedes
BLOCK = re.compile(r"(?:<!-- run: (\S+) -->\n)?```(\w*)\n(.*?)```", re.S)


def _blocks() -> list[tuple[str | None, str, str]]:
    return [(m[1], m[2], m[3]) for m in BLOCK.finditer(DOC.read_text())]


def _runs() -> dict[str, str]:
    return {name: code for name, lang, code in _blocks() if name}


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_the_example_device_is_at_most_200_lines() -> None:
    n = len(DEVICE.read_text().splitlines())
    assert n <= 200
    assert f"({n} lines of device" in DOC.read_text()  # what the guide says it is
    assert len(BACKEND.read_text().splitlines()) <= 10  # the one-line Dynamo entry point


def test_the_guides_excerpts_are_the_example_files_in_order_and_complete() -> None:
    blocks = _blocks()
    excerpts = [code for name, lang, code in blocks if lang == "python" and not name]
    backend = BACKEND.read_text()
    assert backend in excerpts, "the guide shows backend.py whole"
    device = [c for c in excerpts if c != backend]
    src = DEVICE.read_text()
    for c in device:
        assert c in src, f"a guide excerpt is not in {DEVICE.name}:\n{c[:200]}"
    # shown in order and nothing left out (blank lines between excerpts aside)
    assert _lines("".join(device)) == _lines(src)
    (toml,) = [code for _, lang, code in blocks if lang == "toml"]
    assert toml == (EXAMPLE / "pyproject.toml").read_text()
    eps = tomllib.loads(toml)["project"]["entry-points"]
    assert eps["fxpass"] == {"openvino": "fxpass_openvino"}
    assert eps["torch_dynamo_backends"] == {
        "fxpass_openvino": "fxpass_openvino.backend:fxpass_openvino"}
    assert set(_runs()) == {"model.py", "jit.py", "export.py", "load.py", "generate.py"}


def test_the_example_keeps_the_device_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device as fxpass checks it at registration, and its own option checks (the plugin
    imported from the example's source, not registered)."""
    pytest.importorskip("openvino")
    from fxpass.device import check_device

    monkeypatch.syspath_prepend(str(EXAMPLE))
    mod = importlib.import_module("fxpass_openvino")
    try:
        dev = check_device(mod.DEVICE)
        assert [d.name for d in mod.fxpass_devices()] == ["openvino"]
        assert [t.name for t in mod.fxpass_targets()] == ["openvino"]
        opts = dev.check_options({"hint": "THROUGHPUT", "threads": 1})
        assert (opts.device_name, opts.hint, opts.precision) == ("CPU", "THROUGHPUT", "f32")
        with pytest.raises(TypeError, match="option 'hint' must be one of .*'FAST'"):
            dev.check_options({"hint": "FAST"})
        with pytest.raises(TypeError, match="option 'precision'.*must be a string"):
            dev.check_options({"precision": 32})
        assert dev.keyed(opts) == {"device_name": "CPU", "precision": "f32"}
        ident = dev.identity(opts)
        assert ident["device"] == "openvino" and ident["openvino"] and ident["source"]
        assert dev.can_open({"options": {"device_name": "CPU"}}) is None
        assert "not available here" in dev.can_open({"options": {"device_name": "NOSUCH"}})
    finally:
        for m in [m for m in sys.modules if m == "fxpass_openvino" or
                  m.startswith("fxpass_openvino.")]:
            del sys.modules[m]


def _python(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _check(r: subprocess.CompletedProcess, what: str) -> str:
    assert r.returncode == 0, f"{what} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The example built as a wheel and installed into a directory of its own; the guide's
    usage blocks written as files into a work directory; the environments with and without
    the plugin."""
    pytest.importorskip("openvino")
    tmp = tmp_path_factory.mktemp("guide")
    # build from a copy: setuptools leaves build/ and *.egg-info beside the sources
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                "__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp / "dist"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("fxpass_openvino-0.1.0-*.whl")
    site = tmp / "site"
    r = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp / "work"
    work.mkdir()
    for name, code in _runs().items():
        (work / name).write_text(code)
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "FXPASS_BLOCK_PLUGINS", "FXPASS_DISABLE_PLUGIN_AUTOLOAD")}
    base["FXPASS_CACHE_DIR"] = str(tmp / "cache")
    return {"work": work, "base": base, "env": {**base, "PYTHONPATH": str(site)}}


def _script(installed: dict, script: str, plugin: bool = True) -> subprocess.CompletedProcess:
    """``python script`` in a fresh interpreter in the work directory (``plugin``: with the
    installed example on its path)."""
    return subprocess.run([sys.executable, script], cwd=installed["work"],
                          env=installed["env" if plugin else "base"], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_the_guides_device_built_installed_and_run(installed: dict) -> None:
    work, env = installed["work"], installed["env"]
    out = _check(_script(installed, "jit.py"), "jit.py")  # a report: one openvino region
    assert "offloaded to openvino:CPU" in out and "1 region(s)" in out
    _check(_script(installed, "export.py"), "export.py")
    assert (work / "mlp-openvino" / "region_g0_r0.onnx").is_file()
    _check(_script(installed, "load.py"), "load.py")  # another process: load, run, vs eager

    # the guide's shell commands, as `fxpass` runs them
    (cli,) = [code for _, lang, code in _blocks() if lang == "bash" and "fxpass explain" in code]
    for line in cli.strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == "fxpass"
        code = f"import sys; from fxpass.cli import main; sys.exit(main({argv[1:]!r}))"
        out = _check(_python(code, work, env), line)
        if argv[1] == "explain":
            assert "on openvino" in out and "1 region(s)" in out
        if argv[1] == "run":
            assert "output 0: torch.float32[8, 16]" in out

    # a process without the plugin refuses the package, naming what to install
    r = _script(installed, "load.py", plugin=False)
    assert r.returncode != 0
    assert "made for fxpass device 'openvino', which is not installed here" in r.stderr
    assert "fxpass-openvino" in r.stderr

    # the device's own checks, through torch.compile
    bad = ("import torch\nfrom model import make\nm, (x,) = make()\n"
           "with torch.no_grad():\n"
           "    torch.compile(m, backend='fxpass_openvino', options=OPTS)(x)\n")
    r = _python(bad.replace("OPTS", "{'hint': 'FAST'}"), work, env)
    assert r.returncode != 0 and "fxpass_openvino option 'hint'" in r.stderr
    r = _python(bad.replace("OPTS", "{'device_name': 'NOSUCH'}"), work, env)
    assert r.returncode != 0 and "OpenVINO device 'NOSUCH' is not available here" in r.stderr


@pytest.mark.slow
def test_the_guides_generation_block(installed: dict) -> None:
    pytest.importorskip("transformers")
    _check(_script(installed, "generate.py"), "generate.py")
    assert (installed["work"] / "qwen3-openvino" / "manifest.json").is_file()
