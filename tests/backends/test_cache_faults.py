"""Artifact-cache faults: none may cost a wrong answer or a region's offload.

Misfiled or malformed entries are corrupt (warned, deleted, rebuilt); an unwritable cache keeps
the compiled region in memory and warns once; ``cache=False`` never touches the user cache; an
empty ``cache_dir`` is refused; the cache is bounded with least-recently-used eviction.
"""

import errno
import gc
import json
import os
import shutil
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch

import fxpass
from fxpass.backends.bpu import board
from fxpass.backends.onnx.host import build as compile_mod
from fxpass.jit import cache as cache_mod
from fxpass.jit.cache import ArtifactCache, region_key
from tests.backends import fake_hbdk4

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
    ).eval()


def _compile(m, **options):
    """Compile afresh (new Dynamo graph), run once; return the error vs eager and the report."""
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(
            m, backend="fxpass_bpu", dynamic=False, options={"min_compute_macs": 0, **options}
        )(X)
        err = (got - m(X)).abs().max().item()
    return err, fxpass.compile_reports()[-1]


#: The board path quantizes (w8a16, issue 11): a calibrated MLP's error vs eager float.
QUANT_ATOL = 5e-2


def _compile_board(m, **options):
    """Like _compile on the board path, which needs calibrate() before hbdk4 sees a region."""
    from fxpass.backends.bpu import calibrate

    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(
            m,
            backend="fxpass_bpu",
            dynamic=False,
            options={"min_compute_macs": 0, "executor": "hbdnn", **options},
        )
        calibrate(fn, [X])
        err = (fn(X) - m(X)).abs().max().item()
    return err, fxpass.compile_reports()[-1]


def _files(d: Path) -> list[Path]:
    """The region artifacts and their manifests (not the graph's cached plan, plan.py)."""
    if not d.exists():
        return []
    return sorted(p for p in d.rglob("*") if p.is_file() and ".plan." not in p.name)


def _offloaded(r, kind="onnxruntime"):
    return r.regions and all(g.fallback is None and g.executor == kind for g in r.regions)


# 1. an artifact filed under the wrong key --------------------------------------------------


def test_artifact_copied_under_another_key_is_corrupt_not_a_hit(tmp_path):
    a, b = _mlp(1), _mlp(2)
    da, db = tmp_path / "a", tmp_path / "b"
    assert _compile(a, cache_dir=str(da))[0] < 1e-5
    assert _compile(b, cache_dir=str(db))[0] < 1e-5
    key_a = _files(da)[0].name.split(".")[0]
    key_b = _files(db)[0].name.split(".")[0]
    assert key_a != key_b
    for p in _files(db):
        p.unlink()
    for p in _files(da):  # a's artifacts and manifests, filed under b's key
        dst = db / key_b[:2] / p.name.replace(key_a, key_b)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst)
    with pytest.warns(UserWarning, match="corrupt"):
        err, r = _compile(b, cache_dir=str(db))
    assert err < 1e-5, "another region's artifact was run"
    assert _offloaded(r) and r.regions[0].cached is False
    err, r = _compile(b, cache_dir=str(db))  # rebuilt under the right key
    assert err < 1e-5 and r.regions[0].cached is True


def test_manifest_suffix_and_tool_versions_are_checked(tmp_path):
    c = ArtifactCache(tmp_path)
    c.put("k1", ".a", b"payload")
    art, man = c._paths("k1", ".a")
    art_b, man_b = c._paths("k1", ".b")
    shutil.copy(art, art_b)
    shutil.copy(man, man_b)
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get("k1", ".b") is None  # an artifact of another kind
    assert c.get("k1", ".a") == b"payload"
    m = json.loads(man.read_text())
    m["tools"]["onnxruntime"] = "0.0.1"
    man.write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get("k1", ".a") is None  # written by other tools than the key says
    assert not art.exists() and not man.exists()


def test_onnxruntime_key_covers_the_host_cpu(monkeypatch):
    g = torch.fx.symbolic_trace(torch.nn.Linear(8, 8))
    fp = cache_mod.host_cpu_fingerprint()
    assert isinstance(fp, str) and fp and cache_mod.host_cpu_fingerprint() is fp  # once
    ort = region_key(g, executor="onnxruntime", host=True)
    hbm = region_key(g, executor="hbdnn", host=False)
    monkeypatch.setattr(cache_mod, "host_cpu_fingerprint", lambda: "other-cpu")
    # ORT-optimized models are host-bound (a device that runs on the host CPU)
    assert region_key(g, executor="onnxruntime", host=True) != ort
    assert region_key(g, executor="hbdnn", host=False) == hbm  # the board artifact is not


# 2. malformed manifests ----------------------------------------------------------------------

MALFORMED = [
    "[]",
    "{}",
    "null",
    '"checksum"',
    "3",
    '{"checksum": 5}',
    '{"checksum": ["x"], "key": "k"}',
    '{"checksum": "SHA", "key": ["k"], "suffix": ".a", "tools": {}}',
    '{"checksum": "SHA", "key": "k", "suffix": ".a", "tools": []}',
    '{"checksum": "SHA", "key": "k", "suffix": 1, "tools": "TOOLS"}',
    b"\xff\xfe\x00",
]


@pytest.mark.parametrize("text", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_manifest_is_corrupt_and_rebuilt(tmp_path, text):
    c = ArtifactCache(tmp_path)
    c.put("k", ".a", b"payload")
    art, man = c._paths("k", ".a")
    good = json.loads(man.read_text())
    if isinstance(text, bytes):
        man.write_bytes(text)
    else:
        text = text.replace('"SHA"', json.dumps(good["checksum"]))
        man.write_text(text.replace('"TOOLS"', json.dumps(good["tools"])))
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get("k", ".a") is None
    assert not art.exists() and not man.exists()
    c.put("k", ".a", b"payload")
    assert c.get("k", ".a") == b"payload"


def test_malformed_manifest_end_to_end_is_rebuilt_not_eager(tmp_path):
    m = _mlp(3)
    d = tmp_path / "c"
    _compile(m, cache_dir=str(d))
    for p in d.rglob("*.json.json"):
        p.write_text("[]")
    for p in d.rglob("*.onnx.json"):
        p.write_text("[]")
    with pytest.warns(UserWarning, match="corrupt"):
        err, r = _compile(m, cache_dir=str(d))
    assert err < 1e-5 and _offloaded(r) and r.regions[0].cached is False
    err, r = _compile(m, cache_dir=str(d))
    assert err < 1e-5 and r.regions[0].cached is True


# 3. an unwritable cache ----------------------------------------------------------------------


def _unwritable(kind: str, tmp_path: Path, monkeypatch) -> tuple[dict, str]:
    if kind == "file":
        f = tmp_path / "not-a-dir"
        f.write_text("x")
        return {"cache_dir": str(f)}, str(f)
    if kind == "devnull":
        monkeypatch.setenv("FXPASS_CACHE_DIR", "/dev/null")
        return {}, "/dev/null"
    if kind == "erofs":  # a read-only filesystem, which refuses root too

        def refuse(path, *_, **__):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        monkeypatch.setattr(cache_mod, "_atomic_write", refuse)
        return {"cache_dir": str(tmp_path / "ro-fs")}, str(tmp_path / "ro-fs")
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500 if kind == "readonly" else 0o000)
    return {"cache_dir": str(d)}, str(d)


@pytest.mark.parametrize("kind", ["file", "devnull", "erofs", "readonly", "unreadable"])
def test_unwritable_cache_keeps_regions_in_memory_and_warns_once(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(cache_mod, "_UNWRITABLE_WARNED", set(), raising=False)
    options, where = _unwritable(kind, tmp_path, monkeypatch)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for seed in (4, 5, 6):  # three graphs, three regions, one warning
                err, r = _compile(_mlp(seed), **options)
                assert err < 1e-5 and _offloaded(r), str(r)
    finally:
        for p in tmp_path.iterdir():
            p.chmod(0o700)
    msgs = [str(x.message) for x in w if "not writable" in str(x.message)]
    assert len(msgs) == 1, [str(x.message) for x in w]
    assert where in msgs[0] and "FXPASS_CACHE_DIR" in msgs[0]
    assert not [x for x in w if "eager" in str(x.message)]


def test_unwritable_cache_on_the_board_path(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "_UNWRITABLE_WARNED", set(), raising=False)
    fake_hbdk4.install(monkeypatch)
    options, _ = _unwritable("file", tmp_path, monkeypatch)
    with pytest.warns(UserWarning, match="not writable"):
        err, r = _compile_board(_mlp(7), **options)
    assert err < QUANT_ATOL and _offloaded(r, "hbdnn"), str(r)


# 4. cache=False on the board path ------------------------------------------------------------


def test_cache_false_on_the_board_path_never_writes_the_user_cache(tmp_path, monkeypatch):
    user = tmp_path / "user-cache"
    monkeypatch.setenv("FXPASS_CACHE_DIR", str(user))
    monkeypatch.chdir(tmp_path)
    fake_hbdk4.install(monkeypatch)
    seen = []

    class Recording(board.HbmExecutor):
        def __init__(self, hbm_path, input_names):
            super().__init__(hbm_path, input_names)
            seen.append((hbm_path, weakref.ref(self)))

    monkeypatch.setattr(board, "HbmExecutor", Recording)
    m = _mlp(8)
    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(
            m,
            backend="fxpass_bpu",
            dynamic=False,
            options={"min_compute_macs": 0, "executor": "hbdnn", "cache": False},
        )
        from fxpass.backends.bpu import calibrate

        calibrate(fn, [X])  # the board path quantizes: hbdk4 sees the calibrated region
        torch.testing.assert_close(fn(X), m(X), rtol=0, atol=QUANT_ATOL)
        assert _offloaded(fxpass.compile_reports()[-1], "hbdnn")
        assert seen
        for path, _ in seen:  # the executor's file is there as long as the executor is
            assert Path(path).is_file() and user not in Path(path).parents
        torch.testing.assert_close(fn(X), m(X), rtol=0, atol=QUANT_ATOL)
    assert _files(user) == [] and sorted(tmp_path.iterdir()) == []
    del fn
    torch._dynamo.reset()
    gc.collect()
    for path, ref in seen:
        if ref() is None:  # the temporary directory goes with its executor
            assert not Path(path).exists()


# 5. cache_dir="" -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "  "])
def test_empty_cache_dir_is_refused(tmp_path, monkeypatch, bad):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cache_dir"):
        ArtifactCache(bad)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="cache_dir"):
        torch.compile(
            _mlp(9),
            backend="fxpass_bpu",
            dynamic=False,
            options={"min_compute_macs": 0, "cache_dir": bad},
        )(X)
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory


# 6. size bound, LRU eviction, stale temporaries ----------------------------------------------


def test_max_bytes_default_env_and_argument(monkeypatch, tmp_path):
    monkeypatch.delenv("FXPASS_CACHE_MAX_BYTES", raising=False)
    assert ArtifactCache(tmp_path).max_bytes == 2 * 1024**3
    monkeypatch.setenv("FXPASS_CACHE_MAX_BYTES", "12345")
    assert ArtifactCache(tmp_path).max_bytes == 12345
    assert ArtifactCache(tmp_path, max_bytes=99).max_bytes == 99
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv("FXPASS_CACHE_MAX_BYTES", bad)
        with pytest.raises(ValueError, match="FXPASS_CACHE_MAX_BYTES"):
            ArtifactCache(tmp_path)
    monkeypatch.delenv("FXPASS_CACHE_MAX_BYTES")
    with pytest.raises(ValueError, match="max_bytes"):
        ArtifactCache(tmp_path, max_bytes=-1)


def _age(c: ArtifactCache, key: str, suffix: str, seconds: float) -> None:
    t = time.time() - seconds
    for p in c._paths(key, suffix):
        os.utime(p, (t, t))


def test_lru_eviction_keeps_recently_used_and_just_written(tmp_path):
    c = ArtifactCache(tmp_path, max_bytes=10**9)
    blob = b"x" * 4000
    for k in ("aa1", "bb2"):
        c.put(k, ".a", blob)
    entry = sum(p.stat().st_size for p in c._paths("aa1", ".a"))
    _age(c, "aa1", ".a", 300)
    _age(c, "bb2", ".a", 200)
    assert c.get("aa1", ".a") == blob  # a hit makes aa1 the most recently used
    assert c._paths("aa1", ".a")[0].stat().st_mtime > time.time() - 60
    c.max_bytes = 2 * entry + entry // 2  # room for two entries
    c.put("cc3", ".a", blob)
    assert c.get("bb2", ".a") is None  # the least recently used went
    assert c.get("aa1", ".a") == blob and c.get("cc3", ".a") == blob
    c.max_bytes = 1  # smaller than any entry: the one just written still stays
    c.put("dd4", ".a", blob)
    c.put("dd4", ".b", b"side artifact of the same entry")
    assert c.get("dd4", ".a") == blob and c.get("dd4", ".b") is not None
    assert c.get("aa1", ".a") is None and c.get("cc3", ".a") is None


def test_stale_temporaries_are_swept(tmp_path):
    c = ArtifactCache(tmp_path)
    c.put("ab1", ".a", b"1")
    old, fresh = tmp_path / "ab" / "ab9.a.x1.tmp", tmp_path / "ab" / "ab9.a.x2.tmp"
    old.write_bytes(b"crashed writer")
    fresh.write_bytes(b"writing now")
    t = time.time() - 2 * 3600
    os.utime(old, (t, t))
    c.put("ab2", ".a", b"2")
    assert not old.exists() and fresh.exists()


def test_size_bound_never_costs_the_entry_just_written(tmp_path, monkeypatch):
    monkeypatch.setenv("FXPASS_CACHE_MAX_BYTES", "1")
    m = _mlp(10)
    err, r = _compile(m, cache_dir=str(tmp_path))
    assert err < 1e-5 and r.regions[0].cached is False
    err, r = _compile(m, cache_dir=str(tmp_path))  # .host.onnx and .host.json both kept
    assert err < 1e-5 and r.regions[0].cached is True
    err, r = _compile(_mlp(11), cache_dir=str(tmp_path))
    assert err < 1e-5
    assert len({p.name.split(".")[0] for p in _files(tmp_path)}) == 1  # the old one evicted


# a full disk under the cache root, and builds killed mid-way ------------------------------


def test_full_disk_while_writing_the_model_keeps_the_offload(tmp_path, monkeypatch):
    """A full disk under the cache root sent the region to eager (found in review); it now
    costs the caching only, and leaves no partial entry behind."""
    real = cache_mod._atomic_write

    def full(path, *a, **k):
        if str(path).endswith(".host.onnx"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(cache_mod, "_atomic_write", full)
    monkeypatch.setattr(cache_mod, "_UNWRITABLE_WARNED", set())
    with pytest.warns(UserWarning, match="not writable.*No space left"):
        err, r = _compile(_mlp(3), cache_dir=str(tmp_path))
    assert err < 1e-5 and _offloaded(r)
    assert not [p for p in _files(tmp_path) if ".host." in p.name]


def test_full_disk_in_the_build_directory_keeps_the_offload(tmp_path, monkeypatch):
    """Host models are built in a scratch directory under the cache root. A full disk there
    sent the region to eager (found in review); it now costs the caching only."""
    real_open = open

    def full(path, mode="r", *a, **k):
        if str(path).endswith("model.onnx") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(compile_mod, "open", full, raising=False)
    monkeypatch.setattr(cache_mod, "_UNWRITABLE_WARNED", set())
    with pytest.warns(UserWarning, match="not writable.*No space left"):
        err, r = _compile(_mlp(3), cache_dir=str(tmp_path))
    assert err < 1e-5 and _offloaded(r)
    assert not list(tmp_path.rglob(".build-*"))


def test_onnxruntime_unable_to_write_its_optimized_model_keeps_the_offload(
    tmp_path, monkeypatch
):
    real = compile_mod.OrtExecutor

    def no_space(model, names, optimized_path=None, **kw):
        if optimized_path:
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Protobuf serialization failed")
        return real(model, names, **kw)

    monkeypatch.setattr(compile_mod, "OrtExecutor", no_space)
    monkeypatch.setattr(cache_mod, "_UNWRITABLE_WARNED", set())
    with pytest.warns(UserWarning, match="could not write its optimized model"):
        err, r = _compile(_mlp(4), cache_dir=str(tmp_path))
    assert err < 1e-5 and _offloaded(r)
    assert not [p for p in _files(tmp_path) if p.name.endswith(".host.onnx")]


def test_stale_build_directories_are_swept(tmp_path):
    """A process killed while building leaves its scratch directory (a whole model) behind."""
    c = ArtifactCache(tmp_path)
    old, fresh = tmp_path / ".build-dead", tmp_path / ".build-live"
    for d in (old, fresh):
        d.mkdir()
        (d / "model.onnx").write_bytes(b"x" * 1000)
    past = time.time() - cache_mod.STALE_TMP_SECONDS - 60
    os.utime(old, (past, past))
    c.put("ab", ".bin", b"payload")  # every put runs the eviction sweep
    assert not old.exists() and fresh.exists()
