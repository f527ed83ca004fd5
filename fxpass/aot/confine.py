"""What keeps a loaded package inside its directory: file names, region models' external data,
the program graphs' call targets and the modules the manifest asks to import.

Why: ``load`` checks a package's integrity (the manifest's digest, every file's checksum), but
the digest is no signature: whoever edits a manifest can re-seal it. So nothing a manifest
names is trusted to stay inside the package. A file name resolves inside the package directory
(no absolute path, no ``..``, no symlink leading out) and is one the manifest checksums; an
ONNX region's external data is held to the same rule, read from the model's protobuf wire
format here (importing onnx would cost a deployed process a tenth of a second); a graph calls
registered torch operators and a few pure Python functions only; and ``imports`` names only
the modules that define the container types the program's call signature names.

Nothing here imports more than the standard library and torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch


class PackageError(RuntimeError):
    """A package that cannot be loaded as it is; the message names the file and the fix."""


class ConfinementError(PackageError):
    """A package names something outside itself; the message names what and where."""


def member(root: Path, name: Any, what: str, listed: dict[str, Any] | None = None) -> Path:
    """``root / name`` for a file ``name`` of the package, refused with a ConfinementError
    unless it stays inside ``root``: a relative POSIX name without ``..`` that, symlinks
    resolved, lies under the resolved ``root``; with ``listed``, also one of its keys (a file
    whose checksum the manifest holds)."""
    where = f"{root}: {what}"
    if not isinstance(name, str) or not name:
        raise ConfinementError(f"{where} names the file {name!r}, not a file name; the package "
                               "was edited: export it again")
    pure = PurePosixPath(name)
    if pure.is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        raise ConfinementError(f"{where} names {name!r}, an absolute path outside the package: "
                               "a package refers to its own files by relative name; refusing "
                               "it (export the model again)")
    if ".." in pure.parts or "\\" in name:
        raise ConfinementError(f"{where} names {name!r}, which leads out of the package "
                               "directory: refusing it (export the model again)")
    if listed is not None and name not in listed:
        raise ConfinementError(f"{where} names {name!r}, which the manifest's file list does "
                               "not checksum: refusing an unverified file (export again)")
    path = root / pure
    real, base = path.resolve(), root.resolve()
    if real != base and base not in real.parents:
        raise ConfinementError(f"{where} names {name!r}, a symlink to {real}, outside the "
                               "package: copy the package with its files, not links out of it")
    return path


# ---- an ONNX model's external-data locations, from the protobuf wire format ------------------

#: field numbers of onnx.proto (checked against onnx's descriptors in the tests)
_MODEL = {7: "graph", 25: "function", 20: "training"}
_TRAINING = {1: "graph", 2: "graph"}
_GRAPH = {1: "node", 5: "tensor", 15: "sparse"}
_NODE = {5: "attribute"}
_ATTRIBUTE = {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"}
_FUNCTION = {7: "node", 11: "attribute"}
_SPARSE = {1: "tensor", 2: "tensor"}
_SCHEMA = {"model": _MODEL, "training": _TRAINING, "graph": _GRAPH, "node": _NODE,
           "attribute": _ATTRIBUTE, "function": _FUNCTION, "sparse": _SPARSE}
_TENSOR_NAME, _TENSOR_EXTERNAL = 8, 13


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each length-delimited field in ``buf[start:end]``; other
    wire types are skipped."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > end:
                raise ValueError("field runs past its message")
            yield field, i, i + n
            i += n
        else:
            raise ValueError(f"wire type {wire}")


def _string(buf: bytes, start: int, end: int) -> str:
    return bytes(buf[start:end]).decode("utf-8", "replace")


def external_locations(data: bytes) -> list[tuple[str, str]]:
    """(tensor name, ``location``) of every tensor of the serialized ONNX model ``data``
    whose data is external: initializers, sparse initializers, tensor attributes (Constant
    nodes), in the main graph, subgraphs and functions."""
    found: list[tuple[str, str]] = []
    stack = [("model", 0, len(data))]
    while stack:
        kind, start, end = stack.pop()
        if kind == "tensor":
            name, location = "", None
            for f, s, e in _fields(data, start, end):
                if f == _TENSOR_NAME:
                    name = _string(data, s, e)
                elif f == _TENSOR_EXTERNAL:
                    entry = {k: _string(data, ks, ke) for k, ks, ke in _fields(data, s, e)}
                    if entry.get(1) == "location":
                        location = entry.get(2, "")
            if location is not None:
                found.append((name, location))
            continue
        schema = _SCHEMA[kind]
        for f, s, e in _fields(data, start, end):
            child = schema.get(f)
            if child is not None:
                stack.append((child, s, e))
    return found


def check_external_data(root: Path, model: Path, listed: dict[str, Any]) -> None:
    """Every external-data location of ONNX model ``model`` is a checksummed file of the
    package (onnxruntime resolves them against the model's directory)."""
    try:
        refs = external_locations(model.read_bytes())
    except (ValueError, IndexError) as e:
        raise ConfinementError(f"{model}: not a readable ONNX model ({e}); the package was "
                               "edited: export it again") from None
    base = model.parent.relative_to(root).as_posix()
    first = {}  # each location once (a model names one file for hundreds of tensors)
    for tensor, location in refs:
        first.setdefault(location, tensor)
    for location, tensor in first.items():
        rel = location if base == "." else f"{base}/{location}"
        member(root, rel, f"region model {model.name}, tensor {tensor!r}'s external data",
               listed)


# ---- program graphs: what a node may call ----------------------------------------------------

#: Python callables a package's graph may call: pure functions of their arguments, none of
#: which reaches an object's attributes (``operator.attrgetter`` or ``operator.call`` would
#: let a crafted graph walk from a tensor to ``exec``)
SAFE_PY = frozenset(f"py:{m}:{f}" for m in ("_operator", "operator") for f in (
    "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert")) | {
    "py:torch._C:_set_grad_enabled"}
_OPS = ("placeholder", "get_attr", "call_function", "output")
_VALUES = {"dtype": torch.dtype, "torch": (torch.memory_format, torch.layout)}


def check_graph(plan: Any, where: str) -> None:
    """A program graph (``plan.encode``'s JSON) that calls registered torch operators and
    :data:`SAFE_PY` only, checked before ``plan.decode`` resolves (imports) any name."""
    nodes = plan.get("nodes") if isinstance(plan, dict) else None
    if not isinstance(nodes, list):
        raise ConfinementError(f"{where}: not a program graph; the package was edited: "
                               "export it again")
    for node in nodes:
        if not (isinstance(node, list) and len(node) == 5 and node[0] in _OPS):
            raise ConfinementError(f"{where}: node {json.dumps(node)[:80]} is not a node a "
                                   "package holds; the package was edited: export it again")
        op, name, target, args, kwargs = node
        if op == "call_function" and not _safe_target(target):
            raise ConfinementError(
                f"{where}: node {name!r} calls {target!r}, which is neither a registered "
                "torch operator nor a pure function a package may call: refusing to run "
                "it (export the model again)")
        _check_values((args, kwargs), where, name)


def _safe_target(target: Any) -> bool:
    if not isinstance(target, str):
        return False
    if target in SAFE_PY:
        return True
    kind, _, rest = target.partition(":")
    parts = rest.split(".")
    if kind != "op" or len(parts) != 3 or not all(p.isidentifier() for p in parts):
        return False
    ns, op, overload = parts
    try:  # no import: torch.ops looks the name up in the operator registry
        obj = getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        return False
    return isinstance(obj, torch._ops.OpOverload)


def _check_values(a: Any, where: str, node: str) -> None:
    if isinstance(a, list | tuple):
        for x in a:
            _check_values(x, where, node)
    elif isinstance(a, dict):
        for k, v in a.items():
            kind = _VALUES.get(k)
            if kind is not None and not isinstance(getattr(torch, str(v), None), kind):
                raise ConfinementError(f"{where}: node {node!r} names torch.{v} as a {k}, "
                                       "which it is not; the package was edited: export again")
            _check_values(v, where, node)


# ---- imports: only the modules that define the signature's container types -------------------


def spec_types(*specs: str) -> set[str]:
    """The serialized type names in pytree spec strings (``treespec_dumps``)."""
    names: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("type"), str):
                names.add(x["type"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for s in specs:
        walk(json.loads(s))
    return names


def allowed_imports(imports: Any, types: set[str], where: str) -> list[str]:
    """The modules of ``imports`` still to import: each must be the module of a container type
    the specs name (``types``), else a ConfinementError before anything is imported. A module
    whose types are registered already is skipped."""
    import torch.utils._pytree as pytree

    if not isinstance(imports, list):
        raise ConfinementError(f"{where}: 'imports' is {type(imports).__name__}, not a list of "
                               "module names; the package was edited: export it again")
    modules = {t.rpartition(".")[0]: t for t in types}
    todo = []
    for mod in imports:
        if not isinstance(mod, str) or not all(p.isidentifier() for p in mod.split(".")):
            raise ConfinementError(f"{where}: 'imports' names {mod!r}, not a module name; the "
                                   "package was edited: export it again")
        if mod not in modules:
            raise ConfinementError(
                f"{where}: 'imports' names {mod!r}, which defines none of the container types "
                f"the program's inputs and outputs are ({sorted(types) or 'none'}): refusing "
                "to import it (a package imports only what rebuilds its call signature)")
        if any(t.rpartition(".")[0] == mod and t not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE
               for t in types):
            todo.append(mod)
    return todo
