"""The device API: the only code a vendor writes to put regions of a graph on its accelerator.

A device is an object registered through the ``fxpass_devices`` plugin hook (beside
``fxpass_rules`` and ``fxpass_targets``). It says what is its own and nothing else:

- ``name`` and ``target``: ``torch.compile(m, backend=f"fxpass_{name}")``; its rule target;
- ``Options``: a frozen dataclass of its own options (``check_options`` validates them);
  the framework's options (cache, strict, shape variants, rule selection...) stay the
  framework's;
- ``reject(node, opts)``: why a node stays on the CPU, or None (capability);
- ``min_region_macs(opts)``: the smallest region worth a call;
- ``versions(opts)`` and ``modules``: its identity in every cache key and package (tool
  versions, and a digest of its own source, so editing the device's code invalidates its
  cache entries even when it lives in a distribution of its own);
- ``compile(region, ctx)``: a region graph in, an :class:`Artifact` (its executor) out;
- ``save(region, artifact, files)`` and ``open(entry, files)``: its artifacts in a package;
- optionally ``requires_quantization(opts)``, ``reopen`` (plan-cache hits), ``settle``.

Everything else (rules to fixpoint, the linear partitioner, splicing, guards and weight
variants, shape variants and buckets, plan and artifact caches, export/package/load, the
runners, the HF helpers, explain, reports and the CLI) is the framework's and takes a device.
Why an object with methods rather than a table of callables: a device carries state (a march
table, tool handles), and the base class's defaults make the optional parts optional.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.fx import GraphModule, Node


class DeviceError(RuntimeError):
    """A device broke the device contract, or is not installed; the message names it."""


class CallDeclined(RuntimeError):
    """Raised by an executor that cannot answer *this* call exactly (a check on the inputs'
    values failed: a fused kernel's preconditions), before it changed anything. Under
    ``torch.compile`` the region answers that call eagerly and tries its executor again on the
    next one; any other executor error makes the region eager for good. A package, which has
    no eager copy, raises it with the reason."""


@dataclass(frozen=True)
class NoOptions:
    """A device with no options of its own."""


@dataclass
class Artifact:
    """One compiled region.

    ``executor(*tensors)`` runs it: torch CPU tensors in (the region's inputs, in order), a
    sequence of torch tensors out (its outputs, in order). ``key`` is the region's cache key
    (``Region.key``, or the device's own refinement of it). ``data`` is what ``save`` writes
    into a package: a device must set it when ``ctx.keep`` (export). ``size`` is the
    artifact's size in bytes (reports), ``fusions`` what its compiler fused (reports).
    """

    executor: Callable[..., Sequence[torch.Tensor]]
    key: str = ""
    cached: bool = False
    size: int = 0
    fusions: dict[str, int] = field(default_factory=dict)
    data: Any = None


@dataclass
class Region:
    """What ``compile`` gets: one region, standalone.

    ``gm``'s placeholders are the region's inputs (with ``meta["val"]``), its ``get_attr``
    buffers the constants and frozen weights, its output a tuple. ``name`` is unique in the
    process (``g3_r0``). ``key`` is the framework's cache key: the graph with every node's
    arguments, every weight's bytes, the options, the rules and the device's identity.
    ``sources`` maps a weight buffer to the model weight it holds (a device that reads
    weights in place uses it). In ``reopen`` (a plan hit) ``gm`` is None; ``rebuild()``, when
    given, makes it again (the rules and partition run once more), for a device whose cached
    artifact lacks a part it must remake from the graph (weights a remote cache keeps none of).
    """

    gm: GraphModule
    name: str
    key: str
    input_names: list[str]
    sources: dict[str, str] = field(default_factory=dict)
    rebuild: Callable[[], GraphModule] | None = None


@dataclass
class Context:
    """The framework's side of one compile.

    ``options``: the framework's options; ``device_options``: the device's own (its
    ``Options``). ``cache``: the artifact cache (``get``/``put``/``get_path`` by key and
    suffix), None when the user turned it off. ``keep``: under ``export``: the artifact must
    stand alone, with ``data`` for ``save``, and use no cache.
    """

    options: Any
    device_options: Any
    cache: Any = None
    keep: bool = False


class Files:
    """A package directory as a device sees it: ``path(name)`` resolves a name inside it and
    refuses one leading out (absolute, ``..``, a symlink out), by the same check ``load``
    holds every manifest name to (``fxpass.aot.confine.member``)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        from fxpass.aot.confine import member

        return member(self.root, name, "a device's file")


class Device:
    """Subclass, set ``name`` and ``target``, implement ``reject``, ``compile``, ``save`` and
    ``open``; return an instance from a plugin's ``fxpass_devices()`` hook."""

    name: ClassVar[str] = ""
    target: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    #: option -> (accepted types, what it does): the errors and ``fxpass explain`` read it
    OPTIONS: ClassVar[dict[str, tuple[Any, str]]] = {}
    #: option fields that change no artifact: left out of cache keys
    unkeyed: ClassVar[tuple[str, ...]] = ()
    #: packages whose source is this device's code (default: its class's top-level package)
    modules: ClassVar[tuple[str, ...]] = ()
    #: regions below this many MACs stay on the CPU, unless ``min_region_macs`` says otherwise
    min_macs: ClassVar[int] = 0
    #: the device's executors run on this machine's CPU cores (onnxruntime, OpenVINO CPU):
    #: its artifacts are keyed by the host CPU, and torch's own ops yield the cores to it
    host: ClassVar[bool] = False
    #: the distribution and entry point that registered it (set by ``fxpass.load()``)
    plugin: str = "<unregistered>"

    # -- options ------------------------------------------------------------------------
    def check_options(self, raw: dict[str, Any]) -> Any:
        """``Options`` from the device's keys of ``options={...}``: each value checked against
        ``OPTIONS`` (or, without a row, the type of the field's default). Override to check
        ranges and combinations, then call this."""
        fields = {f.name: f for f in dataclasses.fields(self.Options)}
        table = {k: self.OPTIONS.get(k) or (type(fields[k].default), k) for k in raw}
        check_table(table, raw, f"fxpass_{self.name}")
        return self.Options(**raw)

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.Options)]

    def describe_options(self) -> dict[str, str]:
        """Option -> what it does, in ``OPTIONS``'s order (the errors list them so)."""
        names = self.option_names()
        return {k: d for k, (_, d) in self.OPTIONS.items() if k in names} | {
            k: "" for k in names if k not in self.OPTIONS}

    def needs_frozen_weights(self, opts: Any) -> str | None:
        """Why these options cannot take ``freeze_weights=False`` (weights quantized when a
        region is built), or None."""
        return None

    def keyed(self, opts: Any) -> dict[str, Any]:
        """The device options that shape an artifact, as JSON (part of every cache key)."""
        out = {}
        for f in dataclasses.fields(opts):
            if f.name not in self.unkeyed:
                v = getattr(opts, f.name)
                out[f.name] = list(v) if isinstance(v, tuple) else (
                    str(v) if isinstance(v, Path) else v)
        return out

    # -- capability and cost --------------------------------------------------------------
    def reject(self, node: Node, opts: Any) -> str | None:
        """Why ``node`` stays on the CPU, or None when the device takes it."""
        raise NotImplementedError(f"device {self.name} implements no reject()")

    def capability(self, opts: Any) -> Callable[[Node], str | None]:
        """The reject-reason callable for one partition run (override to cache per run)."""
        return functools.partial(self.reject, opts=opts)

    def min_region_macs(self, opts: Any) -> int:
        return self.min_macs

    def label(self, opts: Any) -> str:
        """What reports show as a region's executor."""
        return self.name

    def runs_on_host(self, opts: Any) -> bool:
        return self.host

    # -- identity -----------------------------------------------------------------------
    def versions(self, opts: Any) -> dict[str, str]:
        """Versions of the tools that shape an artifact (a compiler, a runtime)."""
        return {}

    def source_modules(self) -> tuple[str, ...]:
        return self.modules or (type(self).__module__.split(".")[0],)

    def identity(self, opts: Any) -> dict[str, str]:
        """What every cache key and package carries: name, tool versions, source digest."""
        from fxpass.jit.digest import source_digest

        return {"device": self.name, **self.versions(opts),
                "source": source_digest(*self.source_modules())}

    # -- compile, run, package ------------------------------------------------------------
    def compile(self, region: Region, ctx: Context) -> Artifact:
        raise NotImplementedError(f"device {self.name} implements no compile()")

    def reopen(self, region: Region, weights: dict[str, torch.Tensor],
               ctx: Context) -> Artifact | None:
        """A compiled region from the artifact cache by ``region.key`` (a plan-cache hit,
        where the graph was not rebuilt), or None to compile it. Default: None."""
        return None

    def plans(self, opts: Any) -> bool:
        """Whether a warm process may skip rules, partition and compile for these options:
        the device's ``reopen`` finds every region of a stored plan by its key. Default:
        when ``reopen`` is overridden."""
        return type(self).reopen is not Device.reopen

    def save(self, region: Region, artifact: Artifact, files: Files,
             weights: Any) -> dict[str, Any]:
        """Write ``artifact.data`` under ``files``; return the JSON entry ``open`` reads.
        ``weights`` is the package's shared weights file (``add(array, kind)`` returns its
        ``(offset, length)``), for a device whose artifacts read weights from it."""
        raise NotImplementedError(f"device {self.name} cannot save artifacts")

    def open(self, entry: dict[str, Any], files: Files) -> Callable[..., Sequence[torch.Tensor]]:
        """An executor from a saved entry, in a process that compiled nothing."""
        raise NotImplementedError(f"device {self.name} cannot open artifacts")

    def can_open(self, entry: dict[str, Any]) -> str | None:
        """Why this process cannot run a saved entry (a runtime missing), or None."""
        return None

    def calibration(self) -> Any:
        """The device's calibration, for quantized regions ahead of time: an object with
        ``check_batches(batches)``, ``recording()`` (a context manager whose session's
        ``samples`` maps each region executor that ran to its inputs) and ``finish(session,
        strict=)``. A device that does not quantize keeps this default."""
        raise DeviceError(f"device {self.name} does not quantize: drop the quantize option")

    def requires_quantization(self, opts: Any) -> str | None:
        """The quantization config the device needs (an integer engine), or None."""
        return None

    def calibrates(self, opts: Any) -> bool:
        """Whether regions compiled with ``opts`` need calibration data before they can be
        saved (``export(..., calibration=)``): by default, a ``quantize`` option that is set,
        or a required quantization. A device whose quantization needs no data (weight-only)
        says False for it."""
        return (getattr(opts, "quantize", None) not in (None, False)
                or self.requires_quantization(opts) is not None)

    def prepare(self, opts: Any) -> None:
        """Called once per ``torch.compile`` graph before tracing: raise if the device's
        compiler is missing (naming how to install it); start loading a runtime."""

    def settle(self) -> None:
        """Wait for the device's background work (second-tier builds), if it has any."""

    def __repr__(self) -> str:
        return f"<fxpass device {self.name!r} (target {self.target!r}, {self.plugin})>"


def check_device(d: Any) -> Device:
    """A registered device keeps the contract's static parts; the error names what broke."""
    if not isinstance(d, Device):
        raise TypeError(f"fxpass_devices() returned {d!r:.80}; want fxpass.device.Device")
    who = f"device {type(d).__name__}"
    for attr in ("name", "target"):
        if not isinstance(getattr(d, attr), str) or not getattr(d, attr):
            raise DeviceError(f"{who}: {attr} must be a non-empty string")
    if not dataclasses.is_dataclass(d.Options):
        raise DeviceError(f"device {d.name}: Options must be a dataclass")
    if type(d).compile is Device.compile:
        raise DeviceError(f"device {d.name}: implements no compile()")
    if type(d).reject is Device.reject and type(d).capability is Device.capability:
        raise DeviceError(f"device {d.name}: implements neither reject() nor capability()")
    return d


#: how an option's error message names the types it takes
_TYPE_NAMES = {bool: "a bool", str: "a string", Path: "a path", type(None): "None",
               int: "an int", list: "a list", tuple: "a list", dict: "a dict"}


def check_table(table: dict[str, tuple[Any, str]], opts: dict[str, Any], who: str) -> None:
    """Each value of ``opts`` against ``table``'s types; the error names the option, what it
    does and what it takes (a device checks its own options with this too)."""
    for k, v in opts.items():
        types, desc = table[k]
        allowed = types if isinstance(types, tuple) else (types,)
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in allowed):
            names = " or ".join(dict.fromkeys(_TYPE_NAMES.get(t, t.__name__) for t in allowed))
            hint = (f"; for one rule write [{v!r}]"
                    if isinstance(v, str) and list in allowed else "")
            raise TypeError(f"{who} option {k!r} ({desc}) must be {names}; got "
                            f"{type(v).__name__} {v!r}{hint}")


def check_threads(value: int | None, key: str, who: str, chooser: str) -> None:
    if value is not None and not 1 <= value <= (os.cpu_count() or 1):
        raise TypeError(
            f"{who} option {key!r} must be between 1 and this machine's "
            f"{os.cpu_count()} CPUs, got {value}; leave it unset to let {chooser} choose")


