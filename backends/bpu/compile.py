"""Compile one region: lower to ONNX, then hbdk4 -> ``.hbm`` (board) or an onnxruntime session.

hbdk4 flow (documented Python API; x86-64 wheels from Horizon's OpenExplorer, not installable
here, tested against a contract fake): ``hbdk4.compiler.onnx.export(proto)`` ->
``hbdk4.compiler.convert(module, march)`` -> ``hbdk4.compiler.compile(module, path, march,
opt=2)``. Executor choice: ``auto`` = the board (hbdnn) when both hbdk4 and the board runtime
import, else the host (onnxruntime); ``hbdnn`` and ``onnxruntime`` force one.

Quantization (issue 11, docs/quantization.md) is opt-in on the host and required on the
board: the tensor engine takes integer inputs only, and ``convert`` puts a float MAC op on the
board's CPU. A quantized region starts as the float lowering on the host (a
``QuantizingExecutor``); ``calibrate()`` records its inputs, and only the calibrated QDQ model
reaches hbdk4 ``export -> convert -> compile`` (or the host session). Its cache key adds the
config and the calibration ranges' digest to the float region's key.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import tempfile
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch

from fxpass.backends.bpu.cache import (
    BUILD_PREFIX,
    ArtifactCache,
    Checksum,
    file_checksum,
    region_key,
)
from fxpass.backends.bpu.device import quantize as Q
from fxpass.backends.bpu.device.calibration import QuantInfo, QuantizingExecutor
from fxpass.backends.bpu.device.lowering import (
    lower,
    lower_weightless,
    point_external,
    write_weights,
    write_weights_file,
)
from fxpass.backends.bpu.device.lowering.driver import Weights
from fxpass.backends.bpu.device.region import RegionGraph
from fxpass.backends.bpu.digest import fresh_digest, tensor_digest
from fxpass.backends.bpu.host.prepare import (
    MIN_SHARED_BYTES,
    cast_weight,
    casts_in_place,
    declared_weights,
    fuse_for_ort,
    in_place_initializers,
    in_place_model,
    prepack_helps,
    readable_in_place,
    saves_prepacked,
    shared_weights,
    tier_pays,
)
from fxpass.backends.bpu.runtime import HbmExecutor, OrtExecutor, TieredExecutor

EXECUTORS = ("auto", "hbdnn", "onnxruntime")
#: dtypes a cached entry may ask a weight to be cast to (``host.cast_weight``)
_CAST_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.float64)}
#: the cache entry's file of the optimized host model's weights (external data beside it)
WEIGHTS_SUFFIX = ".host.bin"
#: a tiered entry's first-tier model (weights fed in place; ``host.in_place_model``)
FAST_SUFFIX = ".fast.onnx"
HBDK4_HELP = (
    "executor='hbdnn' needs hbdk4 to compile: install the hbdk4-compiler wheel from Horizon's "
    "OpenExplorer toolchain (x86-64 Linux), and run on an RDK board image that ships the "
    "`hbm_runtime` Python module; or use executor='onnxruntime' to run on the host"
)


def has_hbdk4() -> bool:
    return importlib.util.find_spec("hbdk4") is not None and _find("hbdk4.compiler")


def has_board() -> bool:
    return importlib.util.find_spec("hbm_runtime") is not None


def _find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def resolve_executor(executor: str) -> str:
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "auto":
        return "hbdnn" if has_hbdk4() and has_board() else "onnxruntime"
    if executor == "hbdnn" and not has_hbdk4():
        raise RuntimeError(HBDK4_HELP)
    return executor


@dataclass
class Compiled:
    executor: Any
    key: str
    cached: bool
    onnx_bytes: int
    fusions: dict[str, int] = field(default_factory=dict)  # host fusions that fired
    #: with ``keep=True`` (``export``): the weightless model the executor runs and its
    #: weights, which a package writes to disk as ONNX plus external data
    artifact: tuple[onnx.ModelProto, Weights] | None = None


def compile_region(
    rg: RegionGraph,
    name: str,
    *,
    march: str,
    executor: str,
    cache: ArtifactCache | None,
    options: dict[str, Any],
    threads: int | None = None,
    tiered: bool = True,
    keep: bool = False,
) -> Compiled:
    """``tiered``: a host region that prepacks starts on an in-place-weights session while the
    prepacked one builds in the background (``runtime.TieredExecutor``). ``keep``: for
    ``export``; the region must stand alone (no weight read from the caller's tensors, no
    cache, no second tier) and ``Compiled.artifact`` keeps what the package writes."""
    kind = resolve_executor(executor)
    key = region_key(rg.gm, march=march, executor=kind, options=options)
    input_names = [p.name for p in rg.gm.graph.find_nodes(op="placeholder")]
    cfg = Q.resolve_config(options.get("quantize"))
    if cfg is None and kind == "hbdnn":  # the board needs integer MAC inputs (FACTS.md)
        cfg = Q.CONFIGS[Q.DEFAULT_CONFIG]
    if cfg is not None:
        if keep:
            raise NotImplementedError(
                f"region {name}: export() of quantized regions (option 'quantize', or the "
                "board's executor='hbdnn', which always quantizes) is not supported yet; "
                "export with quantize=None and executor='onnxruntime'")
        return _compile_quantizing(rg, name, key, input_names, march, kind, cfg, cache, threads)
    fuse = options.get("host_fusions", True)
    rows = 1 if options.get("prepack_one_row") is False else None  # 1: one row reads in place
    if keep:
        proto, weights = lower_weightless(rg.gm, name=name, gemm=True)
        return _build_ort(rg, key, input_names, None, threads, proto, weights, {},
                          None if fuse else {}, rows=rows, keep=True)
    return _compile_ort(rg, name, key, input_names, cache, threads, fuse, tiered, rows)


def _compile_ort(
    rg: RegionGraph,
    name: str,
    key: str,
    input_names: list[str],
    cache: ArtifactCache | None,
    threads: int | None = None,
    fuse: bool = True,
    tiered: bool = True,
    rows: int | None = None,
) -> Compiled:
    """The host executor: the region's model reads the model's own weights in place.

    Linear weights lower as ``Gemm(transB=1)`` over the weight itself. Where the region does
    not prepack (``rows``: 1 for one row per GEMM with ``prepack_one_row=False``, or BF16
    casts at one row; default ``host.PREPACK_MAX_ROWS``), every frozen weight is a graph input
    fed from the caller's tensor (``host.shared_weights``), so neither the model, nor the
    cache, nor onnxruntime holds a copy of it; only weight views (a bf16 weight cast to
    float32) are written. The cache keeps onnxruntime's optimized model (``.host.onnx``, a
    few kilobytes), the weights it bakes in as external data beside it (``.host.bin``: the
    written weights, and every GEMM weight prepacked where it prepacks), and which frozen
    weight each shared input is (``.host.json``).

    Where onnxruntime would save no prepacked weights (none prepacked, or ``host.saves_prepacked``
    says no), its optimized model buys a later process only the graph optimizer (a scratch load
    of the Qwen3 4 x 1024 entry: 0.31 s with it on or off) and costs this one a second write of
    every weight and a second session. The entry then keeps the lowering's own model and weights
    (``"optimized": false``; each process optimizes at load), and the one session opened on them
    keeps running: moving the files into the cache keeps what it maps.

    A region that prepacks large weights is tiered (``tiered``, ``host.in_place_model``): this
    returns as soon as an in-place-weights session is open, and everything above (the weights
    file, the prepacked session, the entry) is built in the background. The entry then also
    keeps that first tier's model (``.fast.onnx``, kilobytes), so a hit opens it at once too."""
    buffers = {c: getattr(rg.gm, c) for c in rg.sources}  # the frozen weights it holds
    if cache is not None:
        hit = _cached_ort(cache, key, input_names, threads, buffers, tiered)
        if hit is not None:
            return hit
    # the fusions rewrite a model without weight data (kilobytes); the weights go in once, last
    proto, weights = lower_weightless(rg.gm, name=name, gemm=True)
    if rows is None and casts_in_place(weights, buffers):
        # BF16 weights at one row keep reading a float32 cast made once (host.cast_weight):
        # a first tier would cast them on every call, 10x slower (docs/benchmarks.md)
        rows = 1
    if tiered and prepack_helps(proto, rows) and tier_pays(weights, buffers):
        fusions: dict[str, int] = {}
        if fuse:
            proto, fusions, weights = _fused(proto, weights)
        first = in_place_model(proto, weights, buffers) if prepack_helps(proto, rows) else None
        if first is not None:
            data, shared, attrs = first
            fast = OrtExecutor(data, input_names, threads=threads, shared=shared, prepack=False,
                               arena=False)
            fast_meta = {n: attrs[n] for n in shared}  # input -> region attribute
            keyed = {c: tensor_digest(t) for c, t in buffers.items()}  # memoized by the key

            def unchanged() -> None:
                """The first call has returned, so the caller may have written a weight
                meanwhile (through .data, which no version counter sees): then the files
                hold values the key does not name. Checked before the entry is published."""
                changed = [c for c, t in buffers.items() if fresh_digest(t) != keyed[c]]
                if changed:
                    raise RuntimeError(
                        f"weight {rg.sources[changed[0]]!r} changed while the prepacked "
                        "session was built; its entry is discarded")

            def second() -> Any:
                return _build_ort(rg, key, input_names, cache, threads, proto, weights,
                                  buffers, fusions, (data, fast_meta), unchanged, rows).executor

            size = len(data) + sum(t.numel() * t.element_size() for t in shared.values())
            return Compiled(TieredExecutor(fast, second, name), key, False, size, fusions)
        return _build_ort(rg, key, input_names, cache, threads, proto, weights, buffers, fusions,
                          rows=rows)
    return _build_ort(rg, key, input_names, cache, threads, proto, weights, buffers,
                      None if fuse else {}, rows=rows)


def _fused(
    proto: onnx.ModelProto, weights: Weights
) -> tuple[onnx.ModelProto, dict[str, int], Weights]:
    """The host fusions, and the weights the fused model still declares (a fusion may drop
    one, ``host.declared_weights``)."""
    proto, fusions = fuse_for_ort(proto, weights)
    return proto, fusions, declared_weights(proto, weights)


def _build_ort(
    rg: RegionGraph, key: str, input_names: list[str], cache: ArtifactCache | None,
    threads: int | None, proto: onnx.ModelProto, weights: Weights,
    buffers: dict[str, torch.Tensor], fusions: dict[str, int] | None,
    fast: tuple[bytes, dict[str, str]] | None = None,
    check: Any = None,
    rows: int | None = None,
    keep: bool = False,
) -> Compiled:
    """``_compile_ort`` from the lowered model: ``fusions`` None runs them here (beside the
    weights write), else they ran already. ``fast``: a tiered region's first-tier model and
    its shared inputs' weights, stored with the entry. ``keep``: ``buffers`` is empty (every
    weight written), and ``Compiled.artifact`` keeps the weightless model and its weights."""
    fuse = fusions is None
    fusions = dict(fusions or {})
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(_build_dir(cache)) if cache is not None else None
        # A region onnxruntime prepacks feeds no weight in place: all of them are written, to a
        # file that depends on the weights alone. It is written while the fusions rewrite the
        # weightless model (the one is I/O, the other Python: they overlap on two cores).
        early = None  # (the write, the checksum it feeds)
        # (Only while fusions run: a tiered region's build runs on the tier thread, possibly
        # during interpreter exit, when no new thread pool may start.)
        if tmp is not None and fuse and prepack_helps(proto, rows):
            pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="fxpass-weights"))
            checksum = Checksum()
            early = (pool.submit(write_weights_file, weights, os.path.join(tmp, "weights.bin"),
                                 checksum.update), checksum)
        if fuse:
            proto, fusions, weights = _fused(proto, weights)
        prepack = prepack_helps(proto, rows)
        if early is not None and not prepack:  # the fusions changed the GEMMs: not expected
            with contextlib.suppress(OSError):  # the write below reports a full disk
                early[0].result()
                os.unlink(os.path.join(tmp, "weights.bin"))
            early = None
        shared = {} if prepack else shared_weights(proto, weights, buffers)
        inits = in_place_initializers(proto, weights, buffers) if prepack else {}
        # weights are named by region attribute (c0, c1, ...), which the key covers by name
        # and digest; the graph's placeholder names are not (``_cached_ort``)
        meta = {"bind": "attr", "fusions": fusions,
                "inits": {n: n for n in inits if n in rg.sources},
                "shared": {n: n for n in shared if n in rg.sources},
                "casts": {n: [weights.casts[n][0], str(weights.casts[n][1])]
                          for n in shared if n not in rg.sources},
                "prepack": prepack, "weights": WEIGHTS_SUFFIX}
        keep_optimized = prepack and saves_prepacked(proto)
        meta["optimized"] = keep_optimized

        def session(model: bytes | str, optimized_path: str | None = None) -> OrtExecutor:
            # a model onnxruntime saves optimized keeps its weights in its own file: read
            # there; the others prepack from the region's tensors (``in_place_initializers``)
            return OrtExecutor(model, input_names, threads=threads,
                               optimized_path=optimized_path, shared=shared, prepack=prepack,
                               optimized_weights=key + WEIGHTS_SUFFIX if optimized_path else None,
                               initializers=None if optimized_path else inits)

        def in_memory(proto: onnx.ModelProto, weights: Weights) -> Compiled:
            kept = None
            if keep:
                weightless = onnx.ModelProto()
                weightless.CopyFrom(proto)
                kept = (weightless, weights)
            data = write_weights(proto, weights).SerializeToString()
            return Compiled(session(data), key, False, len(data), fusions, kept)

        if cache is None or tmp is None:
            return in_memory(proto, weights)
        if fast is not None:
            meta["fast"] = fast[1]
        return _store_ort(cache, key, tmp, proto, weights, early, session, in_memory,
                          keep_optimized, meta, fusions, input_names, threads, shared, prepack,
                          fast[0] if fast is not None else None, check)


def _store_ort(
    cache: ArtifactCache, key: str, tmp: str, proto: onnx.ModelProto, weights: Weights,
    early: tuple[Future, Checksum] | None, session: Any, in_memory: Any,
    keep_optimized: bool, meta: dict[str, Any], fusions: dict[str, int],
    input_names: list[str], threads: int | None, shared: dict[str, torch.Tensor], prepack: bool,
    fast: bytes | None = None,
    check: Any = None,
) -> Compiled:
    """Write the region's files in the build directory ``tmp``, open its session and store the
    entry (``_compile_ort`` says which files). The weights go to disk straight from their
    arrays (``early``: already being written), and the model that names them is kilobytes:
    nothing holds a serialized copy of the weights in memory."""
    src, opt = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "opt.onnx")
    # without the optimized model, the lowering's two files are the entry: named as such
    weights_name = "weights.bin" if keep_optimized else key + WEIGHTS_SUFFIX
    written = os.path.join(tmp, weights_name)
    try:
        if early is not None:
            layout, checksum = early[0].result(), early[1]
            os.replace(os.path.join(tmp, "weights.bin"), written)
        else:
            checksum = Checksum()
            layout = write_weights_file(weights, written, checksum.update)
        point_external(proto, weights, layout, weights_name)
        with open(src, "wb") as f:
            f.write(proto.SerializeToString())
        fast_path = os.path.join(tmp, "fast.onnx")
        if fast is not None:
            with open(fast_path, "wb") as f:
                f.write(fast)
    except OSError as e:  # a full disk costs the caching, never the offload
        cache.warn_unwritable(e)
        return in_memory(proto, weights)
    size = os.path.getsize(src) + os.path.getsize(written)
    if not keep_optimized:
        ex, opt = session(src), src
    else:
        try:
            ex = session(src, optimized_path=opt)
        except Exception as e:  # noqa: BLE001 - writing opt.onnx may fail for lack of space
            ex = session(src)  # a model error raises again
            cache.warn_unwritable(OSError(f"onnxruntime could not write its optimized model: {e}"))
            return Compiled(ex, key, False, size, fusions)
    # One entry, three files: a hit needs all of them. An unwritable cache (None, warned
    # once) keeps the session in memory. The weights go in first: the model names them.
    bin_path = os.path.join(tmp, key + WEIGHTS_SUFFIX)
    if not os.path.exists(bin_path):  # no weight large enough to be written outside
        open(bin_path, "wb").close()
    # The parts' checksums, of the files this process stored, bind them in .host.json: a
    # hit whose model or weights file another process replaced meanwhile (the same key
    # compiled twice at once) is a miss, never one process's model over the other's file.
    bin_sum = checksum.value() if not keep_optimized else file_checksum(bin_path)
    parts = {WEIGHTS_SUFFIX: bin_sum, ".host.onnx": file_checksum(opt)}
    files = [(WEIGHTS_SUFFIX, bin_path), (".host.onnx", opt)]
    if fast is not None:
        parts[FAST_SUFFIX] = file_checksum(fast_path)
        files.append((FAST_SUFFIX, fast_path))
    stored, mine = {}, []  # mine: the files' inodes, which a move into the cache keeps
    for suffix, path in files:
        mine.append(os.stat(path).st_ino)
        stored[suffix] = cache.put_file(key, suffix, path, checksum=parts[suffix])
        if stored[suffix] is None:
            cache.discard(key, WEIGHTS_SUFFIX)  # no partial entry left behind
            return Compiled(ex, key, False, size, fusions)
    meta["parts"] = parts
    if check is not None:  # last word before the entry is published (.host.json names it)
        try:
            check()
        except Exception:
            cache.discard(key, WEIGHTS_SUFFIX)
            raise
    # The optimized model's session maps the build directory's weights.bin, which is
    # deleted on the way out: its blocks would stay allocated, unseen by the cache's size
    # bound, for as long as the model lives. Run from the stored entry instead, as a hit
    # would. (The lowering's session maps the file that moved into the cache: it stays.)
    if (cache.put(key, ".host.json", json.dumps(meta).encode()) is not None
            and keep_optimized
            and os.path.getsize(written) >= MIN_SHARED_BYTES
            and _inodes(stored) == mine):
        ex = None  # release the build's session (its prepacked copy) before the load
        ex = _from_stored(stored, mine, input_names, threads, shared, prepack)
        if ex is None:  # replaced meanwhile (or unloadable): build again from ours
            ex = session(src)
    return Compiled(ex, key, False, size, fusions)


def _inodes(stored: dict[str, Any]) -> list[int] | None:
    try:
        return [os.stat(p).st_ino for p in stored.values()]
    except OSError:
        return None


def _from_stored(
    stored: dict[str, Any], mine: list[int], input_names: list[str], threads: int | None,
    shared: dict[str, torch.Tensor], prepack: bool,
) -> OrtExecutor | None:
    """A session over the entry this process just stored, or None unless its files are still
    the ones it moved there (``mine``: their inodes, checked again once the session has opened
    them; entries are replaced only by atomic renames): another process compiling the same
    key may have replaced them meanwhile, and those are not ours to read."""
    try:
        new = OrtExecutor(str(stored[".host.onnx"]), input_names, threads=threads,
                          preoptimized=True, shared=shared, prepack=prepack)
    except Exception:  # noqa: BLE001 - replaced or evicted meanwhile: the caller rebuilds
        return None
    return new if _inodes(stored) == mine else None


def _build_dir(cache: ArtifactCache) -> tempfile.TemporaryDirectory:
    """A scratch directory on the cache's filesystem (so the result is moved, not copied),
    or the system's when the cache root cannot hold one. Stale ones (a killed process) are
    swept by the cache's eviction."""
    try:
        cache.root.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=cache.root, prefix=BUILD_PREFIX)
    except OSError:
        return tempfile.TemporaryDirectory(prefix="fxpass-build-")


def _cached_ort(
    cache: ArtifactCache,
    key: str,
    input_names: list[str],
    threads: int | None,
    weights: dict[str, torch.Tensor],
    tiered: bool = True,
) -> Compiled | None:
    """A verified hit, or None to compile: an entry that does not load is rebuilt, not eager.

    ``weights`` maps the region's weight attributes (``c0``, ``c1``, ...) to this graph's
    tensors; the entry names the attribute each weight it reads in place is. The key covers
    the attributes by name and digest, so they hold the same data. (Entries before 2026-12-02
    named the graph's placeholders, which the key does not cover: a twin graph whose
    placeholders come in another order bound the wrong tensor, error 14.9 in review. Those
    entries are misses now.)
    A tiered entry (``FAST_SUFFIX``) opens its first tier here and verifies and opens the
    prepacked model in the background; if that fails, the entry is discarded (the next process
    compiles it again) and the first tier keeps running."""
    hit = cache.get_path(key, ".host.onnx")
    info = cache.get(key, ".host.json")
    if hit is None or info is None:
        return None
    path, size = hit
    try:
        meta = json.loads(info)
        if meta.get("bind") != "attr":
            return None  # an entry that binds by placeholder name: compile it again
        fusions, names, prepack = meta["fusions"], meta["shared"], meta["prepack"]
        if not isinstance(fusions, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in fusions.items()
        ):
            raise ValueError(f"fusions are not a {{name: count}} object: {fusions!r:.80}")
        shared = _bind(names, weights)
        if not _readable_in_place(shared):
            return None  # same values in another layout: compile for this one
        casts = meta.get("casts", {})  # entries before cast weights were made here: none
        if not isinstance(casts, dict) or not all(
            isinstance(v, list) and len(v) == 2 and v[0] in weights and v[1] in _CAST_DTYPES
            for v in casts.values()
        ):
            raise ValueError(f"cast weights malformed or not of this graph: {casts!r:.80}")
        shared.update({init: cast_weight(weights[src], _CAST_DTYPES[dt])
                       for init, (src, dt) in casts.items()})
        if not isinstance(prepack, bool):
            raise ValueError(f"prepack is not a bool: {prepack!r:.40}")
        external = meta.get("weights")  # entries before the weights file: none
        if external is not None and external != WEIGHTS_SUFFIX:
            raise ValueError(f"weights file suffix {external!r:.40} is not {WEIGHTS_SUFFIX}")
        optimized = meta.get("optimized", True)  # entries before unoptimized ones: all were
        if not isinstance(optimized, bool):
            raise ValueError(f"optimized is not a bool: {optimized!r:.40}")
        # the prepacked model's weights taken from this graph's tensors (entries before
        # this: none, all read from the file); another layout reads them from the file too
        inits = _bind(meta.get("inits", {}), weights) if not optimized else {}
        if not _readable_in_place(inits):
            inits = {}
        parts = meta.get("parts")
        first = _first_tier(cache, key, meta, parts, input_names, threads, weights) if (
            tiered and external is not None) else None
    except Exception as e:  # noqa: BLE001 - any load failure of a cached entry means rebuild
        _warn_unloadable(path, e)
        return None

    def second(strict: bool) -> OrtExecutor | None:
        """The prepacked session over the verified entry; None (or, ``strict``, an error)
        where the entry's weights file is gone, damaged or from another store."""
        nonlocal size
        if external is not None:
            found = cache.get_path(key, WEIGHTS_SUFFIX)  # verified like the model
            if found is None:
                return _missing(strict, "its weights file is evicted or damaged")
            size += found[1]
            if not isinstance(parts, dict) or any(
                parts.get(s) is None or parts.get(s) != cache.stored_checksum(key, s)
                for s in (".host.onnx", WEIGHTS_SUFFIX)
            ):
                return _missing(strict, "its parts come from two stores")
        try:
            return OrtExecutor(str(path), input_names, threads=threads, preoptimized=optimized,
                               shared=shared, prepack=prepack, initializers=inits)
        except Exception as e:  # noqa: BLE001 - any load failure of a cached entry: rebuild
            if strict:
                raise
            _warn_unloadable(path, e)
            return None

    if first is not None:
        with contextlib.suppress(OSError):  # reported, not verified: the second tier does that
            size += os.path.getsize(cache.path(key, WEIGHTS_SUFFIX))

        def build() -> OrtExecutor | None:
            try:
                return second(strict=True)
            except Exception:
                cache.discard(key, ".host.json")  # the next process compiles it again
                raise
        return Compiled(TieredExecutor(first, build, key[:12]), key, True, size, fusions)
    ex = second(strict=False)
    return None if ex is None else Compiled(ex, key, True, size, fusions)


def _bind(names: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An entry's shared inputs (initializer -> region weight attribute) bound to this graph's
    tensors; ValueError if malformed or naming a weight the region does not have."""
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise ValueError(f"shared weights malformed: {names!r:.80}")
    missing = [src for src in names.values() if src not in weights]
    if missing:  # another graph's weights: not this entry's (the key should not collide)
        raise ValueError(f"the graph has no frozen weight {missing[0]!r}")
    return {init: weights[src] for init, src in names.items()}


def _first_tier(
    cache: ArtifactCache, key: str, meta: dict, parts: Any, input_names: list[str],
    threads: int | None, weights: dict[str, torch.Tensor],
) -> OrtExecutor | None:
    """A tiered entry's first-tier session (its model is kilobytes), or None if the entry has
    none, it is not of this store, or this graph's weights cannot be read in place
    (:func:`_readable_in_place`); then the prepacked model (weights from its file) opens."""
    names = meta.get("fast")
    if names is None or not isinstance(parts, dict):
        return None
    shared = _bind(names, weights)
    if not _readable_in_place(shared):
        return None
    found = cache.get_path(key, FAST_SUFFIX)
    if found is None or parts.get(FAST_SUFFIX) != cache.stored_checksum(key, FAST_SUFFIX):
        return None
    return OrtExecutor(str(found[0]), input_names, threads=threads,
                       shared=shared, prepack=False, arena=False)


def _readable_in_place(shared: dict[str, torch.Tensor]) -> bool:
    """Whether this graph's tensors can be fed where an entry reads weights in place. The key
    hashes a weight's values, not its strides, so a hit may hold the same values in another
    layout (a transposed view); onnxruntime reads a fed weight as row-major."""
    return all(readable_in_place(t) for t in shared.values())


def _missing(strict: bool, why: str) -> None:
    if strict:
        raise OSError(f"the cached prepacked model cannot be used: {why}")
    return None


def _warn_unloadable(path: os.PathLike, e: Exception) -> None:
    warnings.warn(
        f"fxpass: cached artifact {path} does not load ({type(e).__name__}: {e}); rebuilding it",
        stacklevel=4,
    )


def _compile_quantizing(
    rg: RegionGraph,
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    kind: str,
    cfg: Q.QuantConfig,
    cache: ArtifactCache | None,
    threads: int | None,
) -> Compiled:
    """A region that runs its float lowering on the host until ``calibrate()`` quantizes it.

    The float model is the plain lowering (no host fusions): the QDQ model must be the graph
    the board gets, and onnxruntime's own QDQ fusions turn it into integer kernels on the host.
    """
    proto = lower(rg.gm, name=name)
    data = proto.SerializeToString()
    float_ex = OrtExecutor(data, input_names, threads=threads)
    info = QuantInfo(region=name, config=cfg.name, march=march, target=kind)

    # host, int16 activations: no integer CPU kernels, so dequantize the weights once
    fold = kind == "onnxruntime" and cfg.activations == "int16"

    def build(digest: str, make_qdq: Any) -> tuple[Any, bool, dict]:
        qkey = quantized_key(key, cfg, digest, "fold-weights" if fold else "")
        info.key = qkey
        if kind == "hbdnn":
            return _quantized_hbm(name, qkey, input_names, march, cache, make_qdq)
        return _quantized_ort(qkey, input_names, march, cache, threads, make_qdq, fold)

    ex = QuantizingExecutor(info, proto, float_ex, cfg, build)
    return Compiled(ex, key, False, len(data))


def quantized_key(float_key: str, cfg: Q.QuantConfig, digest: str, variant: str = "") -> str:
    """The quantized artifact's key: the float region's key (graph, weights, march, options,
    tools) plus the quantization config, the digest of the calibration ranges and the
    artifact variant (host weight folding)."""
    import hashlib

    text = json.dumps([float_key, cfg.key(), digest, variant], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=24).hexdigest()


def _summary(cache: ArtifactCache | None, key: str) -> dict | None:
    raw = cache.get(key, ".quant.json") if cache is not None else None
    try:
        s = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return s if isinstance(s, dict) else None


def _quantized_ort(
    key: str,
    input_names: list[str],
    march: str,
    cache: ArtifactCache | None,
    threads: int | None,
    make_qdq: Any,
    fold: bool = False,
) -> tuple[Any, bool, dict]:
    """Host session of the QDQ model (onnxruntime fuses it into integer kernels), cached.
    ``fold``: weights dequantized once (:func:`quantize.fold_weight_dequantize`)."""
    summary = _summary(cache, key)
    if cache is not None and summary is not None:
        data = cache.get(key, ".ort.onnx")
        if data is not None:
            try:
                return OrtExecutor(data, input_names, threads, preoptimized=True), True, summary
            except Exception as e:  # noqa: BLE001 - a cached entry that does not load: rebuild
                _warn_unloadable(cache.path(key, ".ort.onnx"), e)
    qdq = make_qdq()
    summary = Q.summarize(qdq, march)
    data = (Q.fold_weight_dequantize(qdq) if fold else qdq).SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        opt = os.path.join(tmp, "opt.onnx")
        ex = OrtExecutor(data, input_names, threads=threads, optimized_path=opt)
        with open(opt, "rb") as f:
            optimized = f.read()
    # which integer kernels onnxruntime fused the QDQ pattern into, on this CPU
    summary["host_integer_kernels"] = Q.integer_kernels(onnx.load_from_string(optimized))
    if cache is None:
        return ex, False, summary
    if cache.put(key, ".ort.onnx", optimized) is not None:
        cache.put(key, ".quant.json", json.dumps(summary).encode())
    return ex, False, summary


def _quantized_hbm(
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    cache: ArtifactCache | None,
    make_qdq: Any,
) -> tuple[Any, bool, dict]:
    """The calibrated QDQ model through hbdk4, after checking every MAC op is dequantized."""
    summary = _summary(cache, key)
    if summary is not None:
        c = _compile_hbm(None, name, key, input_names, march, cache, lookup_only=True)
        if c is not None:
            return c.executor, True, summary
    qdq = make_qdq()
    summary = Q.summarize(qdq, march)
    if summary["float_mac"]:
        raise Q.FloatMacError(
            f"region {name}: these MAC ops have float inputs after quantization and would run "
            f"on the board's CPU: {summary['float_mac'][:5]}; this is a bug in the "
            "integer-input table (quantize.INTEGER_INPUT_OPS) for this op"
        )
    c = _compile_hbm(qdq, name, key, input_names, march, cache)
    if cache is not None:
        cache.put(key, ".quant.json", json.dumps(summary).encode())
    return c.executor, False, summary


def _compile_hbm(
    proto: onnx.ModelProto | None,
    name: str,
    key: str,
    input_names: list[str],
    march: str,
    cache: ArtifactCache | None,
    lookup_only: bool = False,
) -> Compiled | None:
    """Compile (or load) a quantized region's ``.hbm``; the board runtime loads it from a path.

    With the cache disabled (``cache=False``) or unwritable, the ``.hbm`` lives in a private
    temporary directory owned by the executor, removed when the executor is collected; the
    user cache is never written then. ``lookup_only``: a verified cache hit, or None.
    """
    if cache is not None and cache.get(key, ".hbm") is not None:
        path = cache.path(key, ".hbm")
        try:
            return Compiled(HbmExecutor(str(path), input_names), key, True, path.stat().st_size)
        except Exception as e:  # noqa: BLE001 - e.g. evicted meanwhile: rebuild it
            _warn_unloadable(path, e)
    if lookup_only or proto is None:
        return None
    from hbdk4 import compiler as hb

    module = hb.onnx.export(proto, name=name)
    module = hb.convert(module, march)
    tmp = tempfile.TemporaryDirectory(prefix=f"fxpass-{name}-")
    try:
        out = os.path.join(tmp.name, f"{name}.hbm")
        hb.compile(module, out, march, opt=2)
        with open(out, "rb") as f:
            data = f.read()
        path = cache.put(key, ".hbm", data) if cache is not None else None
        if path is None:
            ex = HbmExecutor(out, input_names)
            ex._fxpass_hbm_dir = tmp  # the directory lives as long as the executor
            return Compiled(ex, key, False, len(data))
    except BaseException:
        tmp.cleanup()
        raise
    tmp.cleanup()
    return Compiled(HbmExecutor(str(path), input_names), key, False, len(data))
