"""The package on disk: ``save(program, path)`` and ``load(path)``, verified, nothing recompiled.

One directory::

    manifest.json          format, fxpass/torch/onnxruntime versions, march, executor, the rule
                           set (name, plugin, version, source digest), input and output specs,
                           every region (key, files, input/output specs), every file's size and
                           checksum
    program.pt2            torch.export.save of the ExportedProgram: the CPU ops and the weights
                           they read; each region is one torch.ops.fxpass.region call
    regions/<name>.onnx    the region's model (host executor), its weights as external data in
    regions/<name>.bin     <name>.bin: every weight is stored once, in the program or a region

Why a directory of plain files: a board-side loader needs the ONNX/``.hbm`` files and the
manifest without Python pickles, and onnxruntime maps external weights straight from the file.

``load`` checks everything before it runs anything: the manifest's format and versions, that
the executor can run the march, every file's size (a truncated copy) and checksum (an edited
one). It opens each region's session from its files and registers it for the custom op; it
runs no rule, no partition, no lowering and no Dynamo trace. Calls check their inputs' shapes
and dtypes against the exported ones.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpass.backends.bpu.digest import HASH_NAME, hasher

FORMAT = "fxpass-package/1"
MANIFEST = "manifest.json"
PROGRAM = "program.pt2"
_DTYPES = {str(d): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


class PackageError(RuntimeError):
    """A package that cannot be loaded as it is; the message names the file and the fix."""


def _file_digest(path: Path) -> str:
    h = hasher()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _spec(t: Any) -> dict[str, Any] | None:
    if isinstance(t, torch.Tensor):
        return {"shape": list(t.shape), "dtype": str(t.dtype)}
    return None


def _io_specs(ep: Any) -> tuple[list[dict], list[dict]]:
    """(inputs, outputs) of the program, flattened in pytree order, with their paths."""
    ins, outs = [], []
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name != "USER_INPUT":
            continue
        node = next(n for n in ep.graph.find_nodes(op="placeholder") if n.name == spec.arg.name)
        val = node.meta.get("val")
        ins.append({"name": spec.arg.name, **(_spec(val) or {"value": repr(val)})})
    (out,) = ep.graph.find_nodes(op="output")
    for i, a in enumerate(out.args[0]):
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        outs.append({"index": i, **(_spec(val) or {"value": repr(val)})})
    return ins, outs


def _spec_modules(ep: Any) -> list[str]:
    """Modules that define the container types of the program's inputs and outputs (HF's
    ``ModelOutput`` classes): importing one registers its types with pytree, which
    ``torch.export.load`` needs to rebuild the call signature in a fresh process."""
    found: set[str] = set()

    def walk(spec: Any) -> None:
        t = getattr(spec, "type", None)
        mod = getattr(t, "__module__", "builtins")
        if t is not None and mod not in ("builtins", "collections") and not mod.startswith(
                "torch"):
            found.add(mod)
        for child in spec.children() if hasattr(spec, "children") else ():
            walk(child)

    walk(ep.call_spec.in_spec)
    walk(ep.call_spec.out_spec)
    return sorted(found)


def _rule_set(options: dict[str, Any]) -> list[dict[str, Any]]:
    from fxpass.backends.bpu.digest import rule_identity
    from fxpass.plugins import select_rules

    rules = select_rules(target="bpu", enable=options.get("enable"),
                         disable=options.get("disable"), only=options.get("only"))
    out = []
    for r in rules:
        name, plugin, version, *_rest, module, source, packages = rule_identity(r)
        out.append({"name": name, "plugin": plugin, "version": version, "module": module,
                    "source": source})
    return out


def _versions() -> dict[str, str]:
    import onnxruntime

    import fxpass

    return {"fxpass": fxpass.__version__, "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__}


def save(program: Any, path: str | os.PathLike, *,
         progress: Callable[[str], None] | None = None) -> str:
    """Write ``program`` (from ``export``) to the directory ``path``, atomically: everything
    goes to a temporary directory beside it, renamed into place when complete."""
    from fxpass.backends.bpu.lowering.driver import point_external, write_weights_file

    say = progress or (lambda _msg: None)
    dest = Path(path)
    if dest.exists() and not (dest / MANIFEST).exists() and any(dest.iterdir()):
        raise PackageError(f"{dest} exists and is not an fxpass package: refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a package is copied and read by others
    try:
        say(f"writing {PROGRAM}")
        torch.export.save(program.exported_program, tmp / PROGRAM)
        (tmp / "regions").mkdir()
        regions = []
        for r in program.regions:
            say(f"writing region {r.name}")
            layout = write_weights_file(r.weights, str(tmp / "regions" / f"{r.name}.bin"))
            model = type(r.model)()
            model.CopyFrom(r.model)
            point_external(model, r.weights, layout, f"{r.name}.bin")
            (tmp / "regions" / f"{r.name}.onnx").write_bytes(model.SerializeToString())
            regions.append({
                "name": r.name, "key": r.key, "executor": "onnxruntime",
                "model": f"regions/{r.name}.onnx", "weights": f"regions/{r.name}.bin",
                "input_names": r.input_names,
                "inputs": [{"shape": list(s), "dtype": str(d)} for s, d in r.inputs],
                "outputs": [{"shape": list(s), "dtype": str(d)} for s, d in r.outputs],
            })
        ins, outs = _io_specs(program.exported_program)
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = f.relative_to(tmp).as_posix()
            files[rel] = {"bytes": f.stat().st_size, HASH_NAME: _file_digest(f)}
        manifest = {
            "format": FORMAT,
            "imports": _spec_modules(program.exported_program),
            "versions": _versions(),
            "march": program.report.march,
            "executor": program.report.executor,
            "cpu_threads": program.cpu_threads,
            "rules": _rule_set(program.options),
            "inputs": ins,
            "outputs": outs,
            "regions": regions,
            "checksum": HASH_NAME,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(sign(manifest), indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(dest)


def _manifest_digest(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    h = hasher()
    h.update(json.dumps(body, sort_keys=True).encode())
    return h.hexdigest()


def sign(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its own digest: the files' checksums live in it, so an edit to it
    (an input shape, a file's checksum) must be caught as well as an edit to a file."""
    return {**manifest, "digest": _manifest_digest(manifest)}


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of package ``path``, checked for format and versions (no file read)."""
    root = Path(path)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise PackageError(f"{root} is not an fxpass package: it has no {MANIFEST}. Make one "
                           "with fxpass.backends.bpu.export(model, args).save(path)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise PackageError(f"{mpath} is not valid JSON ({e}): the package was edited or "
                           "truncated; export it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PackageError(f"{mpath}: format {got!r}, this fxpass reads "
                           f"{FORMAT!r}; export the model again with this fxpass")
    if manifest.get("checksum") == HASH_NAME and manifest.get("digest") != _manifest_digest(
            manifest):
        raise PackageError(f"{mpath} does not match its own digest: the manifest was edited; "
                           "copy the package again (or export again)")
    made, here = manifest.get("versions", {}), _versions()
    for tool, same in (("fxpass", 2), ("torch", 2)):  # major.minor must agree
        a = str(made.get(tool, "?")).split("+")[0].split(".")[:same]
        b = here[tool].split("+")[0].split(".")[:same]
        if a != b:
            raise PackageError(
                f"{mpath}: made with {tool} {made.get(tool)}, this process has {here[tool]}; "
                f"a package loads with the {tool} release ({'.'.join(b)}) that made it. Export "
                "the model again here, or load it where that release is installed")
    return manifest


def verify(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists exists with its size and checksum; nothing else is read."""
    root = Path(path)
    algo = manifest.get("checksum")
    if algo != HASH_NAME:
        raise PackageError(f"{root / MANIFEST}: checksums are {algo}, this process hashes with "
                           f"{HASH_NAME} (install xxhash, as fxpass's requirements do)")
    for rel, want in manifest["files"].items():
        f = root / rel
        if not f.is_file():
            raise PackageError(f"{f} is missing from the package; copy the whole directory")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise PackageError(f"{f} is {size} bytes, the manifest says {want['bytes']}: the file "
                               "was truncated or replaced; copy the package again")
        if _file_digest(f) != want[algo]:
            raise PackageError(f"{f} does not match its checksum in the manifest: the file was "
                               "edited or corrupted; copy the package again (or export again)")


def _check_executor(manifest: dict[str, Any], root: Path) -> None:
    from fxpass.backends.bpu.capability import MARCHES

    m, ex = manifest.get("march"), manifest.get("executor")
    if m not in MARCHES:
        raise PackageError(f"{root / MANIFEST}: march {m!r} is not one this fxpass knows "
                           f"({sorted(MARCHES)})")
    if ex != "onnxruntime":
        raise PackageError(f"{root / MANIFEST}: executor {ex!r} cannot run here: this loader "
                           "runs onnxruntime (host) regions only")


class Loaded:
    """A loaded package: call it with the model's own signature."""

    def __init__(self, root: Path, manifest: dict[str, Any], module: Any, regions: list[Any]):
        self.path, self.manifest, self.module, self.regions = root, manifest, module, regions
        self._inputs = [
            (i["name"], tuple(i["shape"]), _DTYPES.get(i["dtype"])) if "shape" in i else None
            for i in manifest["inputs"]
        ]
        n = manifest.get("cpu_threads")
        from fxpass.backends.bpu.aot import _threads

        self._run = _threads(module, n)

    def check(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Inputs of the exported count, shapes and dtypes, else a ValueError naming the one."""
        leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
        if len(leaves) != len(self._inputs):
            raise ValueError(
                f"{self.path}: the program takes {len(self._inputs)} input(s) "
                f"({[i[0] for i in self._inputs if i]}), got {len(leaves)}: call it as the "
                "model was exported")
        for (kp, v), want in zip(leaves, self._inputs, strict=True):
            if want is None:
                continue
            where = "".join(str(k) for k in kp)
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{self.path}: input {where} must be a tensor, got "
                                 f"{type(v).__name__}")
            name, shape, dtype = want
            if tuple(v.shape) != shape or v.dtype != dtype:
                raise ValueError(
                    f"{self.path}: input {where} is {v.dtype}{list(v.shape)}, the program was "
                    f"exported for {dtype}{list(shape)}. Pad or batch the input to that shape, "
                    "or export again with this one")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.check(args, kwargs)
        return self._run(*args, **kwargs)


def load(path: str | os.PathLike) -> Loaded:
    """Open package ``path``: verified, no rule, partition, compile or trace runs."""
    from fxpass.backends.bpu.aot import open_region
    from fxpass.backends.bpu.runtime import OrtExecutor, RegionCall

    root = Path(path)
    manifest = read_manifest(root)
    _check_executor(manifest, root)
    verify(root, manifest)
    regions = []
    for r in manifest["regions"]:
        model = root / r["model"]
        try:
            ex = OrtExecutor(str(model), r["input_names"])
        except Exception as e:
            raise PackageError(f"{model}: onnxruntime cannot open it: {e}") from e
        expected = [torch.empty(i["shape"], dtype=_DTYPES[i["dtype"]], device="meta")
                    for i in r["inputs"]]
        outs = [(tuple(o["shape"]), _DTYPES[o["dtype"]]) for o in r["outputs"]]

        def no_eager(name: str = r["name"]) -> Any:
            raise PackageError(f"region {name} of {root} failed and a package has no eager copy")

        call = RegionCall(r["name"], ex, no_eager, expected, strict=True,
                          out_shapes=[torch.Size(s) for s, _ in outs])
        open_region(r["key"], call, outs)
        regions.append(call)
    import importlib

    for mod in manifest.get("imports", []):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise PackageError(f"{root / MANIFEST}: the program's inputs or outputs are types of "
                               f"{mod!r}, which does not import here ({e}); install it") from e
    ep = torch.export.load(root / PROGRAM)
    return Loaded(root, manifest, ep.module(), regions)
