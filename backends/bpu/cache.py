"""Artifact cache: content-addressed, atomic, verified on load.

The key covers everything that changes the artifact: the region graph *with node arguments*
(eps, dims, strides), a full digest of every weight (not a sample), input shapes and dtypes,
march, options, the rule-set version and the versions of every tool in the flow. Writes go to
a temporary file in the same directory and are renamed into place, so a reader never sees a
partial artifact and two processes compiling the same region race harmlessly. Each artifact
has a manifest with its SHA-256; a mismatch on load is reported and the artifact rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

CACHE_VERSION = "2"


def default_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("FXPASS_CACHE_DIR") or user_cache_dir("fxpass")) / "bpu"


def tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    import fxpass

    v = {
        "fxpass": fxpass.__version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "cache": CACHE_VERSION,
    }
    with contextlib.suppress(ImportError):  # the host fusions' version shapes the artifact
        import onnxscript

        v["onnxscript"] = onnxscript.__version__
    try:
        import hbdk4.compiler as hb  # noqa: F401

        v["hbdk4"] = getattr(__import__("hbdk4"), "__version__", "unknown")
    except ImportError:
        pass
    return v


def region_key(gm: GraphModule, **context: Any) -> str:
    """Digest of the region graph (structure and arguments), its weights and the context."""
    h = hashlib.blake2b(digest_size=24)
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        meta = (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None
        h.update(
            repr((n.op, n.name, str(n.target), n.args, sorted(n.kwargs.items()), meta)).encode()
        )
    tensors = dict(gm.named_parameters())
    tensors.update(gm.named_buffers())
    for name, buf in sorted(tensors.items()):
        t = buf.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(
        json.dumps({**context, "tools": tool_versions()}, sort_keys=True, default=str).encode()
    )
    return h.hexdigest()


class ArtifactCache:
    """``get``/``put`` of bytes by key under ``root`` (atomic, verified)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_dir()

    def _paths(self, key: str, suffix: str) -> tuple[Path, Path]:
        d = self.root / key[:2]
        return d / f"{key}{suffix}", d / f"{key}{suffix}.json"

    def get(self, key: str, suffix: str) -> bytes | None:
        art, man = self._paths(key, suffix)
        if not art.exists() or not man.exists():
            return None
        try:
            data = art.read_bytes()
            want = json.loads(man.read_text())["sha256"]
        except (OSError, ValueError, KeyError) as e:
            return self._corrupt(art, man, f"unreadable manifest or artifact ({e})")
        if hashlib.sha256(data).hexdigest() != want:
            return self._corrupt(art, man, "checksum mismatch")
        return data

    def put(self, key: str, suffix: str, data: bytes) -> Path:
        art, man = self._paths(key, suffix)
        art.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(art, data)
        _atomic_write(
            man,
            json.dumps(
                {"sha256": hashlib.sha256(data).hexdigest(), "key": key, "tools": tool_versions()}
            ).encode(),
        )
        return art

    def path(self, key: str, suffix: str) -> Path:
        return self._paths(key, suffix)[0]

    @staticmethod
    def _corrupt(art: Path, man: Path, why: str) -> None:
        warnings.warn(
            f"fxpass: cached artifact {art} is corrupt ({why}); rebuilding it", stacklevel=3
        )
        for p in (art, man):
            with contextlib.suppress(OSError):
                p.unlink()
        return None


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
