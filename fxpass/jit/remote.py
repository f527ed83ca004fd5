"""The artifact cache's remote tier: one Redis shared by a fleet, under every local cache.

Why: the local cache (``cache.py``) saves a machine its second compile, but CI runners,
serving replicas and autoscaled pods rarely share a filesystem, so each compiled every region
for itself. With ``remote_cache="redis://host:6379/0"`` (or ``FXPASS_REMOTE_CACHE``;
``rediss://`` for TLS, credentials in the URL) a local miss asks Redis (read-through) and a
stored artifact is published (write-through).

Nothing read from the store is trusted. An entry is one Redis value: a magic line, an
optional HMAC (``FXPASS_REMOTE_CACHE_SECRET``), the same manifest a local entry has (key,
suffix, size, checksum, tool versions) and the artifact. It is used only if every field
matches what this process asked for and computed (:func:`check_manifest`: the key, which
covers the region graph, its weights, the options and the device's identity; the suffix;
this process's tool versions; the checksum; the size), else it is refused with the reason,
counted, and the region is compiled locally (and the good entry published over the bad one).

The store must never cost more than a bounded wait: every call has a socket timeout
(``socket_timeout`` in the URL's query overrides :data:`TIMEOUT_S`); the first failure of a
URL (down, slow, refusing) warns once and turns the tier off for the rest of the process, so
each region compiles locally. A full Redis (``maxmemory``) stops publishing only.

Only artifacts up to ``FXPASS_REMOTE_MAX_BYTES`` (default 16 MiB) are published: compiled
models and plans are kilobytes; larger ones are weight data (a host region's prepacked weights
file), which every client rebuilds from its own weights rather than download.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import os
import struct
import time
import uuid
import warnings
from collections import Counter
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ENV = "FXPASS_REMOTE_CACHE"
SECRET_ENV = "FXPASS_REMOTE_CACHE_SECRET"
MAX_BYTES_ENV = "FXPASS_REMOTE_MAX_BYTES"
LOCK_WAIT_ENV = "FXPASS_REMOTE_LOCK_WAIT"
DEFAULT_MAX_BYTES = 16 << 20
TIMEOUT_S = 1.0  # per Redis call: a slow or dead server costs at most this, once
LOCK_EXPIRY_S = 300.0  # a holder killed mid-compile frees its regions after this
DEFAULT_LOCK_WAIT_S = 60.0  # a waiter compiles itself after this
POLL_S = 0.05
SCHEMES = ("redis", "rediss", "unix")
MAGIC = b"FXPASS-ENTRY-1\n"
_MAC = 32  # HMAC-SHA256 bytes (zeros when no secret is set)
_HEAD = len(MAGIC) + _MAC + 4
_RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) else return 0 end")
INSTALL = 'pip install "fxpass[fleet]"'

#: What the cache tiers did in this process, beside ``backend.STATS``: per region
#: "region_local_hit", "region_remote_hit", "region_compiled"; per artifact "remote_hit",
#: "remote_miss", "remote_refused", "remote_published", "remote_too_large" (kept local);
#: "remote_errors", "lock_waits", "lock_timeouts"; "bundle_imported", "bundle_refused".
STATS: Counter[str] = Counter()
#: URLs warned about as unusable in this process (one warning each)
_DOWN: set[str] = set()
#: locks this process holds: (url, key) -> token (a second compile of the key here never waits)
_MINE: dict[tuple[str, str], str] = {}


def url_from(option: str | None) -> str | None:
    """The remote cache URL: the option, else ``$FXPASS_REMOTE_CACHE``, else None (no tier).
    A URL of another scheme is a ValueError naming the accepted ones."""
    url = option if option is not None else os.environ.get(ENV, "")
    url = url.strip()
    if not url:
        return None
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        src = "option remote_cache" if option is not None else ENV
        raise ValueError(f"{src}={redact(url)!r} is not a Redis URL; want "
                         "redis://[user:password@]host:6379/0, rediss://... (TLS) or "
                         "unix:///path/redis.sock")
    return url


def redact(url: str) -> str:
    """``url`` without its password (for messages and reports)."""
    p = urlsplit(url)
    if p.password is None:
        return url
    host = p.hostname or ""
    netloc = f"{p.username or ''}:***@{host}" + (f":{p.port}" if p.port else "")
    return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))


def _positive(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    try:
        v = float(raw) if raw else default
    except ValueError:
        v = -1.0
    if not v >= 0:
        raise ValueError(f"{env}={raw!r} is not a number >= 0; unset it for {default}")
    return v


def import_redis() -> Any:
    """The ``redis`` package, or one ImportError saying how to install it."""
    try:
        import redis
    except ImportError as e:
        raise ImportError(f"a remote artifact cache is configured (option remote_cache or "
                          f"{ENV}) but the redis client is not installed ({e}); install it "
                          f"with {INSTALL}, or unset the remote cache") from None
    return redis


class RemoteTier:
    """One Redis URL's reads, publications and compile locks, each bounded and verified."""

    def __init__(self, url: str) -> None:
        self.url, self.name = url, redact(url)
        self.max_bytes = int(_positive(MAX_BYTES_ENV, DEFAULT_MAX_BYTES))
        self.lock_wait = _positive(LOCK_WAIT_ENV, DEFAULT_LOCK_WAIT_S)
        secret = os.environ.get(SECRET_ENV, "")
        self.secret = secret.encode() if secret else None
        self.prefix = "fxpass:"
        self.full = False  # a full Redis: reads go on, publishing stops
        self._client: Any = None
        self._redis = import_redis()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = self._redis.Redis.from_url(
                self.url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S,
                retry_on_timeout=False)
        return self._client

    @property
    def up(self) -> bool:
        return self.url not in _DOWN

    def _call(self, fn: Any, default: Any = None) -> Any:
        """``fn(client)``, or ``default`` once the URL has failed (warned once)."""
        if not self.up:
            return default
        try:
            return fn(self.client)
        except (self._redis.RedisError, OSError) as e:
            STATS["remote_errors"] += 1
            oom = getattr(self._redis.exceptions, "OutOfMemoryError", ())
            if isinstance(e, oom) or "OOM" in str(e):  # maxmemory: keep reading, stop writing
                if not self.full:
                    self.full = True
                    warnings.warn(f"fxpass: the remote artifact cache {self.name} is full ({e});"
                                  " compiled regions stay local", stacklevel=4)
                return default
            _DOWN.add(self.url)
            warnings.warn(
                f"fxpass: the remote artifact cache {self.name} is unusable "
                f"({type(e).__name__}: {e}); regions compile locally, and this process does "
                "not ask it again", stacklevel=4)
            return default

    def _name(self, key: str, suffix: str) -> str:
        return f"{self.prefix}a:{key}{suffix}"

    # -- entries ---------------------------------------------------------------------------

    def fetch(self, key: str, suffix: str) -> tuple[bytes | None, str | None]:
        """(the verified artifact, None), (None, why it was refused), or (None, None): a miss."""
        if not self.up:
            return None, None
        raw = self._call(lambda c: c.get(self._name(key, suffix)))
        if raw is None:
            STATS["remote_miss"] += 1
            return None, None
        data, why = self.unpack(raw, key, suffix)
        if why is not None:
            STATS["remote_refused"] += 1
            warnings.warn(f"fxpass: remote cache entry {key[:16]}...{suffix} refused ({why}); "
                          "compiling it locally", stacklevel=4)
            return None, why
        STATS["remote_hit"] += 1
        return data, None

    def exists(self, key: str, suffix: str) -> bool:
        return bool(self._call(lambda c: c.exists(self._name(key, suffix)), 0))

    def publish(self, key: str, suffix: str, manifest: dict, data: bytes | None,
                path: os.PathLike | str | None = None) -> bool:
        """Write-through of a stored artifact; False when too large (kept local) or failed."""
        size = manifest["size"]
        if size > self.max_bytes:
            STATS["remote_too_large"] += 1
            return False
        if self.full or not self.up:
            return False
        if data is None:
            try:
                with open(path, "rb") as f:  # type: ignore[arg-type]
                    data = f.read()
            except OSError:
                return False
        value = self.pack(manifest, data)
        ok = self._call(lambda c: c.set(self._name(key, suffix), value), False)
        if ok:
            STATS["remote_published"] += 1
        return bool(ok)

    def pack(self, manifest: dict, data: bytes) -> bytes:
        m = json.dumps(manifest, sort_keys=True).encode()
        return MAGIC + self._mac(m, data) + struct.pack(">I", len(m)) + m + data

    def _mac(self, manifest: bytes, data: bytes) -> bytes:
        if self.secret is None:
            return bytes(_MAC)
        h = hmac.new(self.secret, manifest, hashlib.sha256)
        h.update(data)
        return h.digest()

    def unpack(self, raw: bytes, key: str, suffix: str) -> tuple[bytes | None, str | None]:
        """The artifact in ``raw`` if it is the verified entry of ``key``/``suffix``, else
        (None, why). Every field is checked against this process's own view."""
        from fxpass.jit.verify import check_manifest, checksum

        if not isinstance(raw, bytes) or len(raw) < _HEAD:
            return None, f"truncated entry ({len(raw) if isinstance(raw, bytes) else '?'} bytes)"
        if not raw.startswith(MAGIC):
            return None, "not an fxpass cache entry (bad magic)"
        mac = raw[len(MAGIC):len(MAGIC) + _MAC]
        (n,) = struct.unpack(">I", raw[_HEAD - 4:_HEAD])
        if _HEAD + n > len(raw):
            return None, "truncated entry (manifest cut)"
        m, data = raw[_HEAD:_HEAD + n], raw[_HEAD + n:]
        if self.secret is not None and not hmac.compare_digest(mac, self._mac(m, data)):
            return None, f"signature does not match {SECRET_ENV}"
        try:
            size = json.loads(m).get("size")
        except (ValueError, AttributeError, UnicodeDecodeError):
            size = None
        if isinstance(size, int) and size != len(data):
            return None, f"truncated entry ({len(data)} of {size} bytes)"
        why = check_manifest(m, checksum(data), key, suffix)
        return (None, why) if why else (data, None)

    # -- locks -----------------------------------------------------------------------------

    def acquire(self, key: str) -> str | None:
        """Take the compile lock of ``key`` (a token), or wait while another process holds it
        (None: go on, its entry is published or it is gone). A wait longer than
        ``lock_wait`` gives up (counted) and the caller compiles itself."""
        if (self.url, key) in _MINE or not self.up:
            return None
        name, token = f"{self.prefix}lock:{key}", uuid.uuid4().hex
        px = int(LOCK_EXPIRY_S * 1000)
        got = self._call(lambda c: bool(c.set(name, token, nx=True, px=px)), None)
        if got:
            _MINE[(self.url, key)] = token
            return token
        if got is None:  # the store failed (warned): compile without a lock
            return None
        STATS["lock_waits"] += 1
        deadline = time.monotonic() + self.lock_wait
        while self._call(lambda c: c.exists(name), 0):
            if time.monotonic() > deadline:
                STATS["lock_timeouts"] += 1
                warnings.warn(f"fxpass: waited {self.lock_wait:.0f} s for another process to "
                              f"compile region {key[:16]}...; compiling it here",
                              stacklevel=4)
                return None
            time.sleep(POLL_S)
        return None

    def release(self, key: str, token: str) -> None:
        if _MINE.get((self.url, key)) == token:
            del _MINE[(self.url, key)]
        self._call(lambda c: c.eval(_RELEASE, 1, f"{self.prefix}lock:{key}", token))


def locate(cache: Any, key: str) -> str:
    """Where a compile would find region ``key`` (``explain``): "local hit" (a verified local
    entry), "remote hit" (verified remote entries), "remote refused (why)", or "compiled"."""
    import glob

    local = glob.glob(os.path.join(glob.escape(str(cache.root / key[:2])), f"{key}.*.json"))
    suffixes = ["." + os.path.basename(m)[len(key) + 1:-len(".json")] for m in local
                if os.path.isfile(m[:-len(".json")])]  # manifests, not a .json artifact
    if suffixes and all(cache.local_only().get_path(key, s) for s in suffixes):
        return "local hit"
    t = cache.remote
    if t is None:
        return "compiled"
    names = t._call(lambda c: list(c.scan_iter(match=f"{t.prefix}a:{key}.*", count=100)), [])
    if not names:
        return "compiled"
    for n in names:
        suffix = n.decode()[len(f"{t.prefix}a:{key}"):]
        raw = t._call(lambda c, n=n: c.get(n))
        why = t.unpack(raw, key, suffix)[1] if raw is not None else "gone"
        if why is not None:
            return f"compiled (remote refused: {suffix}: {why})"
    return "remote hit"


_TIERS: dict[str, RemoteTier] = {}


def tier(url: str | None) -> RemoteTier | None:
    """The process's one :class:`RemoteTier` of ``url`` (its client, failure state, locks)."""
    if url is None:
        return None
    t = _TIERS.get(url)
    if t is None:
        t = _TIERS[url] = RemoteTier(url)
    return t


@atexit.register
def _release_all() -> None:
    """Locks still held at exit (a compile whose background build never ran) are freed."""
    for (url, key), token in list(_MINE.items()):
        t = _TIERS.get(url)
        if t is not None:
            t.release(key, token)
