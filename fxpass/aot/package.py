"""The package on disk: ``save`` and ``load``, verified, nothing recompiled.

One directory::

    manifest.json           format; fxpass and torch versions; the device (its name, plugin,
                            identity: tool versions and source digest, and options); the rule
                            set (name, plugin, version, source digest); per program its
                            inputs, outputs, state and weights (offset and size in weights.bin);
                            per region its key, input/output specs and the device's own entry
                            (its files); every file's size and checksum; the manifest's own
                            digest
    <program>.pt2           torch.export.save of each ExportedProgram (main, or prefill and
                            decode): the CPU ops; each region is one torch.ops.fxpass.region call
    region_<name>.*         each region's artifact, written by its device (``Device.save``: an
                            ONNX device's model, its weights external data in weights.bin)
    weights.bin             every weight once, deduplicated by content across programs and
                            regions; tensors of 64 KiB or more start on a page (4 KiB), so
                            a runtime and the loader map them from the file

Why plain files: a device-side loader reads the manifest, the region files and weights.bin
without Python; onnxruntime maps external weights straight from the file.

``load`` checks everything before it runs anything: the manifest's format, digest and
versions, that the device it was made for is installed (its plugin alone is imported) and can
run every region here (``Device.can_open``), every file's size (a truncated copy) and
checksum (an edited one), and that nothing the manifest names leads outside the package
(``aot.confine``). The device opens each region's executor from its files
(``Device.open``), the weights are mapped and the regions registered for the custom op; it
runs no rule, no partition, no lowering and no Dynamo trace, and imports none of the export
side (``aot.write`` writes packages). Calls check their inputs' shapes and dtypes against the
exported ones.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from fxpass.aot.confine import (
    PackageError,
    allowed_imports,
    check_external_data,
    check_graph,
    member,
    spec_types,
)
from fxpass.device import Device, DeviceError, Files
from fxpass.jit.digest import HASH_NAME, hasher

if TYPE_CHECKING:  # the loader never builds options: options.py imports the lowering (onnx)
    from fxpass.jit.options import Options

FORMAT = "fxpass-package/1"
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
#: tensors of this many bytes or more start on a :data:`PAGE` boundary in weights.bin
PAGED_FROM = 64 * 1024
#: Why a page and not 64 KiB (onnx's Windows-minded default): onnxruntime maps an external
#: weight at any offset (it maps from the page below; checked on Linux with onnxruntime
#: 1.31), and a 64 KiB boundary pads each tensor by up to 64 KiB, which is several percent of
#: an int4 package whose tensors are mostly well under a megabyte
PAGE = 4096
_DTYPES = {str(d): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def _file_digest(path: Path) -> str:
    h = hasher()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()

def _versions() -> dict[str, str]:
    """The framework's versions; a device's tools are in its identity (``device_identity``)."""
    import fxpass

    return {"fxpass": fxpass.__version__, "torch": torch.__version__}

def save(programs: dict[str, Any], options: Options, path: str | os.PathLike, *,
         extra: dict[str, Any] | None = None,
         progress: Callable[[str], None] | None = None) -> str:
    """Write ``programs`` (name -> ``aot.export.Lowered``) to the directory ``path``,
    atomically (``aot.write``: written whole beside it, then swapped in by renames)."""
    from fxpass.aot.write import save_package

    return save_package(programs, options, path, extra=extra, progress=progress)


def _manifest_digest(manifest: dict[str, Any]) -> str:
    h = hasher()
    h.update(json.dumps({k: v for k, v in manifest.items() if k != "digest"},
                        sort_keys=True).encode())
    return h.hexdigest()


def sign(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its own digest: the files' checksums live in it, so an edit to it
    (an input shape, a file's checksum) must be caught as well as an edit to a file."""
    return {**manifest, "digest": _manifest_digest(manifest)}


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of package ``path``, checked for format, digest and versions, and that
    its device is installed and can run each of its regions here."""
    return _read(Path(path))[0]


def _read(root: Path) -> tuple[dict[str, Any], Device]:
    """``read_manifest``, and the package's device."""
    mpath = root / MANIFEST
    if not root.exists():
        from fxpass.aot.write import _interrupted

        raise PackageError(f"{root} does not exist{_interrupted(root)}; give the directory that "
                           "fxpass.aot.export.export(...).save(path) or `fxpass export` wrote")
    if not root.is_dir():
        raise PackageError(f"{root} is a file, not a package: a package is the directory that "
                           "fxpass.aot.export.export(...).save(path) wrote")
    if not mpath.is_file():
        raise PackageError(f"{root} is not an fxpass package: it has no {MANIFEST}. Make one "
                           "with fxpass.aot.export.export(model, args).save(path)")
    member(root, MANIFEST, "the manifest")  # not a symlink leading out
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise PackageError(f"{mpath} is not valid JSON ({e}): the package was edited or "
                           "truncated; export it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PackageError(f"{mpath}: format {got!r}, this fxpass reads {FORMAT!r}; export the "
                           "model again with this fxpass")
    if manifest.get("checksum") != HASH_NAME:
        raise PackageError(f"{mpath}: checksums are {manifest.get('checksum')}, this process "
                           f"hashes with {HASH_NAME} (install xxhash, as fxpass requires)")
    if manifest.get("digest") != _manifest_digest(manifest):
        raise PackageError(f"{mpath} does not match its own digest: the manifest was edited; "
                           "copy the package again (or export again)")
    made, here = manifest.get("versions", {}), _versions()
    for tool in ("fxpass", "torch"):  # major.minor must agree
        a = str(made.get(tool, "?")).split("+")[0].split(".")[:2]
        b = here[tool].split("+")[0].split(".")[:2]
        if a != b:
            raise PackageError(
                f"{mpath}: made with {tool} {made.get(tool)}, this process has {here[tool]}; "
                f"a package loads with the {tool} release ({'.'.join(b)}) that made it. Export "
                "the model again here, or load it where that release is installed")
    device = package_device(manifest, mpath)
    programs = manifest.get("programs")
    if not isinstance(programs, dict):
        raise PackageError(f"{mpath}: no programs; the package was edited: export it again")
    for name, spec in programs.items():
        for r in spec.get("regions", []) if isinstance(spec, dict) else []:
            why = device.can_open(r) if isinstance(r, dict) else "not an entry"
            if why:
                where = r.get("name") if isinstance(r, dict) else r
                raise PackageError(f"{mpath}: region {where!r} of {name!r}: {why}")
    return manifest, device


def package_device(manifest: dict[str, Any], where: Any) -> Device:
    """The device the package was made for, from the plugin that registered it (imported alone:
    the rule set and other plugins stay unloaded); a ``PackageError`` naming the device and its
    plugin when it is not installed here."""
    name, plugin = manifest.get("device"), manifest.get("device_plugin") or "?"
    if not isinstance(name, str) or not name:
        raise PackageError(f"{where}: records no device (an older fxpass made it); export the "
                           "model again with this fxpass")
    from fxpass.plugins import get_device

    try:
        return get_device(name, plugin=plugin)
    except DeviceError:
        dist, _, ep = plugin.partition(":")
        raise PackageError(
            f"{where}: made for fxpass device {name!r}, which is not installed here: install "
            f"its plugin ({plugin}: entry point {ep or '?'!r} of distribution {dist!r}), or "
            "load the package where it is installed") from None


def verify(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists lies inside the package (``confine.member``: checked
    before it is read) and exists with its size and checksum."""
    root = Path(path)
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        raise PackageError(f"{root / MANIFEST}: no file list with {WEIGHTS}; the package was "
                           "edited: export it again")
    for rel, want in files.items():
        f = member(root, rel, "the manifest's file list")
        if not f.is_file():
            raise PackageError(f"{f} is missing from the package; copy the whole directory")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise PackageError(f"{f} is {size} bytes, the manifest says {want['bytes']}: the file "
                               "was truncated or replaced; copy the package again")
        if _file_digest(f) != want[HASH_NAME]:
            raise PackageError(f"{f} does not match its checksum in the manifest: the file was "
                               "edited or corrupted; copy the package again (or export again)")


def confine(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Refuse (``confine.ConfinementError``, naming the entry) a package that names anything
    outside itself: a program or region file, a region model's external data; return the
    modules of ``imports`` still to import, each the module of a container type the call
    signatures name. Runs before any of those files is opened and before any import."""
    listed = manifest["files"]
    specs = []
    for name, spec in manifest["programs"].items():
        for key in ("file", "graph", "consts"):
            member(root, spec.get(key), f"program {name!r} ({key})", listed)
        for r in spec["regions"]:
            if "model" not in r:
                continue  # a device whose entry names its files otherwise (Files confines them)
            model = member(root, r.get("model"), f"region {r.get('name')!r} of {name!r}", listed)
            if model.suffix == ".onnx":  # a runtime resolves its external data itself
                check_external_data(root, model, listed)
        specs += [spec["in_spec"], spec["out_spec"]]
    return allowed_imports(manifest.get("imports", []), spec_types(*specs), str(root / MANIFEST))


class LoadedProgram:
    """One program of a package: ``flat(*inputs)`` runs it on flat user inputs (weights and
    state supplied); ``__call__`` takes the model's own signature and checks the inputs."""

    def __init__(self, root: Path, name: str, spec: dict[str, Any], weights: np.memmap,
                 state: dict[str, torch.Tensor]):
        from fxpass.aot.runtime import threads

        self.path, self.name, self.spec = root, name, spec
        self.weights = [
            torch.frombuffer(weights, dtype=_DTYPES[w["dtype"]],
                             count=w["bytes"] // _DTYPES[w["dtype"]].itemsize,
                             offset=w["offset"]).view(w["shape"]) if w["bytes"] else
            torch.empty(w["shape"], dtype=_DTYPES[w["dtype"]])
            for w in spec["weights"]]
        self.state = [state[s["name"]] for s in spec["state"]]
        self.in_spec = pytree.treespec_loads(spec["in_spec"])
        self.out_spec = pytree.treespec_loads(spec["out_spec"])
        self._inputs = [(tuple(i["shape"]), _DTYPES[i["dtype"]]) if "shape" in i else None
                        for i in spec["inputs"]]
        from fxpass.jit import plan

        # the program's runtime graph (aot.runtime.runtime_graph), not torch.export.load: that one
        # imports Dynamo, 1.3 s of a fresh process; the .pt2 is the portable copy
        graph = json.loads((root / spec["graph"]).read_bytes())
        check_graph(graph, str(root / spec["graph"]))  # before decode resolves any name
        #: region calls still go through the custom op until ``streamline`` binds them: this
        #: runs while the regions' executors open (``open_package``)
        self.gm = plan.decode(graph, (root / spec["consts"]).read_bytes(), {})
        phs = [n.name for n in self.gm.graph.find_nodes(op="placeholder")]
        n_w = len(self.weights)
        #: state name -> its placeholder in the runtime graph
        self.state_phs = {s["name"]: ph for s, ph in zip(
            spec["state"], phs[n_w:n_w + len(self.state)], strict=True)}
        self._run = threads(self.gm, spec.get("cpu_threads"))
        self._prefix = (*self.weights, *self.state)
        self.memos: list[Any] = []
        #: region inputs its executor writes in place (``aot.writes.grant_in_place``)
        self.in_place = 0

    def reads(self) -> set[str]:
        """The state this program reads (not only writes)."""
        from fxpass.aot.writes import state_reads

        by_ph = {ph: name for name, ph in self.state_phs.items()}
        return {by_ph[ph] for ph in state_reads(self.gm, list(by_ph))}

    def streamline(self, unread: set[str]) -> None:
        """The per-call fast path, once the regions are open (``aot.runtime.bind``,
        ``aot.writes``, ``aot.memo``): region calls bound to their executors, no write into
        state that no program of the package reads, the cache writes fused, the
        position-only ops memoized. The graph's code is generated once, at the end."""
        from fxpass.aot.memo import memoize_inputs
        from fxpass.aot.runtime import bind, region_executor
        from fxpass.aot.writes import drop_writes, fuse_index_writes, grant_in_place

        with _one_recompile(self.gm):
            bind(self.gm)
            drop_writes(self.gm, {self.state_phs[s] for s in unread if s in self.state_phs})
            self.in_place = grant_in_place(self.gm, region_executor)
            fuse_index_writes(self.gm)
            self.memos = memoize_inputs(self.gm, len(self.weights), len(self.state),
                                        self.spec.get("memo", []))

    def flat(self, *inputs: Any) -> tuple[Any, ...]:
        """Run on the flat user inputs, unchecked."""
        return self._run(*self._prefix, *inputs)

    def step(self, *inputs: Any) -> tuple[Any, ...]:
        """``flat`` on the caller's torch threads: a loop that calls it per token sets them
        once around the loop (``cpu_threads``) instead of twice per call."""
        return self.gm(*self._prefix, *inputs)

    def bind(self, state: dict[str, torch.Tensor]) -> Callable[..., tuple[Any, ...]]:
        """``step`` over ``state`` (name -> tensor, written in place) instead of the package's
        own: a generation runner gives each concurrent call a state of its own."""
        gm = self.gm
        prefix = (*self.weights, *[state[s["name"]] for s in self.spec["state"]])

        def step(*inputs: Any) -> tuple[Any, ...]:  # forward, not Module.__call__: a loaded
            return gm.forward(*prefix, *inputs)     # program has no hooks (~5 us a step)

        return step

    def embedding_rows(self) -> int | None:
        """The rows of the weight an ``aten.embedding`` of a user input looks up (a token id
        must be below them), or None when no such lookup runs on the CPU."""
        phs = list(self.gm.graph.find_nodes(op="placeholder"))
        weights = {ph: w for ph, w in zip(phs, self.weights, strict=False)}
        users = set(phs[len(self.weights) + len(self.state):])
        rows = [weights[n.args[0]].shape[0] for n in self.gm.graph.find_nodes(
            op="call_function", target=torch.ops.aten.embedding.default)
            if n.args[0] in weights and n.args[1] in users]
        return min(rows) if rows else None

    def check(self, leaves: list[tuple[Any, Any]]) -> None:
        """Inputs of the exported count, shapes and dtypes, else a ValueError naming the one."""
        if len(leaves) != len(self._inputs):
            raise ValueError(
                f"{self.path}: program {self.name!r} takes {len(self._inputs)} input(s), got "
                f"{len(leaves)}: call it as the model was exported")
        for (kp, v), want in zip(leaves, self._inputs, strict=True):
            if want is None:
                continue
            where = "".join(str(k) for k in kp)
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{self.path}: input {where} must be a tensor, got "
                                 f"{type(v).__name__}")
            shape, dtype = want
            if tuple(v.shape) != shape or v.dtype != dtype:
                raise ValueError(
                    f"{self.path}: input {where} is {v.dtype}{list(v.shape)}, the program was "
                    f"exported for {dtype}{list(shape)}. Pad or batch the input to that shape, "
                    "or export again with this one")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
        self.check(leaves)
        return pytree.tree_unflatten(list(self.flat(*[v for _, v in leaves])), self.out_spec)


class Package:
    """A loaded package: its programs by name (``programs``), its manifest and regions."""

    def __init__(self, root: Path, manifest: dict[str, Any], programs: dict[str, LoadedProgram],
                 regions: list[Any], state: dict[str, torch.Tensor]):
        self.path, self.manifest, self.programs = root, manifest, programs
        self.regions, self.state = regions, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if set(self.programs) != {"main"}:
            raise TypeError(f"{self.path} holds programs {sorted(self.programs)}, not one to "
                            "call; a generation package is run with load(path).generate(...)")
        return self.programs["main"](*args, **kwargs)


def _open_executors(root: Path, manifest: dict[str, Any],
                    device: Device) -> Callable[..., dict[tuple[str, int], Any]]:
    """Start opening each region's executor, by (program, region index), from its device
    (``open``), on threads side by side; returns the wait for them (raising the first error
    unless ``check=False``). Why: an onnxruntime session's open (graph optimization,
    prepacking) is most of a load and runs outside the GIL, while the loader's own Python
    (program graphs, weights) needs no executor until it binds the region calls (tested by
    ``test_load_reads_the_programs_while_the_regions_open``). A device whose runtime opens
    one at a time serializes its own ``open``."""
    from concurrent.futures import ThreadPoolExecutor

    files = Files(root)

    def open_one(r: dict[str, Any]) -> Any:
        try:
            ex = device.open(r, files)
        except Exception as e:
            raise PackageError(f"{root}: region {r.get('name')!r} ({r.get('model', '?')}): "
                               f"device {device.name!r} cannot open it: {e}") from e
        if not callable(ex):
            raise PackageError(f"{root}: device {device.name!r} opened region "
                               f"{r.get('name')!r} as {ex!r:.60}, which is not callable")
        return ex

    jobs = {(name, i): r for name, spec in manifest["programs"].items()
            for i, r in enumerate(spec["regions"])}
    pool = ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1)),
                              thread_name_prefix="fxpass-open")
    futures = {k: pool.submit(open_one, r) for k, r in jobs.items()}

    def wait(check: bool = True) -> dict[tuple[str, int], Any]:
        pool.shutdown(wait=True)  # every open ends before any error is raised
        return {k: f.result() for k, f in futures.items()} if check else {}

    return wait


def open_package(path: str | os.PathLike) -> Package:
    """Verify package ``path`` and open every program and region in it (no compile), nothing
    before all it names is confined and checksummed; programs are read while regions open."""
    from fxpass.aot.runtime import close_with, open_region
    from fxpass.jit.runtime import RegionCall

    root = Path(path)
    manifest, device = _read(root)
    verify(root, manifest)
    modules = confine(root, manifest)
    opened = _open_executors(root, manifest, device)
    try:
        programs, state = _programs(root, manifest, modules)
    except BaseException:
        opened(check=False)  # the opens end first; this error is the one to name
        raise
    executors = opened()
    regions = []
    for name, spec in manifest["programs"].items():
        for index, r in enumerate(spec["regions"]):
            ex = executors[name, index]
            expected = [torch.empty(i["shape"], dtype=_DTYPES[i["dtype"]], device="meta")
                        for i in r["inputs"]]
            outs = [(tuple(o["shape"]), _DTYPES[o["dtype"]]) for o in r["outputs"]]

            def no_eager(region: str = r["name"]) -> Any:
                raise PackageError(f"region {region} of {root} failed; a package has no eager "
                                   "copy of it")

            call = RegionCall(r["name"], ex, no_eager, expected, strict=True,
                              out_shapes=[torch.Size(s) for s, _ in outs])
            open_region(r["key"], call, outs)
            regions.append((r["key"], call))
    read = set().union(*(p.reads() for p in programs.values()))
    for p in programs.values():
        p.streamline(set(state) - read)
    pkg = Package(root, manifest, programs, [call for _, call in regions], state)
    close_with(pkg, regions)  # its sessions go with it
    return pkg


def _programs(root: Path, manifest: dict[str, Any], modules: list[str]
              ) -> tuple[dict[str, LoadedProgram], dict[str, torch.Tensor]]:
    """Each program, its region calls not bound yet, and the state they share by name
    (prefill and decode), after importing the modules the call signatures need."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise PackageError(f"{root / MANIFEST}: the program's inputs or outputs are types of "
                               f"{mod!r}, which does not import here ({e}); install it") from e
    unknown = spec_types(*(s for p in manifest["programs"].values()
                           for s in (p["in_spec"], p["out_spec"]))) - set(
        pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)
    if unknown:
        raise PackageError(f"{root / MANIFEST}: the program's inputs or outputs are of types "
                           f"{sorted(unknown)}, which no module the manifest imports registers "
                           "with torch's pytree; export the model again")
    weights = np.memmap(root / WEIGHTS, mode="c") if (root / WEIGHTS).stat().st_size else (
        np.zeros(0, np.uint8))
    state: dict[str, torch.Tensor] = {}
    programs = {}
    for name, spec in manifest["programs"].items():
        for s in spec["state"]:
            state.setdefault(s["name"], torch.zeros(s["shape"], dtype=_DTYPES[s["dtype"]]))
        programs[name] = LoadedProgram(root, name, spec, weights, state)
    return programs, state


@contextmanager
def _one_recompile(gm: GraphModule) -> Iterator[None]:
    """``gm.recompile()`` called inside runs once, at the end: each generates and compiles the
    graph's Python (milliseconds), and streamlining changes a program's graph five times."""
    gm.recompile = lambda: None  # an instance attribute shadows the method
    try:
        yield
    finally:
        del gm.recompile
    gm.recompile()


def load(path: str | os.PathLike) -> Any:
    """Open package ``path``: verified, no rule, partition, compile or trace runs. A package
    from ``export`` gives a callable with the model's signature; one from
    ``export_for_generate`` a runner with ``generate(...)``."""
    pkg = open_package(path)
    if "encoder" in pkg.manifest:
        from fxpass.hf.encoders import EncoderRunner

        return EncoderRunner(pkg)
    if "generate" in pkg.manifest:
        from fxpass.aot.runner import Runner

        return Runner(pkg)
    return pkg
