"""The device API: the only code a vendor writes to put regions of a graph on its accelerator.

A device is a plain object registered through the ``fxpass_devices`` plugin hook (beside
``fxpass_rules`` and ``fxpass_targets``). It says what is its own and nothing else:

- ``name`` and ``target``: ``torch.compile(m, backend=f"fxpass_{name}")``; the rule target;
- ``Options``: a frozen dataclass of its own options, checked by ``check_options``;
- ``reject(node, opts)``: why a node stays on the CPU, or None (capability);
- ``min_region_macs(opts)``: the smallest region worth a call;
- ``versions(opts)`` and ``modules``: its identity in every cache key (tool versions, and the
  source of its own modules, digested by the framework, so editing the device's code
  invalidates its entries);
- ``compile(region, ctx)``: a region graph in, an :class:`Artifact` (its executor) out;
- ``save(artifact, files)`` and ``open(entry, files)``: its artifacts in a package;
- optionally ``requires_quantization(opts)``.

Everything else (rules to fixpoint, the linear partitioner, splicing, guards and weight
variants, shape variants and buckets, plan and artifact caches, export/package/load, the
runners, the HF helpers, explain, reports and the CLI) is the framework's, and takes a device.
Why an object with methods rather than a table of callables: a vendor's device carries state
(its march table, its tool handles), and ``Device``'s defaults make the optional parts optional.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.fx import GraphModule, Node


class DeviceError(RuntimeError):
    """A device broke the device contract, or a device is not installed; the message names it."""


@dataclass(frozen=True)
class NoOptions:
    """A device with no options of its own."""


@dataclass
class Artifact:
    """One compiled region, as a device's ``compile`` returns it.

    ``executor(*tensors)`` runs the region: torch tensors in (the region's inputs, in order),
    a sequence of torch tensors out (its outputs, in order). ``data`` is what ``save`` writes
    into a package (only needed when ``ctx.keep``). ``info`` goes into the region's report
    (say, ``{"fusions": {...}}``); ``cached`` says the artifact came from the cache.
    """

    executor: Callable[..., Sequence[torch.Tensor]]
    data: Any = None
    cached: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Region:
    """What ``compile`` gets: one region, standalone.

    ``gm``: placeholders are the region's inputs (with ``meta["val"]``), ``get_attr`` buffers
    its constants and frozen weights, the output a tuple. ``name`` is unique in the process
    (``g3_r0``); ``key`` is the framework's cache key for it (graph, arguments, every weight's
    bytes, the options, the rules and the device's identity), for a device's own cache.
    """

    gm: GraphModule
    name: str
    key: str
    inputs: list[str]
    sources: dict[str, str] = field(default_factory=dict)


@dataclass
class Context:
    """The framework's side of a compile: its options and where a device may keep things.

    ``keep`` is True under ``export``: the artifact must stand alone (its ``data`` is written
    to a package). ``cache`` is the artifact cache (None when the user turned it off);
    ``threads`` the user's intra-op thread count, if any.
    """

    options: Any
    device_options: Any
    cache: Any = None
    keep: bool = False
    threads: int | None = None


class Files:
    """A package directory as a device sees it: names inside it, never outside (the framework
    confines every name a manifest carries)."""

    def __init__(self, root: Path, write: bool = False) -> None:
        self.root = root
        self.write = write

    def path(self, name: str) -> Path:
        p = (self.root / name).resolve()
        if self.root.resolve() not in p.parents:
            raise DeviceError(f"{name!r} is outside the package {self.root}")
        return p


class Device:
    """Subclass, set ``name`` and ``target``, implement ``reject``, ``compile``, ``save`` and
    ``open``; register an instance from a plugin's ``fxpass_devices()`` hook."""

    name: ClassVar[str] = ""
    target: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: packages whose source is this device's code (default: the package of its class)
    modules: ClassVar[tuple[str, ...]] = ()
    #: the minimum MACs of a region, unless ``min_region_macs`` is overridden
    min_macs: ClassVar[int] = 0

    # -- options -------------------------------------------------------------------------
    def check_options(self, raw: dict[str, Any]) -> Any:
        """Build ``Options`` from the device's keys of ``options={...}``; a wrong type raises
        ``TypeError`` naming the key. Override to check ranges and combinations."""
        fields = {f.name: f for f in dataclasses.fields(self.Options)}
        unknown = set(raw) - set(fields)
        if unknown:
            raise TypeError(f"fxpass_{self.name}: unknown option(s) {sorted(unknown)}; the "
                            f"device's are {sorted(fields)}")
        return self.Options(**raw)

    # -- capability and cost ----------------------------------------------------------------
    def reject(self, node: Node, opts: Any) -> str | None:
        """Why ``node`` stays on the CPU, or None when the device takes it."""
        raise NotImplementedError

    def capability(self, opts: Any) -> Callable[[Node], str | None]:
        """The partitioner's reject-reason callable for one partition run (override to
        cache per run)."""
        return functools.partial(self.reject, opts=opts)

    def min_region_macs(self, opts: Any) -> int:
        return self.min_macs

    # -- identity ---------------------------------------------------------------------------
    def versions(self, opts: Any) -> dict[str, str]:
        """Versions of the tools that shape an artifact (a compiler, a runtime)."""
        return {}

    def identity(self, opts: Any) -> dict[str, str]:
        """What every cache key and package carries: the device's name, its tool versions and
        a digest of its own source."""
        mods = self.modules or (type(self).__module__.split(".")[0],)
        return {"device": self.name, **self.versions(opts), "source": source_digest(*mods)}

    # -- compile, run, package --------------------------------------------------------------
    def compile(self, region: Region, ctx: Context) -> Artifact:
        raise NotImplementedError

    def save(self, region: Region, artifact: Artifact, files: Files) -> dict[str, Any]:
        """Write ``artifact.data`` under ``files`` and return the JSON entry ``open`` reads."""
        raise NotImplementedError

    def open(self, entry: dict[str, Any], files: Files) -> Callable[..., Sequence[torch.Tensor]]:
        """An executor from a saved entry (in a process that compiled nothing)."""
        raise NotImplementedError

    def requires_quantization(self, opts: Any) -> str | None:
        """The quantization config the device needs (the board's integer engine), or None."""
        return None

    def __repr__(self) -> str:
        return f"<device {self.name} (target {self.target})>"


@functools.cache
def source_digest(*packages: str) -> str:
    """A digest of every ``.py`` file of ``packages`` (found without importing them)."""
    h = hashlib.blake2b(digest_size=12)
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None:
            raise DeviceError(f"cannot find the source of {pkg!r} to key its artifacts")
        roots = list(spec.submodule_search_locations or [])
        files = (sorted(p for r in roots for p in Path(r).rglob("*.py")) if roots
                 else [Path(spec.origin)])
        for p in files:
            h.update(str(p.name).encode())
            h.update(p.read_bytes())
    return h.hexdigest()
