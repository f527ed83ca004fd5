"""Writing a package: every file into a temporary directory beside the destination, then
swapped into place by renames (``package.save`` is the entry point).

``weights.bin`` holds each distinct content once (``_WeightsFile``). The swap: the new package
is complete under a temporary name, the old one is renamed aside, the new one renamed in, and
only then is the old one removed. A process killed at any point leaves the old package or the
new one complete on disk; the next save puts a set-aside package back where the destination is
missing, and removes what killed saves left (``_leftovers``: directories named for a process
that no longer runs). Nothing here runs at load time except ``_interrupted``, the hint for a
missing package.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from fxpass.aot.package import (
    FORMAT,
    MANIFEST,
    PAGE,
    PAGED_FROM,
    WEIGHTS,
    PackageError,
    _file_digest,
    _versions,
    sign,
)
from fxpass.jit.digest import HASH_NAME, hasher

if TYPE_CHECKING:
    from fxpass.jit.options import Options


def _spec(t: Any) -> dict[str, Any]:
    if isinstance(t, torch.Tensor):
        return {"shape": list(t.shape), "dtype": str(t.dtype)}
    return {"value": repr(t)}


class _WeightsFile:
    """weights.bin being written: each distinct content once; ``name`` is its path in the
    package (what a device's artifacts that read weights from it name).

    Contents are keyed by their bytes alone (length and digest), not by who reads them or as
    what: a weight that the CPU program reads as a torch tensor and a region reads as an ONNX
    initializer is one range of the file. Keyed by reader as well, a prefill program whose
    region holds the weights beside a decode program too small for a region (its weights on
    the CPU) stored every weight twice."""

    def __init__(self, path: Path):
        self.f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.name = path.name
        self.offset = 0
        self.seen: dict[tuple[int, str], tuple[int, int]] = {}

    def add(self, data: np.ndarray, kind: str = "") -> tuple[int, int]:
        """Write ``data``'s bytes unless the same bytes are in already; (offset, bytes).
        ``kind`` (what reads them) does not change where equal bytes go (the class doc)."""
        a = np.ascontiguousarray(data)
        raw = memoryview(a.reshape(-1).view(np.uint8))
        h = hasher()
        h.update(raw)
        key = (a.nbytes, h.hexdigest())
        if key in self.seen:
            return self.seen[key]
        if a.nbytes >= PAGED_FROM and self.offset % PAGE:
            pad = PAGE - self.offset % PAGE
            self.f.write(bytes(pad))
            self.offset += pad
        self.f.write(raw)
        self.seen[key] = (self.offset, a.nbytes)
        self.offset += a.nbytes
        return self.seen[key]

    def close(self) -> None:
        self.f.close()


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu().reshape(-1)  # a 0-dim weight has no bytes view
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def _spec_modules(*specs: Any) -> list[str]:
    """Modules that define the container types of the inputs and outputs (HF's ``ModelOutput``
    classes): importing one registers its types with pytree, which rebuilding the call
    signature in a fresh process needs."""
    found: set[str] = set()

    def walk(spec: Any) -> None:
        mod = getattr(getattr(spec, "type", None), "__module__", "builtins")
        if mod not in ("builtins", "collections") and not mod.startswith("torch"):
            found.add(mod)
        for child in spec.children() if hasattr(spec, "children") else ():
            walk(child)

    for s in specs:
        walk(s)
    return sorted(found)


def _rule_set(options: Options) -> list[dict[str, Any]]:
    from fxpass.jit.digest import rule_identity
    from fxpass.plugins import select_rules

    rules = select_rules(target=options.get_device().target, enable=options.enable,
                         disable=options.disable, only=options.only)
    out = []
    for r in rules:
        name, plugin, version, *_rest, module, source, _packages = rule_identity(r)
        out.append({"name": name, "plugin": plugin, "version": version, "module": module,
                    "source": source})
    return out

def _write_program(name: str, low: Any, tmp: Path, wf: _WeightsFile, device: Any,
                   say: Callable[[str], None]) -> dict[str, Any]:
    from fxpass.aot.runtime import runtime_graph
    from fxpass.device import DeviceError, Files
    from fxpass.jit import plan

    say(f"writing {name}.pt2")
    torch.export.save(low.program, tmp / f"{name}.pt2")
    graph, consts = plan.encode(runtime_graph(low.program), [], {})
    (tmp / f"{name}.graph.json").write_bytes(graph)
    (tmp / f"{name}.consts.pt").write_bytes(consts)
    weights = []
    for wname, t in low.weights.items():
        offset, nbytes = wf.add(_tensor_bytes(t))
        weights.append({"name": wname, "dtype": str(t.dtype), "shape": list(t.shape),
                        "offset": offset, "bytes": nbytes})
    regions, files = [], Files(tmp)
    for r in low.regions:
        say(f"writing region {r.name}")
        try:  # the device writes its artifact's files; the entry says how to open them
            entry = device.save(r.region, r.artifact, files, wf)
        except DeviceError as e:
            raise PackageError(f"region {r.name}: {e}") from None
        if not isinstance(entry, dict):
            raise PackageError(f"device {device.name}: save() returned {entry!r:.60} for region "
                               f"{r.name}; want a JSON dict (the entry open() reads)")
        regions.append({
            **entry, "name": r.name, "key": r.key, "input_names": r.input_names,
            "inputs": [{"shape": list(s), "dtype": str(d)} for s, d in r.inputs],
            "outputs": [{"shape": list(s), "dtype": str(d)} for s, d in r.outputs],
        })
    return {
        "file": f"{name}.pt2",
        "graph": f"{name}.graph.json",
        "consts": f"{name}.consts.pt",
        "in_spec": pytree.treespec_dumps(low.in_spec),
        "out_spec": pytree.treespec_dumps(low.out_spec),
        "inputs": [_spec(x) for x in low.inputs],
        "weights": weights,
        "state": [{"name": k, **_spec(t)} for k, t in low.state.items()],
        "regions": regions,
        "cpu_threads": low.cpu_threads,
        "memo": list(low.memo),
    }


#: set-aside and temporary directories beside a package ``p``: ``.p.tmp-<pid>-<random>`` (a
#: package being written), ``.p.old-<pid>-<random>`` (the package it replaces, until removed)
_TMP, _OLD = "tmp", "old"
#: this process's directories being written (another thread's save is not stale)
_ACTIVE: set[Path] = set()


def _sibling(dest: Path, kind: str) -> str:
    return f".{dest.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _leftovers(dest: Path, kind: str) -> list[Path]:
    """The ``kind`` directories beside ``dest`` that no running save is using, newest first:
    what a save killed part-way left behind."""
    found = []
    prefix = f".{dest.name}.{kind}-"
    try:
        entries = list(dest.parent.iterdir())
    except OSError:
        return []
    for d in entries:
        if not d.name.startswith(prefix) or not d.is_dir() or d in _ACTIVE:
            continue
        pid = d.name[len(prefix):].split("-")[0]
        if pid.isdigit() and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
            found.append(d)
    return sorted(found, key=lambda d: d.stat().st_mtime, reverse=True)


def _interrupted(dest: Path) -> str:
    """A hint naming the package a killed save set aside, for the error that ``dest`` is
    missing ("" when there is none)."""
    old = [d for d in _leftovers(dest, _OLD) if (d / MANIFEST).is_file()]
    if not old:
        return ""
    return (f"; a save into it was interrupted and set the previous package aside at {old[0]}: "
            f"rename that to {dest.name}, or save again (which does)")


def _install(tmp: Path, dest: Path) -> None:
    """Move the complete package ``tmp`` to ``dest`` by renames: the old package (if any) is
    renamed aside, then the new one renamed in; the caller removes the old one after
    (``_leftovers``). Killed at any point, the disk holds the old package or the new one,
    complete (``dest``, or the set-aside copy the next save puts back); an exception between
    the renames puts the old one back."""
    if not dest.exists():
        os.replace(tmp, dest)
        return
    old = dest.parent / _sibling(dest, _OLD)
    os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.replace(old, dest)
        except OSError as e:
            raise PackageError(f"saving {dest} failed and the previous package could not be "
                               f"put back ({e}): it is complete at {old}; rename it to "
                               f"{dest.name}") from e
        raise


def _remove(stale: Path, dest: Path) -> None:
    """Remove a set-aside or temporary directory; if that fails, a warning names it."""
    try:
        shutil.rmtree(stale)
    except OSError as e:
        warnings.warn(f"{dest} is saved, but {stale}, set aside by this or an interrupted "
                      f"save, could not be removed ({e}); remove it by hand (the next save "
                      "tries again)", RuntimeWarning, stacklevel=3)


def save_package(programs: dict[str, Any], options: Options, path: str | os.PathLike, *,
                 extra: dict[str, Any] | None = None,
                 progress: Callable[[str], None] | None = None) -> str:
    """``package.save``: write ``programs`` (name -> ``aot.export.Lowered``) to the directory
    ``path``, atomically: the package is written whole under a temporary name beside
    ``path``, then swapped in by renames (``_install``). What an earlier, killed save left
    beside it is put back (a set-aside package where ``path`` is missing) or removed once
    this one is in place."""
    say = progress or (lambda _msg: None)
    dest = Path(path)
    if dest.exists() and not dest.is_dir():
        raise PackageError(f"{dest} is a file, not a package directory: refusing to replace it; "
                           "save to a directory path")
    if dest.exists() and not (dest / MANIFEST).exists() and any(dest.iterdir()):
        raise PackageError(f"{dest} exists and is not an fxpass package: refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():  # a save killed between its two renames: the old package back first
        old = [d for d in _leftovers(dest, _OLD) if (d / MANIFEST).is_file()]
        if old:
            os.replace(old[0], dest)
            say(f"put back {dest.name}, set aside by an interrupted save")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{_TMP}-{os.getpid()}-",
                                dir=dest.parent))
    _ACTIVE.add(tmp)
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a package is copied and read by others
        _write(programs, options, tmp, extra, say)
        _install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _ACTIVE.discard(tmp)
    _tidy(dest)
    return str(dest)


def _tidy(dest: Path) -> None:
    """Remove the package that ``dest`` replaced, and what saves killed part-way left."""
    for stale in (*_leftovers(dest, _OLD), *_leftovers(dest, _TMP)):
        _remove(stale, dest)


def _write(programs: dict[str, Any], options: Options, tmp: Path, extra: dict[str, Any] | None,
           say: Callable[[str], None]) -> None:
    """Every file of the package into the directory ``tmp``, the manifest last."""
    wf = _WeightsFile(tmp / WEIGHTS)
    try:
        device = options.get_device()
        written = {name: _write_program(name, low, tmp, wf, device, say)
                   for name, low in programs.items()}
    finally:
        wf.close()
    first = next(iter(programs.values()))
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        files[f.relative_to(tmp).as_posix()] = {
            "bytes": f.stat().st_size, HASH_NAME: _file_digest(f)}
    manifest = {
        "format": FORMAT,
        "versions": _versions(),
        "device": device.name,
        "device_plugin": device.plugin,
        "device_identity": device.identity(options.dev),
        "device_options": device.keyed(options.dev),
        "executor": first.report.executor,
        "rules": _rule_set(options),
        "imports": _spec_modules(*(s for low in programs.values()
                                   for s in (low.in_spec, low.out_spec))),
        "programs": written,
        **(extra or {}),
        "checksum": HASH_NAME,
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(sign(manifest), indent=1))
