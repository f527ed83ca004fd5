"""Content digests for cache keys: each weight hashed once per process, with the fastest hash here.

Why: a cache key must cover every byte of every weight (a sampled digest once served a stale
artifact), but hashing ~300 MB of weights on every compile made the key the largest part of a
warm compile. So:

- **Fast hash.** Measured on this 2-core machine over a 64 MB buffer (``python -m
  benchmarks.compile_time --hash``): xxh3-128 2.8 GB/s, crc32 1.2, sha1 0.73, sha256 0.64,
  blake2b 0.24 GB/s, and blake2b over ``.tobytes()`` (the old key) 0.14 GB/s. We use xxh3-128
  when the ``xxhash`` package is installed, else sha256 (SHA-NI makes it the fastest
  collision-resistant stdlib hash here). The algorithm's name is part of every digest, so two
  processes with different hashers miss rather than compare unlike digests.
- **No copies.** A contiguous tensor is hashed through a ``memoryview`` of its own storage
  bytes (``view(torch.uint8).numpy()`` is a view, also for bfloat16); only a non-contiguous
  tensor (rare for weights) is made contiguous first.
- **Once per process.** Digests are memoized on (data pointer, dtype, shape, stride, storage
  offset) and validated by the tensor's version counter and a weak reference to the tensor that
  was hashed: while that tensor lives its memory cannot be reused, so the same pointer and
  layout mean the same bytes, and any in-place write (through any view, which shares the
  counter) bumps the version and misses. The memo keeps no tensor alive. Inference-mode tensors
  have no version counter and are hashed every time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import sys
import weakref
from collections import Counter
from typing import Any

import torch

try:  # optional: 12x faster than blake2b here
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the install
    _xxhash = None

HASH_NAME = "xxh3_128" if _xxhash is not None else "sha256"
#: How often a digest was computed vs. served from the memo (tests and the benchmark read it).
STATS: Counter[str] = Counter()
_MEMO: dict[tuple, tuple[weakref.ref, int, str]] = {}


def hasher() -> Any:
    """A new incremental hasher of the chosen algorithm (``update``/``hexdigest``)."""
    return _xxhash.xxh3_128() if _xxhash is not None else hashlib.sha256()


def _bytes_view(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous():
        t = t.contiguous()  # the one copy, for a non-contiguous weight
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _hash(t: torch.Tensor) -> str:
    h = hasher()
    h.update(f"{HASH_NAME}:{t.dtype}:{tuple(t.shape)}:".encode())
    if t.numel():
        h.update(_bytes_view(t.detach()))
    return h.hexdigest()


def fresh_digest(t: torch.Tensor) -> str:
    """:func:`tensor_digest` hashed now, never from the memo: for checking that a weight still
    holds what its key says after writes that no version counter sees (``.data``)."""
    STATS["hashed"] += 1
    return _hash(t)


def tensor_digest(t: torch.Tensor) -> str:
    """The digest of ``t``'s dtype, shape and every byte of its data, memoized (see module doc)."""
    if t.is_inference():  # no version counter: a write could not be seen, so never memoize
        STATS["hashed"] += 1
        return _hash(t)
    key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device)
    hit = _MEMO.get(key)
    ver = t._version
    if hit is not None:
        ref, v, digest = hit
        if v == ver and ref() is not None:
            STATS["memo"] += 1
            return digest
    STATS["hashed"] += 1
    digest = _hash(t)
    _MEMO[key] = (weakref.ref(t, lambda _r, k=key: _drop(k, _r)), ver, digest)
    return digest


def _drop(key: tuple, ref: weakref.ref) -> None:
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is ref:
        del _MEMO[key]


def clear_memo() -> None:
    """Forget every memoized digest (tests; a process that rewrites weights behind torch)."""
    _MEMO.clear()


@functools.cache
def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unreadable"


@functools.cache
def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def module_digest(module_name: str) -> str:
    """The digest of a module's source file (cached per process): an edited rule in an editable
    install changes it even when no version number moved."""
    mod = sys.modules.get(module_name)
    path = getattr(mod, "__file__", None)
    return _file_digest(path) if path else "no-file"


def rule_identity(rule: Any) -> tuple:
    """Everything of a rule that can change what it does to a graph: name, plugin distribution
    and its version, priority, roots, and the source of the module that defines its function."""
    plugin = str(getattr(rule, "plugin", "?"))
    dist = plugin.split(":", 1)[0]
    fn = getattr(rule, "fn", rule)
    mod = getattr(fn, "__module__", None) or "?"
    roots = getattr(rule, "roots", None)
    return (
        rule.name,
        plugin,
        _dist_version(dist),
        getattr(rule, "priority", 0),
        getattr(rule, "graph_level", False),
        None if roots is None else tuple(sorted(map(str, roots))),
        mod,
        module_digest(mod),
        _packages_digest(mod),
    )


def _packages_digest(mod: str) -> str | None:
    """The sources of the packages a rule's module sits in: its top-level package and its
    parent package (for fxpass's own rules the two are separate directories). A rule reads
    helpers beside it; a probe's plugin fixed a constant in its ``helpers.py`` and the warm
    plan kept the old rewrite (error 0.555 against 0.0 cold)."""
    import importlib

    names = dict.fromkeys(p for p in (mod.split(".")[0], mod.rpartition(".")[0]) if p)
    found = []
    for name in names:
        try:
            pkg = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - unknown: keyed by the module alone, as before
            continue
        # a package with a directory of its own (a namespace package has no __file__)
        if getattr(pkg, "__path__", None) is not None and getattr(pkg, "__file__", None):
            found.append(name)
    try:
        return source_digest(*found) if found else None
    except Exception:  # noqa: BLE001 - unreadable: keyed by the module alone, as before
        return None


@functools.cache
def source_digest(*packages: str) -> str:
    """Digest of every ``.py`` file under the given packages' directories, subpackages
    included (cached per process).

    The lowering, partitioner and pass manager shape a plan and a region's artifact as much as
    the rules do, and an editable install changes them without a version bump. Whole
    directories, not the loaded modules, so two processes that imported different parts agree.
    (Subpackages were left out until a probe showed a fix to ``lowering/`` never reaching a
    warm cache: the old wrong model kept loading.)
    """
    import importlib
    from pathlib import Path

    h = hashlib.sha256()
    for pkg in packages:
        root = Path(importlib.import_module(pkg).__file__).parent
        for f in sorted(root.rglob("*.py")):
            if "__pycache__" not in f.parts:
                rel = f.relative_to(root).as_posix()
                h.update(f"{pkg}/{rel}={_file_digest(str(f))};".encode())
    return h.hexdigest()[:24]
