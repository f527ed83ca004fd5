"""The backend's options: one typed, frozen object, built and validated once.

``torch.compile(model, backend="fxpass_bpu", options={...})`` hands the backend a loose dict;
:func:`from_options` checks it (unknown keys, types, ranges, combinations that cannot work, the
``FXPASS_*`` variables) and returns an :class:`Options`. Everything below the entry points reads
attributes of that object: a misspelled name is an ``AttributeError`` at the line that reads it,
not a silent ``None``, and a value is validated in one place instead of where it is used.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxpass.backends.bpu.capability import DEFAULT_MARCH, MARCHES, march

#: executors: ``auto`` is the board when hbdk4 and its runtime import, else the host
EXECUTORS = ("auto", "hbdnn", "onnxruntime")
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
    "march": (str, f"target march, one of {sorted(MARCHES)} (default {DEFAULT_MARCH})"),
    "executor": (str, f"one of {EXECUTORS} (default auto)"),
    "min_compute_macs": ((int, type(None)), "regions below this many MACs stay on the CPU"),
    "strict": (bool, "raise instead of falling back to eager"),
    "cache_dir": ((str, Path, type(None)), "artifact cache directory"),
    "cache": (bool, "use the artifact cache (default True)"),
    "enable": ((list, tuple), "extra rule names to enable"),
    "disable": ((list, tuple), "rule names to disable"),
    "only": ((list, tuple), "run exactly these rules (instead of the bpu target's)"),
    "check": (bool, "run rule contract checks while compiling"),
    "threads": ((int, type(None)), "onnxruntime intra-op threads"),
    "cpu_threads": ((int, type(None)), _THREADS_HELP),
    "host_fusions": (bool, "onnxscript's onnxruntime fusions on host regions (default True)"),
    "tiered": (
        bool,
        "host regions that prepack large weights run an in-place-weights session until the "
        "prepacked one is built in the background (default True); False builds it first",
    ),
    "prepack_one_row": (
        bool,
        "host regions that multiply one row per GEMM (a decode step, a 1-token forward) "
        "prepack their weights too (default True: ~1.2x faster, a packed copy of the weights "
        "per region); False reads them in place and holds no copy",
    ),
    "quantize": (
        (str, dict, bool, type(None)),
        "quantize regions: 'w8a16' (int8 per-channel weights, int16 activations), 'w8a8', "
        "True (w8a16) or {'config', 'method', 'percentile'}; calibrate with "
        "fxpass.backends.bpu.calibrate(fn, batches) (default None on the host; the board "
        "always quantizes)",
    ),
    "max_shape_variants": (
        int,
        f"static variants one symbolic graph keeps, one per input signature (default "
        f"{MAX_SHAPE_VARIANTS}; least recently used evicted with its sessions; a new shape past "
        "it still compiles)",
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
#: how an option's error message names the types it takes
_TYPE_NAMES = {bool: "a bool", str: "a string", Path: "a path", type(None): "None",
               int: "an int", list: "a list", tuple: "a list", dict: "a dict"}
#: options that change no compiled result: left out of the plan's cache key
NOT_KEYED = ("cache_dir", "tiered", "max_variants", "max_shape_variants", "cpu_threads")
#: options that shape one region's artifact: its cache key
REGION_KEYED = ("enable", "disable", "only", "host_fusions", "quantize", "prepack_one_row")


@dataclass(frozen=True)
class Options:
    """What the user asked for, validated (:func:`from_options`); see ``OPTIONS`` per field."""

    march: str = DEFAULT_MARCH
    executor: str = "auto"
    min_compute_macs: int | None = None
    strict: bool = False
    cache_dir: str | Path | None = None
    cache: bool = True
    enable: tuple[str, ...] | None = None
    disable: tuple[str, ...] | None = None
    only: tuple[str, ...] | None = None
    check: bool = False
    threads: int | None = None
    cpu_threads: int | None = None
    host_fusions: bool = True
    tiered: bool = True
    prepack_one_row: bool = True
    quantize: str | dict | bool | None = None
    max_shape_variants: int = MAX_SHAPE_VARIANTS
    max_variants: int = MAX_VARIANTS
    freeze_weights: bool = True
    #: set by ``export()`` only, not a user option: every region stands alone, compiled with
    #: its artifact kept (``compile_region(keep=True)``), no cache and no tiers
    exporting: bool = False

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)

    def keyed(self) -> dict[str, Any]:
        """The user's options that change the compiled result, as JSON (the plan's cache key;
        ``exporting`` turns the cache off, so no key is made under it)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in NOT_KEYED and f.name != "exporting"}

    def region_keyed(self) -> dict[str, Any]:
        """The options that shape one region's artifact (part of its cache key)."""
        return {k: _plain(getattr(self, k)) for k in REGION_KEYED}


def _plain(v: Any) -> Any:
    """JSON's view of a value: tuples as lists, paths as strings."""
    if isinstance(v, tuple):
        return list(v)
    return str(v) if isinstance(v, Path) else v


def from_options(options: dict[str, Any] | Options | None) -> Options:
    """Validate ``options`` (the dict ``torch.compile`` passes) into an :class:`Options`.

    A bad value is a ``TypeError`` (``ValueError`` for an unknown march) naming the option,
    what it does and what it takes, raised here, once, rather than per graph or per region."""
    if isinstance(options, Options):
        return options
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{k}: {d}" for k, (_, d) in OPTIONS.items())
        raise TypeError(f"fxpass_bpu got unknown option(s) {unknown}. Valid options: {valid}")
    for k, v in opts.items():
        types, desc = OPTIONS[k]
        allowed = types if isinstance(types, tuple) else (types,)
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in allowed):
            names = " or ".join(dict.fromkeys(_TYPE_NAMES.get(t, t.__name__) for t in allowed))
            hint = (f"; for one rule write [{v!r}]"
                    if isinstance(v, str) and list in allowed else "")
            raise TypeError(f"fxpass_bpu option {k!r} ({desc}) must be {names}; got "
                            f"{type(v).__name__} {v!r}{hint}")
    march(opts.get("march", DEFAULT_MARCH))  # ValueError naming the known marches
    ex = opts.get("executor", "auto")
    if ex not in EXECUTORS:
        raise TypeError(f"fxpass_bpu option 'executor' must be one of {EXECUTORS}, got {ex!r}")
    for key, chooser in (("threads", "onnxruntime"), ("cpu_threads", "fxpass")):
        th = opts.get(key)
        if th is not None and not 1 <= th <= (os.cpu_count() or 1):
            raise TypeError(
                f"fxpass_bpu option {key!r} must be between 1 and this machine's "
                f"{os.cpu_count()} CPUs, got {th}; leave it unset to let {chooser} choose"
            )
    if opts.get("min_compute_macs") is not None and opts["min_compute_macs"] < 0:
        raise TypeError("fxpass_bpu option 'min_compute_macs' must be >= 0")
    for key in ("max_shape_variants", "max_variants"):
        if opts.get(key, 1) < 1:
            raise TypeError(f"fxpass_bpu option {key!r} must be >= 1, got {opts[key]}")
    for key in ("enable", "disable", "only"):
        if opts.get(key) is not None:
            opts[key] = tuple(opts[key])
    if opts.get("cache", True):  # a bad cache_dir or FXPASS_CACHE_MAX_BYTES fails here
        from fxpass.jit.cache import ArtifactCache

        ArtifactCache(opts.get("cache_dir"))
    from fxpass import env

    # FXPASS_CHECK=1 asks for the checks as check=True does (read, and validated, here: the
    # backend passed check=False explicitly, so the variable did nothing; found by a probe)
    opts.setdefault("check", env.get("FXPASS_CHECK"))
    # every FXPASS_* variable, here: a bad one is bad configuration, an error naming it (a bad
    # FXPASS_REWRITE_LIMIT sent each graph to eager with a "please report it"; found by a probe)
    env.validate_all()
    from fxpass.backends.onnx.quantize import QuantizationError, resolve_config

    try:  # a bad quantize value fails here, not per region
        config = resolve_config(opts.get("quantize"))
    except QuantizationError as e:
        raise TypeError(f"fxpass_bpu option 'quantize': {e}") from None
    board = opts.get("executor") == "hbdnn"  # the board path always quantizes
    if (config is not None or board) and not opts.get("freeze_weights", True):
        # weights that are inputs would be calibrated as activations, once: after an update
        # the region kept the old ranges (found by a probe: cosine 0.89, no warning)
        raise TypeError(
            "fxpass_bpu quantization (option 'quantize', or executor='hbdnn', which always "
            "quantizes) needs freeze_weights=True: weights are quantized per "
            "channel when the region is built, and guarded; with freeze_weights=False they "
            "would be graph inputs quantized with calibrated activation ranges that a weight "
            "update silently outdates. Drop freeze_weights=False, or quantize=None")
    from fxpass.plugins import select_rules

    select_rules(target="bpu", enable=opts.get("enable"), disable=opts.get("disable"),
                 only=opts.get("only"))  # an unknown rule name fails here
    return Options(**opts)
