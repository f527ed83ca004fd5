"""Open a region's host entry from the artifact cache: verify its parts, bind the weights it
reads in place to this graph's tensors, and open its session (tiered where it was built so).
An entry that does not load is rebuilt, never run wrong: any doubt is a miss."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from fxpass.backends.onnx.host.ort import OrtExecutor, TieredExecutor
from fxpass.backends.onnx.host.prepare import cast_weight, readable_in_place
from fxpass.jit.cache import ArtifactCache, warn_unloadable
from fxpass.jit.runtime import Compiled

#: dtypes a cached entry may ask a weight to be cast to (``host.prepare.cast_weight``)
_CAST_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.float64)}


#: the cache entry's file of the optimized host model's weights (external data beside it)
WEIGHTS_SUFFIX = ".host.bin"


#: a tiered entry's first-tier model (weights fed in place; ``host.prepare.in_place_model``)
FAST_SUFFIX = ".fast.onnx"


def cached_ort(
    cache: ArtifactCache,
    key: str,
    input_names: list[str],
    threads: int | None,
    weights: dict[str, torch.Tensor],
    tiered: bool = True,
    rebuild: Callable[..., OrtExecutor] | None = None,
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
    compiles it again) and the first tier keeps running.
    ``rebuild``: builds the prepacked session from this graph's own weights when the entry's
    weights file is not here (a remote cache publishes no weights, ``fxpass.jit.remote``): in
    the background behind a tiered entry's first tier, at once for an untiered one; without
    it, such an entry is a miss."""
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
        if rebuild is None and external is not None and not cache.has(key, WEIGHTS_SUFFIX):
            return None  # a remote entry's weights stay with each client: compile here
        optimized = meta.get("optimized", True)  # entries before unoptimized ones: all were
        if not isinstance(optimized, bool):
            raise ValueError(f"optimized is not a bool: {optimized!r:.40}")
        # the prepacked model's weights taken from this graph's tensors (entries before
        # this: none, all read from the file); another layout reads them from the file too
        inits = _bind(meta.get("inits", {}), weights) if not optimized else {}
        if not _readable_in_place(inits):
            inits = {}
        parts = meta.get("parts")
        # an untiered entry opens its first tier only to rebuild a weights file neither this
        # cache nor its remote tier has (the remote keeps small ones only)
        untiered = meta.get("tiered") is False
        first = _first_tier(cache, key, meta, parts, input_names, threads, weights) if (
            tiered and external is not None
            and not (untiered and cache.has(key, WEIGHTS_SUFFIX))) else None
    except Exception as e:  # noqa: BLE001 - any load failure of a cached entry means rebuild
        warn_unloadable(path, e)
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
            warn_unloadable(path, e)
            return None

    if first is not None:
        with contextlib.suppress(OSError):  # reported, not verified: the second tier does that
            size += os.path.getsize(cache.path(key, WEIGHTS_SUFFIX))

        def build() -> OrtExecutor | None:
            try:
                return second(strict=True)
            except Exception:
                cache.discard(key, ".host.json")  # the next process compiles it again
                if rebuild is None:
                    raise
                return rebuild(untiered=untiered)
        return Compiled(TieredExecutor(first, build, key[:12]), key, True, size, fusions)
    ex = second(strict=False)
    if ex is None and external is not None and rebuild is not None and not cache.has(
            key, WEIGHTS_SUFFIX):
        # an untiered entry (one row per GEMM) from the remote tier, which keeps no weights
        # files: its models are here, the prepacked weights are made from this graph's own
        try:
            ex = rebuild(untiered=untiered)
        except Exception as e:  # noqa: BLE001 - a rebuild that fails: compile instead
            warn_unloadable(path, e)
            return None
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
