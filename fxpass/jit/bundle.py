"""A portable bundle of verified cache entries: preload a machine that has no network.

Why: the remote tier (``remote.py``) needs a reachable Redis; an air-gapped box, a container
image build or a CI cache step needs a file instead (what ``torch.compiler``'s Mega-Cache,
``save_cache_artifacts`` / ``load_cache_artifacts``, gives inductor). :func:`export_bundle`
writes every entry a process used (or a whole cache directory) into one tar file;
:func:`import_bundle` reads it into a cache directory with the same verification as a remote
entry: each artifact must come with its manifest, and its key, suffix, tool versions, size and
checksum must match, else it is refused (counted, with the reason) and that region compiles.
Member names are checked before anything is written (no paths, links or other kinds), and each
entry is stored atomically like a compiled one.

The bundle holds every file of an entry, weights files too (unlike the remote tier, which
publishes only what a client cannot rebuild cheaply): a process that imports it compiles
nothing, not even in the background.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time
from pathlib import Path

from fxpass.jit.cache import USED, ArtifactCache
from fxpass.jit.remote import STATS
from fxpass.jit.verify import check_manifest, checksum

#: a member's name: ``entries/<hex key><suffix>`` or ``manifests/<hex key><suffix>.json``
_MEMBER = re.compile(r"(entries|manifests)/([0-9a-f]{16,128})(\.[a-z][a-z0-9_.]{0,40})")
#: a member larger than this is refused unread (no artifact of a region is near it)
MAX_MEMBER_BYTES = 16 << 30
FORMAT = "fxpass-cache-bundle-1"


def export_bundle(out: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  used_only: bool = True) -> dict:
    """Write the cache's verified entries into the tar file ``out``; returns a summary.

    ``used_only``: only the entries this process read or stored (a warm-up run's set, like
    Mega-Cache); False: every verified entry of ``cache_dir`` (the CLI's ``fxpass cache
    export``, which runs in a process of its own). An entry that fails verification is left
    out, never bundled."""
    cache = ArtifactCache(cache_dir, remote=False)
    root = str(cache.root)
    if used_only:
        wanted = sorted((k, s) for r, k, s in USED if r == root)
    else:
        wanted = sorted(_entries(cache.root))
    summary = {"format": FORMAT, "entries": 0, "bytes": 0, "skipped": []}
    tmp = Path(f"{out}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w") as tar:
        for key, suffix in wanted:
            hit = cache.get_path(key, suffix)  # verified by streaming
            if hit is None:
                summary["skipped"].append(f"{key}{suffix}")
                continue
            path, size = hit
            tar.add(path, arcname=f"entries/{key}{suffix}")
            tar.add(f"{path}.json", arcname=f"manifests/{key}{suffix}.json")
            summary["entries"] += 1
            summary["bytes"] += size
        info = json.dumps({**summary, "created": time.time()}).encode()
        member = tarfile.TarInfo("bundle.json")
        member.size = len(info)
        tar.addfile(member, io.BytesIO(info))
    os.replace(tmp, out)
    return summary


def import_bundle(src: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> dict:
    """Verify and store every entry of the bundle ``src`` in the cache; returns a summary
    with the refused entries and why. Nothing unverified is written."""
    cache = ArtifactCache(cache_dir, remote=False)
    arts: dict[tuple[str, str], tarfile.TarInfo] = {}
    mans: dict[tuple[str, str], tarfile.TarInfo] = {}
    refused: list[str] = []
    summary = {"imported": 0, "bytes": 0, "refused": refused}
    with tarfile.open(src, "r:*") as tar:
        for m in tar:
            if m.name == "bundle.json":
                continue
            match = _MEMBER.fullmatch(m.name)
            if match is None or not m.isfile() or m.size > MAX_MEMBER_BYTES:
                refused.append(f"{m.name[:80]}: not a bundle entry (name, kind or size)")
                continue
            kind, key, suffix = match.groups()
            if kind == "manifests":
                if not suffix.endswith(".json"):
                    refused.append(f"{m.name[:80]}: a manifest's name ends in .json")
                    continue
                mans[(key, suffix[:-len(".json")])] = m
            else:
                arts[(key, suffix)] = m
        for (key, suffix), m in sorted(arts.items()):
            man = mans.get((key, suffix))
            why = "no manifest" if man is None else None
            if why is None:
                data = tar.extractfile(m).read()  # type: ignore[union-attr]
                raw = tar.extractfile(man).read()  # type: ignore[union-attr]
                why = _check(raw, data, key, suffix)
            if why is not None:
                refused.append(f"{key[:16]}...{suffix}: {why}")
                STATS["bundle_refused"] += 1
                continue
            if cache.put(key, suffix, data, keep=tuple(k for k, _ in arts)) is None:
                refused.append(f"{key[:16]}...{suffix}: the cache directory is not writable")
                continue
            STATS["bundle_imported"] += 1
            summary["imported"] += 1
            summary["bytes"] += len(data)
    return summary


def _check(raw: bytes, data: bytes, key: str, suffix: str) -> str | None:
    why = check_manifest(raw, checksum(data), key, suffix)
    if why is None:
        size = json.loads(raw).get("size")
        if isinstance(size, int) and size != len(data):
            why = f"truncated entry ({len(data)} of {size} bytes)"
    return why


def _entries(root: Path) -> set[tuple[str, str]]:
    """(key, suffix) of every artifact file under ``root`` (its manifest beside it)."""
    out = set()
    for man in root.glob("??/*.json"):
        name = man.name[:-len(".json")]
        key, dot, suffix = name.partition(".")
        if dot and re.fullmatch(r"[0-9a-f]+", key) and (man.parent / name).is_file():
            out.add((key, "." + suffix))
    return out
