"""Build (or load from the artifact cache) a region's onnxruntime session on the host: the
lowering's model prepared for onnxruntime's fused kernels (``host.prepare``), its weights read
in place or prepacked, the entry stored in the cache as a few files, tiered where prepacking
is slow. The float and the calibrated (QDQ) host paths both end here."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import onnx
import torch

from fxpass.backends.onnx import quantize as Q
from fxpass.backends.onnx.calibration import cached_summary
from fxpass.backends.onnx.host.entry import (
    FAST_SUFFIX,
    WEIGHTS_SUFFIX,
    _from_stored,
    _inodes,
    cached_ort,
)
from fxpass.backends.onnx.host.ort import OrtExecutor, TieredExecutor
from fxpass.backends.onnx.host.prepare import (
    MIN_SHARED_BYTES,
    casts_in_place,
    declared_weights,
    fuse_for_ort,
    in_place_initializers,
    in_place_model,
    prepack_helps,
    saves_prepacked,
    shared_weights,
    tier_pays,
)
from fxpass.backends.onnx.lowering import (
    lower_weightless,
    point_external,
    write_weights,
    write_weights_file,
)
from fxpass.backends.onnx.lowering.driver import Weights
from fxpass.jit.cache import (
    BUILD_PREFIX,
    ArtifactCache,
    Checksum,
    file_checksum,
    warn_unloadable,
)
from fxpass.jit.digest import fresh_digest, tensor_digest
from fxpass.jit.runtime import Compiled
from fxpass.partition.region import RegionGraph


def compile_ort(
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

    Linear weights lower as ``Gemm(transB=1)`` over the weight itself. Where the region does not
    prepack (``rows``: 1 for one row per GEMM with ``prepack_one_row=False``, or BF16 casts at one
    row; default ``host.prepare.PREPACK_MAX_ROWS``), every frozen weight is a graph input fed from
    the caller's tensor (``host.prepare.shared_weights``), so neither the model, nor the cache, nor
    onnxruntime holds a copy of it; only weight views (a bf16 weight cast to float32) are written.
    The cache keeps onnxruntime's optimized model (``.host.onnx``, a few kilobytes), the weights it
    bakes in as external data beside it (``.host.bin``: the written weights, and every GEMM weight
    prepacked where it prepacks), and which frozen weight each shared input is (``.host.json``).

    Where onnxruntime would save no prepacked weights (none prepacked, or
    ``host.prepare.saves_prepacked`` says no), its optimized model buys a later process only the
    graph optimizer (a scratch load of the Qwen3 4 x 1024 entry: 0.31 s with it on or off) and costs
    this one a second write of every weight and a second session. The entry then keeps the
    lowering's own model and weights (``"optimized": false``; each process optimizes at load), and
    the one session opened on them keeps running: moving the files into the cache keeps what it
    maps.

    A region that prepacks large weights is tiered (``tiered``, ``host.prepare.in_place_model``):
    this returns as soon as an in-place-weights session is open, and everything above (the weights
    file, the prepacked session, the entry) is built in the background. The entry then also keeps
    that first tier's model (``.fast.onnx``, kilobytes), so a hit opens it at once too."""
    buffers = {c: getattr(rg.gm, c) for c in rg.sources}  # the frozen weights it holds
    if cache is not None:
        check = unchanged_check(rg, buffers)
        hit = cached_ort(cache, key, input_names, threads, buffers, tiered,
                         rebuild=lambda untiered=False: rebuild_weights(
                             rg, name, key, input_names, cache, threads, fuse, rows, buffers,
                             check, untiered))
        if hit is not None:
            return hit
    # the fusions rewrite a model without weight data (kilobytes); the weights go in once, last
    proto, weights = lower_weightless(rg.gm, name=name, gemm=True)
    if rows is None and casts_in_place(weights, buffers):
        # BF16 weights at one row keep reading a float32 cast made once (host.cast_weight):
        # a first tier would cast them on every call, 10x slower (docs/benchmarks.md)
        rows = 1
    # one row per GEMM (a decode step, a 1-token forward): no tier. Its first tier is only
    # ~1.2x slower than the prepacked session, so the build in the background cost the calls
    # beside it more than it saved the first (Qwen3 4 x 1024, 1 token: the 20 calls after the
    # compile took 2.0x whole-model onnxruntime, against 1.1x once built): it is built at once
    if tiered and prepack_helps(proto, 1) and tier_pays(proto, weights, buffers):
        fusions: dict[str, int] = {}
        if fuse:
            proto, fusions, weights = _fused(proto, weights)
        first = in_place_model(proto, weights, buffers) if prepack_helps(proto, rows) else None
        if first is not None:
            data, shared, attrs = first
            fast = OrtExecutor(data, input_names, threads=threads, shared=shared, prepack=False,
                               arena=False)
            fast_meta = {n: attrs[n] for n in shared}  # input -> region attribute
            unchanged = unchanged_check(rg, buffers)
            # a fleet's other processes wait for this entry (remote tier): until it is stored
            done = cache.hold(key) if cache is not None else (lambda: None)

            def second() -> Any:
                try:
                    return build_ort(rg, key, input_names, cache, threads, proto, weights,
                                     buffers, fusions, (data, fast_meta), unchanged,
                                     rows).executor
                finally:
                    done()

            size = len(data) + sum(t.numel() * t.element_size() for t in shared.values())
            return Compiled(TieredExecutor(fast, second, name), key, False, size, fusions)
        return build_ort(rg, key, input_names, cache, threads, proto, weights, buffers, fusions,
                          rows=rows)
    return build_ort(rg, key, input_names, cache, threads, proto, weights, buffers,
                      None if fuse else {}, rows=rows)


def unchanged_check(rg: RegionGraph, buffers: dict[str, torch.Tensor]) -> Any:
    """A check that the region's weights still hold what its key names (memoized digests)."""
    keyed = {c: tensor_digest(t) for c, t in buffers.items()}

    def unchanged() -> None:
        """The first call has returned, so the caller may have written a weight meanwhile
        (through .data, which no version counter sees): then the files hold values the key
        does not name. Checked before the entry is published."""
        changed = [c for c, t in buffers.items() if fresh_digest(t) != keyed[c]]
        if changed:
            raise RuntimeError(f"weight {rg.sources[changed[0]]!r} changed while the prepacked "
                               "session was built; its entry is discarded")
    return unchanged


def rebuild_weights(
    rg: RegionGraph, name: str, key: str, input_names: list[str], cache: ArtifactCache,
    threads: int | None, fuse: bool, rows: int | None, buffers: dict[str, torch.Tensor],
    check: Any, untiered: bool = False,
) -> OrtExecutor:
    """The prepacked second tier of an entry whose weights file is not here: a remote cache
    publishes the region's models (kilobytes), not the weights file (the size of the weights:
    prepacked weights every client makes from its own). Built from this graph's weights as a
    cold compile's second tier is, in the background, and stored locally only.
    (``rows``: ``compile_ort``'s; ``check``: :func:`unchanged_check` of ``buffers``;
    ``untiered``: the entry was stored untiered, and stays so: ``build_ort`` keeps its
    in-place model under ``"tiered": false``.)"""
    from fxpass.jit.remote import STATS

    STATS["region_weights_rebuilt"] += 1
    proto, weights = lower_weightless(rg.gm, name=name, gemm=True)
    if rows is None and casts_in_place(weights, buffers):
        rows = 1
    fusions: dict[str, int] = {}
    if fuse:
        proto, fusions, weights = _fused(proto, weights)
    first = None if untiered else in_place_model(proto, weights, buffers)
    fast = (first[0], {n: first[2][n] for n in first[1]}) if first is not None else None
    return build_ort(rg, key, input_names, cache.local_only(), threads, proto, weights,
                     buffers, fusions, fast, check, rows).executor


def _fused(
    proto: onnx.ModelProto, weights: Weights
) -> tuple[onnx.ModelProto, dict[str, int], Weights]:
    """The host fusions, and the weights the fused model still declares (a fusion may drop
    one, ``host.prepare.declared_weights``)."""
    proto, fusions = fuse_for_ort(proto, weights)
    return proto, fusions, declared_weights(proto, weights)


def build_ort(
    rg: RegionGraph, key: str, input_names: list[str], cache: ArtifactCache | None,
    threads: int | None, proto: onnx.ModelProto, weights: Weights,
    buffers: dict[str, torch.Tensor], fusions: dict[str, int] | None,
    fast: tuple[bytes, dict[str, str]] | None = None,
    check: Any = None,
    rows: int | None = None,
    keep: bool = False,
) -> Compiled:
    """``compile_ort`` from the lowered model: ``fusions`` None runs them here (beside the
    weights write), else they ran already. ``fast``: a tiered region's first-tier model and
    its shared inputs' weights, stored with the entry. ``keep``: ``buffers`` is empty (every
    weight written), and ``Compiled.data`` keeps the weightless model and its weights."""
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
        # and digest; the graph's placeholder names are not (``cached_ort``)
        meta = {"bind": "attr", "fusions": fusions,
                "inits": {n: n for n in inits if n in rg.sources},
                "shared": {n: n for n in shared if n in rg.sources},
                "casts": {n: [weights.casts[n][0], str(weights.casts[n][1])]
                          for n in shared if n not in rg.sources},
                "prepack": prepack, "weights": WEIGHTS_SUFFIX}
        keep_optimized = prepack and saves_prepacked(proto)
        meta["optimized"] = keep_optimized
        if fast is None and prepack and tmp is not None and buffers:
            # an untiered entry keeps an in-place-weights model too (kilobytes): a process
            # whose cache lacks the weights file (a remote tier keeps none) runs on it while
            # it rebuilds that file, instead of compiling the region cold
            first = in_place_model(proto, weights, buffers)
            if first is not None:
                fast = (first[0], {n: first[2][n] for n in first[1]})
                meta["tiered"] = False

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
    entry (``compile_ort`` says which files). The weights go to disk straight from their
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


def _build_dir(cache: ArtifactCache) -> tempfile.TemporaryDirectory:
    """A scratch directory on the cache's filesystem (so the result is moved, not copied),
    or the system's when the cache root cannot hold one. Stale ones (a killed process) are
    swept by the cache's eviction."""
    try:
        cache.root.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=cache.root, prefix=BUILD_PREFIX)
    except OSError:
        return tempfile.TemporaryDirectory(prefix="fxpass-build-")


def quantized_ort(
    key: str,
    input_names: list[str],
    march: str,
    cache: ArtifactCache | None,
    threads: int | None,
    make_qdq: Any,
    fold: bool = False,
    keep: bool = False,
) -> tuple[Any, bool, dict]:
    """Host session of the QDQ model (onnxruntime fuses it into integer kernels), cached.
    ``fold``: weights dequantized once (:func:`quantize.fold_weight_dequantize`). ``keep``:
    the executor keeps the model it runs (``source``) for a package."""
    summary = cached_summary(cache, key)
    if cache is not None and summary is not None:
        data = cache.get(key, ".ort.onnx")
        if data is not None:
            try:
                return OrtExecutor(data, input_names, threads, preoptimized=True), True, summary
            except Exception as e:  # noqa: BLE001 - a cached entry that does not load: rebuild
                warn_unloadable(cache.path(key, ".ort.onnx"), e)
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
    if keep:
        ex.source = data
    if cache is None:
        return ex, False, summary
    if cache.put(key, ".ort.onnx", optimized) is not None:
        cache.put(key, ".quant.json", json.dumps(summary).encode())
    return ex, False, summary
