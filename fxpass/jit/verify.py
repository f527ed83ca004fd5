"""What makes a cache entry trustworthy, shared by the local cache (``cache.py``), its remote
tier (``remote.py``) and bundles (``bundle.py``): the tool versions an entry records, its
checksum, and the manifest check every hit passes. One module, so the three tiers cannot
drift apart in what they accept, and the remote tier need not import the cache."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

# 10: host models carry RotaryEmbedding, one-row regions prepack (tiered);
# 9: host entries may be the lowering's own model ("optimized": false), small weights packed;
# 5: host models carry the fused Attention; 4: fast checksums (digest.py) and cached plans;
# 3: manifests with key
CACHE_VERSION = "12"


def tool_versions() -> dict[str, str]:
    """Versions of the framework's tools that shape every artifact (fxpass, torch, the cache
    format). A device's own tools are in its identity (``Device.identity``), which every key
    covers."""
    import fxpass

    return {"fxpass": fxpass.__version__, "torch": torch.__version__, "cache": CACHE_VERSION}


def check_manifest(raw: bytes, digest: str, key: str, suffix: str) -> str | None:
    """Why the manifest does not vouch for an artifact of checksum ``digest`` as
    ``key``/``suffix``, or None if it does.

    Checking the key and suffix catches an artifact filed under another key or kind (it would
    run as this region); any malformed manifest is corruption, never an uncaught error.
    """
    try:
        m = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        return f"unreadable manifest ({e})"
    if not isinstance(m, dict):
        return f"malformed manifest (a JSON {type(m).__name__}, not an object)"
    fields = {"checksum": str, "key": str, "suffix": str, "tools": dict}
    bad = [f for f, t in fields.items() if not isinstance(m.get(f), t)]
    if bad:
        return f"malformed manifest (missing or mistyped {', '.join(bad)})"
    if m["key"] != key:
        return f"manifest is for key {m['key'][:16]}..., filed under {key[:16]}..."
    if m["suffix"] != suffix:
        return f"manifest is for a {m['suffix']!r} artifact, not {suffix!r}"
    if m["tools"] != tool_versions():
        return "manifest records other tool versions than its key"
    if digest != m["checksum"]:
        return "checksum mismatch"
    return None


def checksum(data: bytes) -> str:
    """``"<algorithm>:<hex>"`` of ``data``: verified on every hit, so it uses the fast hash
    (xxh3-128 reads a 290 MB artifact in ~0.1 s here; sha256 took 0.45 s). It guards against
    torn or damaged files, not against someone who can write the cache directory."""
    c = Checksum()
    c.update(data)
    return c.value()


class Checksum:
    """:func:`file_checksum` of bytes fed in order with :meth:`update`: a file's checksum made
    while it is written, so it is not read back."""

    def __init__(self) -> None:
        from fxpass.jit.digest import HASH_NAME, hasher

        self._h, self._name = hasher(), HASH_NAME

    def update(self, data: Any) -> None:
        self._h.update(data)

    def value(self) -> str:
        return f"{self._name}:{self._h.hexdigest()}"


def file_checksum(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """:func:`_checksum` of a file's contents, read in chunks into one reused buffer."""
    c, buf = Checksum(), bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            c.update(view[:n])
    return c.value()
