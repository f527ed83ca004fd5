"""The backend's options: one typed, frozen object, built and validated once.

``torch.compile(model, backend="fxpass_<device>", options={...})`` hands the backend a loose
dict; :func:`from_options` checks it (unknown keys, types, ranges, combinations that cannot
work, the ``FXPASS_*`` variables) and returns an :class:`Options`. The framework's keys are
the table below; every other key is the device's, validated by the device into its own typed
``Options`` (``Options.dev``). Everything below the entry points reads
attributes of that object: a misspelled name is an ``AttributeError`` at the line that reads it,
not a silent ``None``, and a value is validated in one place instead of where it is used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpass import device as devices
from fxpass.device import check_table, check_threads
from fxpass.plugins import get_device

#: Compiled variants a graph keeps by default, one per set of weights (least recently used
#: evicted; option ``max_variants``). Instances of one module class share Dynamo's graph
#: (parameters are graph inputs): two copies of a model alternating, or every layer of a
#: model whose layers have a graph break inside (Dynamo then compiles one graph for the
#: piece, and each layer calls it with its own weights). Each set is compiled once.
MAX_VARIANTS = 64
#: static variants one symbolic graph keeps by default (``shapes.ShapeVariants``)
MAX_SHAPE_VARIANTS = 8

_THREADS_HELP = (
    "threads for the graph's own torch (CPU) ops; default None: one when the graph has "
    "host regions and its CPU share of MACs is light (torch's OpenMP workers would "
    "otherwise spin through the regions on onnxruntime's cores), else torch's setting")
#: option -> (accepted types, what it does): the table the errors and docs are written from
OPTIONS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "min_compute_macs": ((int, type(None)), "regions below this many MACs stay on the CPU"),
    "strict": (bool, "raise instead of falling back to eager"),
    "cache_dir": ((str, Path, type(None)), "artifact cache directory"),
    "cache": (bool, "use the artifact cache (default True)"),
    "remote_cache": (
        (str, type(None)),
        "a Redis shared by a fleet under the artifact cache: redis://[user:password@]host:"
        "6379/0 or rediss:// (TLS); default None: $FXPASS_REMOTE_CACHE, else none. Needs "
        'pip install "fxpass[fleet]"',
    ),
    "enable": ((list, tuple), "extra rule names to enable"),
    "disable": ((list, tuple), "rule names to disable"),
    "only": ((list, tuple), "run exactly these rules (instead of the device target's)"),
    "check": (bool, "run rule contract checks while compiling"),
    "cpu_threads": ((int, type(None)), _THREADS_HELP),
    "max_shape_variants": (
        int,
        f"static variants one symbolic graph keeps, one per input signature (default "
        f"{MAX_SHAPE_VARIANTS}; past it a new shape runs eagerly unless called more than "
        "twice as often as the least-called kept one, which it then replaces)",
    ),
    "max_variants": (
        int,
        f"sets of weights one graph is compiled for and keeps (default {MAX_VARIANTS}): "
        "a graph shared by more instances of a module (a graph break inside each of more "
        "layers) runs eagerly",
    ),
    "freeze_weights": (
        bool,
        "bake weights into artifacts, guarded (default True); False "
        "passes them at every call: slower, but immune to writes via .data",
    ),
}
#: options that change no compiled result: left out of the plan's cache key
NOT_KEYED = ("cache_dir", "remote_cache", "max_variants", "max_shape_variants", "cpu_threads")
#: fields that are not options: set by export, and the device (keyed by its own rules)
_NOT_OPTIONS = ("exporting", "device", "dev")
#: the framework's options that shape one region's artifact (the device adds its own keyed)
REGION_KEYED = ("enable", "disable", "only")


@dataclass(frozen=True)
class Options:
    """What the user asked for, validated (:func:`from_options`); see ``OPTIONS`` per field."""

    min_compute_macs: int | None = None
    strict: bool = False
    cache_dir: str | Path | None = None
    cache: bool = True
    remote_cache: str | None = None
    enable: tuple[str, ...] | None = None
    disable: tuple[str, ...] | None = None
    only: tuple[str, ...] | None = None
    check: bool = False
    cpu_threads: int | None = None
    max_shape_variants: int = MAX_SHAPE_VARIANTS
    max_variants: int = MAX_VARIANTS
    freeze_weights: bool = True
    #: set by ``export()`` only, not a user option: every region stands alone, compiled with
    #: its artifact kept (``compile_region(keep=True)``), no cache and no tiers
    exporting: bool = False
    #: the device's name, and its own options (its typed ``Options``)
    device: str = ""
    dev: Any = None

    def __getattr__(self, name: str) -> Any:
        """A device option read through the framework's object (``opts.march`` on the BPU):
        the device's typed options answer, and a name neither has is an AttributeError."""
        dev = self.__dict__.get("dev")
        if dev is not None and not name.startswith("_") and hasattr(dev, name):
            return getattr(dev, name)
        raise AttributeError(f"fxpass option {name!r} is neither the framework's nor device "
                             f"{self.__dict__.get('device')!r}'s")

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes``; a device option's name changes the device's options."""
        dev_names = {f.name for f in dataclasses.fields(self.dev)} if self.dev else set()
        mine = {k: v for k, v in changes.items() if k not in dev_names}
        theirs = {k: v for k, v in changes.items() if k in dev_names}
        if theirs:
            mine["dev"] = dataclasses.replace(self.dev, **theirs)
        return dataclasses.replace(self, **mine)

    def get_device(self) -> Any:
        return get_device(self.device)

    def keyed(self) -> dict[str, Any]:
        """The user's options that change the compiled result, as JSON (the plan's cache key;
        ``exporting`` turns the cache off, so no key is made under it)."""
        own = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in NOT_KEYED and f.name not in _NOT_OPTIONS}
        return {**own, "device": self.device, **self.get_device().keyed(self.dev)}

    def region_keyed(self) -> dict[str, Any]:
        """The options that shape one region's artifact (part of its cache key)."""
        own = {k: _plain(getattr(self, k)) for k in REGION_KEYED}
        return {**own, "device": self.device, **self.get_device().keyed(self.dev)}


def _plain(v: Any) -> Any:
    """JSON's view of a value: tuples as lists, paths as strings."""
    if isinstance(v, tuple):
        return list(v)
    return str(v) if isinstance(v, Path) else v


def from_options(options: dict[str, Any] | Options | None,
                 device: str | devices.Device | None = None) -> Options:
    """Validate ``options`` (the dict ``torch.compile`` passes) into an :class:`Options`.

    The framework's keys are checked here, the rest by ``device`` (its ``check_options``).
    A bad value is a ``TypeError`` (``ValueError`` for a device's unknown target name)
    naming the option, what it does and what it takes, raised here, once, rather than per
    graph or per region."""
    if isinstance(options, Options):
        return options
    opts = dict(options or {})
    if device is None:
        device = opts.pop("device", None)
    if device is None:
        raise TypeError("fxpass options need a device: torch.compile(..., "
                        "backend='fxpass_<device>'), or device= to export and the helpers")
    dev = get_device(device)
    who = f"fxpass_{dev.name}"
    theirs = {k: opts.pop(k) for k in list(opts) if k not in OPTIONS and k in dev.option_names()}
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        table = {**dev.describe_options(), **{k: d for k, (_, d) in OPTIONS.items()}}
        valid = "; ".join(f"{k}: {d}" for k, d in table.items())
        raise TypeError(f"{who} got unknown option(s) {unknown}. Valid options: {valid}")
    check_table(OPTIONS, opts, who)
    check_threads(opts.get("cpu_threads"), "cpu_threads", who, "fxpass")
    if opts.get("min_compute_macs") is not None and opts["min_compute_macs"] < 0:
        raise TypeError(f"{who} option 'min_compute_macs' must be >= 0")
    for key in ("max_shape_variants", "max_variants"):
        if opts.get(key, 1) < 1:
            raise TypeError(f"{who} option {key!r} must be >= 1, got {opts[key]}")
    for key in ("enable", "disable", "only"):
        if opts.get(key) is not None:
            opts[key] = tuple(opts[key])
    dev_opts = dev.check_options(theirs)
    if opts.get("cache", True):  # a bad cache_dir, FXPASS_CACHE_MAX_BYTES or remote fails here
        from fxpass.jit.cache import ArtifactCache

        # (a remote cache without the redis client is one ImportError naming the extra)
        ArtifactCache(opts.get("cache_dir"), remote=opts.get("remote_cache"))
    from fxpass import env

    # FXPASS_CHECK=1 asks for the checks as check=True does (read, and validated, here: the
    # backend passed check=False explicitly, so the variable did nothing; found by a probe)
    opts.setdefault("check", env.get("FXPASS_CHECK"))
    # every FXPASS_* variable, here: a bad one is bad configuration, an error naming it (a bad
    # FXPASS_REWRITE_LIMIT sent each graph to eager with a "please report it"; found by a probe)
    env.validate_all()
    why = dev.needs_frozen_weights(dev_opts)
    if why and not opts.get("freeze_weights", True):
        raise TypeError(f"{who}: {why}")
    from fxpass.plugins import select_rules

    select_rules(target=dev.target, enable=opts.get("enable"), disable=opts.get("disable"),
                 only=opts.get("only"))  # an unknown rule name fails here
    return Options(**opts, device=dev.name, dev=dev_opts)
