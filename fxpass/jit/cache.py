"""Artifact cache: content-addressed, atomic, verified on load.

The key covers everything that changes the artifact: the region graph *with node arguments*
(eps, dims, strides), a full digest of every weight (not a sample), input shapes and dtypes,
march, options, the rule-set version and the versions of every tool in the flow. Writes go to
a temporary file in the same directory and are renamed into place, so a reader never sees a
partial artifact and two processes compiling the same region race harmlessly. Each artifact
has a manifest with its SHA-256, key, suffix and tool versions; any mismatch or malformed
manifest on load is reported as corruption and the artifact rebuilt (an artifact filed under
another region's key would otherwise run as this region and give a wrong answer).

The cache must never cost correctness or offload: a cache directory that cannot be written
keeps compiled regions in memory (one warning per directory per process), and the cache is
bounded (``FXPASS_CACHE_MAX_BYTES``, default 2 GiB) by least-recently-used eviction, with
temporary files of crashed writers swept after an hour.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from fxpass.jit.verify import CACHE_VERSION, Checksum, file_checksum, tool_versions  # noqa: F401
from fxpass.jit.verify import check_manifest as _check_manifest
from fxpass.jit.verify import checksum as _checksum

MAX_BYTES_ENV = "FXPASS_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 * 1024**3
STALE_TMP_SECONDS = 3600.0  # a writer's temporary file older than this was left by a crash
BUILD_PREFIX = ".build-"  # scratch directories of host builds, under the cache root
_HEX = re.compile(r"[0-9a-f]+")
# cache roots already warned about as unwritable in this process (warn once, not per region)
_UNWRITABLE_WARNED: set[str] = set()
#: (root, key, suffix) of every entry this process read or stored (``bundle.export_bundle``)
USED: set[tuple[str, str, str]] = set()


def default_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("FXPASS_CACHE_DIR") or user_cache_dir("fxpass")) / "artifacts"


@functools.cache
def host_cpu_fingerprint() -> str:
    """A short digest of this host's CPU architecture and instruction-set features.

    onnxruntime's optimizer may bake CPU-specific kernels and layouts into the optimized model
    it writes, and the cached model is loaded with optimizations disabled, so an optimized
    model must only be reused on a CPU with the same features. Computed once per process.
    """
    feats = ""
    with contextlib.suppress(OSError, UnicodeDecodeError), open("/proc/cpuinfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):  # x86 / ARM spelling
                feats = " ".join(sorted(value.split()))
                break
    if not feats:  # not Linux: the best the platform tells
        feats = platform.processor()
    text = f"{platform.system()}|{platform.machine()}|{feats}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def region_key(gm: GraphModule, **context: Any) -> str:
    """Digest of the region graph (structure and arguments), its weights and the context.

    For a device that runs on the host CPU (``host=True``) the context also covers it (see
    :func:`host_cpu_fingerprint`); board artifacts do not depend on the compiling host. It
    always covers the backend's own source (``digest.source_digest``): the lowering and the
    host fusions make the artifact, and an editable install changes them without a version.
    """
    from fxpass.jit.digest import hasher, source_digest, tensor_digest

    context = {**context, "source": source_digest("fxpass")}
    if context.pop("host", False):
        context = {**context, "host_cpu": host_cpu_fingerprint()}

    h = hasher()  # xxh3-128 if installed, else sha256; weights memoized (digest.py)
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        meta = (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
        h.update(
            repr((n.op, n.name, str(n.target), n.args, sorted(n.kwargs.items()), meta)).encode()
        )
    tensors = dict(gm.named_parameters())
    tensors.update(gm.named_buffers())
    for name, buf in sorted(tensors.items()):
        h.update(f"{name}:{tensor_digest(buf)};".encode())  # dtype, shape and every byte
    h.update(
        json.dumps({**context, "tools": tool_versions()}, sort_keys=True, default=str).encode()
    )
    return h.hexdigest()


class ArtifactCache:
    """``get``/``put`` of bytes by key under ``root`` (atomic, verified, size-bounded)."""

    def __init__(self, root: str | os.PathLike | None = None, max_bytes: int | None = None,
                 remote: str | None | bool = None):
        if isinstance(root, str) and not root.strip():
            # Path("") is the working directory: artifacts would litter wherever the user runs
            raise ValueError(
                f"fxpass option cache_dir={root!r} is empty, which would write the artifact "
                "cache into the working directory; pass a directory path, leave cache_dir unset "
                "(None) for the default ($FXPASS_CACHE_DIR or the user cache directory), or "
                "pass cache=False to disable the cache"
            )
        self.root = Path(root) if root is not None else default_dir()
        self.max_bytes = _max_bytes(max_bytes)
        # the remote tier (remote.py): a URL, None for $FXPASS_REMOTE_CACHE, False for none
        from fxpass.jit import remote as R

        self.remote = None if remote is False else R.tier(R.url_from(remote or None))
        self.origin: dict[str, str] = {}  # key -> "remote" once an artifact came from there
        self.refused: dict[str, str] = {}  # key -> why the remote's entry was refused
        self._tokens: dict[str, str] = {}  # compile locks held by this cache's compiles

    def local_only(self) -> ArtifactCache:
        """This cache without its remote tier (a build that must not publish)."""
        c = copy.copy(self)
        c.remote = None
        return c

    def _paths(self, key: str, suffix: str) -> tuple[Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}{suffix}", d / f"{key}{suffix}.json"

    def get(self, key: str, suffix: str) -> bytes | None:
        """The verified artifact, or None (a miss; a corrupt entry is also deleted).

        An unreadable cache is a miss, not an error: the region is compiled instead.
        """
        hit = self._verified(key, suffix, read=True)
        return hit[0] if hit is not None else None

    def get_path(self, key: str, suffix: str) -> tuple[Path, int] | None:
        """:meth:`get`, verified by streaming the file: (path, size), never the bytes.

        For artifacts the consumer reads from disk itself (onnxruntime loads a model path with
        one copy fewer than from bytes; ``benchmarks.probes.compile_memory`` measured the compile's
        peak at 2.34x the weights against 3.04x before). Entries are replaced only atomically
        (``os.replace`` of a complete file), so the file the consumer opens is this verified
        one or a complete newer one for the key.
        """
        hit = self._verified(key, suffix, read=False)
        return (self._paths(key, suffix)[0], hit[1]) if hit is not None else None

    def _verified(self, key: str, suffix: str, read: bool) -> tuple[bytes | None, int] | None:
        """(the bytes if ``read``, the size) of an entry its manifest vouches for, else None."""
        art, man = self._paths(key, suffix)
        try:
            if not (art.is_file() and man.is_file()) and not self._pull(key, suffix):
                return None
            raw = man.read_bytes()
            data = art.read_bytes() if read else None
            digest = _checksum(data) if read else file_checksum(art)
            size = len(data) if read else art.stat().st_size
        except OSError:  # evicted meanwhile, or unreadable: compile instead
            return None
        why = _check_manifest(raw, digest, key, suffix)
        if why:
            return self._corrupt(art, man, why)
        with contextlib.suppress(OSError):  # least-recently-used eviction reads the mtime
            os.utime(art)
        USED.add((str(self.root), key, suffix))
        return data, size

    def _pull(self, key: str, suffix: str) -> bool:
        """Read-through: the remote's verified entry stored locally (not published back)."""
        if self.remote is None:
            return False
        data, why = self.remote.fetch(key, suffix)
        if why is not None:
            self.refused[key] = f"{suffix}: {why}"
        if data is None or self._store(key, suffix, (), data=data, publish=False) is None:
            return False
        self.origin[key] = "remote"
        return True

    def record(self, key: str, cached: bool) -> str:
        """Where a region's artifact came from (reports, ``explain``), counted in
        ``remote.STATS``: a local hit, a remote hit, or compiled (with the refusal, if any)."""
        from fxpass.jit.remote import STATS

        if cached:
            where = "remote hit" if self.origin.get(key) == "remote" else "local hit"
        else:
            why = self.refused.get(key)
            where = f"compiled (remote refused: {why})" if why else "compiled"
        STATS["region_" + where.split(" (")[0].replace(" ", "_")] += 1
        return where

    def has(self, key: str, suffix: str) -> bool:
        """Whether an entry exists here or in the remote tier (not verified: a hit does that)."""
        art, man = self._paths(key, suffix)
        if art.is_file() and man.is_file():
            return True
        return self.remote is not None and self.remote.exists(key, suffix)

    @contextlib.contextmanager
    def compiling(self, key: str) -> Iterator[None]:
        """Around a region's lookup and compile: with a remote tier, one process of a fleet
        compiles ``key`` while the others wait for its entry (bounded, ``remote.py``). A
        compile that publishes later (a background build) keeps the lock: :meth:`hold`."""
        token = self.remote.acquire(key) if self.remote is not None else None
        if token is not None:
            self._tokens[key] = token
        try:
            yield
        finally:
            token = self._tokens.pop(key, None)
            if token is not None:
                self.remote.release(key, token)

    def hold(self, key: str) -> Callable[[], None]:
        """Keep ``key``'s compile lock past :meth:`compiling`; call the result once the entry
        is stored (or its build failed). Without a lock held, a no-op."""
        token, remote = self._tokens.pop(key, None), self.remote
        return (lambda: remote.release(key, token)) if token and remote else (lambda: None)

    def put(self, key: str, suffix: str, data: bytes, keep: tuple[str, ...] = ()) -> Path | None:
        """Store ``data``; return its path, or None when the cache cannot be written.

        On None (warned once per directory per process) the caller keeps what it compiled in
        memory: an unwritable cache must not cost the region its offload. Eviction spares
        ``key`` and the entries in ``keep`` (a plan keeps the region artifacts it names).
        """
        return self._store(key, suffix, keep, data=data)

    def put_file(
        self, key: str, suffix: str, src: str | os.PathLike, keep: tuple[str, ...] = (),
        checksum: str | None = None,
    ) -> Path | None:
        """:meth:`put` of a file's contents, moved into place (not read into memory) when it
        is on the cache's filesystem (else copied; the caller removes ``src``). ``checksum``:
        the file's :func:`file_checksum` when the caller already has it (read once, not twice)."""
        return self._store(key, suffix, keep, src=src, checksum=checksum)

    def _store(
        self, key: str, suffix: str, keep: tuple[str, ...], data: bytes | None = None,
        src: str | os.PathLike | None = None, checksum: str | None = None,
        publish: bool = True,
    ) -> Path | None:
        art, man = self._paths(key, suffix)
        try:
            if checksum is None:
                checksum = _checksum(data) if src is None else file_checksum(src)
            manifest = {
                "checksum": checksum,
                "key": key,
                "suffix": suffix,
                "size": len(data) if src is None else os.path.getsize(src),
                "tools": tool_versions(),
            }
            art.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(art, data, src=src)
            _atomic_write(man, json.dumps(manifest).encode())
        except OSError as e:
            self.warn_unwritable(e)
            return None
        USED.add((str(self.root), key, suffix))
        if publish and self.remote is not None:  # write-through
            self.remote.publish(key, suffix, manifest, data, art)
        self._evict(keep={key, *keep})
        return art

    def stored_checksum(self, key: str, suffix: str) -> str | None:
        """The checksum an entry's manifest records (not verified here: :meth:`get_path` does
        that). A multi-file entry records its parts' checksums in its last file, so a hit can
        tell that its parts come from one store, not from two processes that raced."""
        try:
            m = json.loads(self._paths(key, suffix)[1].read_bytes())
        except (OSError, ValueError):
            return None
        c = m.get("checksum") if isinstance(m, dict) else None
        return c if isinstance(c, str) else None

    def discard(self, key: str, suffix: str) -> None:
        """Remove an entry (the part of a multi-file entry whose other parts were not stored)."""
        for p in self._paths(key, suffix):
            with contextlib.suppress(OSError):
                p.unlink()

    def path(self, key: str, suffix: str) -> Path:
        return self._paths(key, suffix)[0]

    def warn_unwritable(self, e: OSError) -> None:
        """Warn once per directory that compiled regions stay in memory only."""
        root = str(self.root)
        if root in _UNWRITABLE_WARNED:
            return
        _UNWRITABLE_WARNED.add(root)
        warnings.warn(
            f"fxpass: the artifact cache directory {root} is not writable "
            f"({type(e).__name__}: {e}); compiled regions are kept in memory only and are "
            "recompiled in every process. Make it a writable directory, or point the cache_dir "
            "option or FXPASS_CACHE_DIR at one (cache=False disables the cache)",
            stacklevel=4,
        )

    def _evict(self, keep: set[str]) -> None:
        """Bound the cache to ``max_bytes``: delete least-recently-used entries, oldest first.

        An entry is every file of one key (artifact, side artifacts, manifests), so a region's
        entry goes as a whole, and the entries in ``keep`` (the one just written, and those it
        names) are never evicted. A hit touches the artifact's mtime, which orders the entries.
        Temporary files older than an hour were left by crashed writers and are swept; younger
        ones are writes in flight.
        Only files named like cache entries (hex keys in their two-character directories) are
        considered, so a cache_dir shared with other files never loses them.
        """
        now = time.time()
        entries: dict[str, list[tuple[str, int, float]]] = {}
        total = 0
        try:
            top = list(os.scandir(self.root))
        except OSError:
            return
        subdirs = [d for d in top if len(d.name) == 2]
        for d in top:  # scratch directories of builds killed mid-way (each holds a model)
            if d.name.startswith(BUILD_PREFIX) and d.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    if now - d.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                        shutil.rmtree(d.path, ignore_errors=True)
        for sub in subdirs:
            if not _HEX.fullmatch(sub.name):
                continue
            try:
                files = list(os.scandir(sub.path))
            except OSError:
                continue
            for f in files:
                k = f.name.split(".", 1)[0]
                if not (k.startswith(sub.name) and _HEX.fullmatch(k)):
                    continue
                try:
                    if not f.is_file(follow_symlinks=False):
                        continue
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if f.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        with contextlib.suppress(OSError):
                            os.unlink(f.path)
                    continue
                entries.setdefault(k, []).append((f.path, st.st_size, st.st_mtime))
                total += st.st_size
        if total <= self.max_bytes:
            return
        lru = sorted((max(m for _, _, m in fs), k) for k, fs in entries.items() if k not in keep)
        for _, k in lru:
            if total <= self.max_bytes:
                break
            for p, size, _ in entries[k]:
                try:
                    os.unlink(p)
                except FileNotFoundError:  # another process evicted it first
                    pass
                except OSError:
                    continue
                total -= size

    @staticmethod
    def _corrupt(art: Path, man: Path, why: str) -> None:
        warnings.warn(
            f"fxpass: cached artifact {art} is corrupt ({why}); rebuilding it", stacklevel=3
        )
        for p in (art, man):
            with contextlib.suppress(OSError):
                p.unlink()
        return None


def _max_bytes(value: int | None) -> int:
    """The size bound: the argument, else ``$FXPASS_CACHE_MAX_BYTES``, else 2 GiB."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"ArtifactCache max_bytes must be a non-negative int (bytes), got {value!r}"
            )
        return value
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(
            f"{MAX_BYTES_ENV}={raw!r} is not a size: set it to a non-negative whole number of "
            f"bytes (e.g. {DEFAULT_MAX_BYTES} for 2 GiB), or unset it for the default"
        )
    return n


def _atomic_write(
    path: Path, data: bytes | None = None, src: str | os.PathLike | None = None
) -> None:
    """Put ``data``, or the file ``src`` (moved, else copied), at ``path`` atomically: a reader
    sees the old file or the complete new one, never a torn one.

    A moved (or copied) file is not fsynced: that forced the weights (290 MB) to disk inside
    the compile (the move took 0.18 s with it, 0.12-0.14 s without, in scratch runs) for
    crash durability alone, and a file a crash leaves incomplete fails the manifest's
    checksum that every hit verifies, so it is rebuilt."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        if src is None:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            os.close(fd)
            try:
                os.replace(src, tmp)
            except OSError:  # another filesystem
                shutil.copyfile(src, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def warn_unloadable(path: os.PathLike, e: Exception) -> None:
    warnings.warn(
        f"fxpass: cached artifact {path} does not load ({type(e).__name__}: {e}); rebuilding it",
        stacklevel=4,
    )
