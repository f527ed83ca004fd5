"""The artifact cache's remote tier on a real redis-server: read-through, write-through,
nothing from the store trusted (flipped byte, truncated, other tool version, hostile key,
bad signature), Redis down or killed mid-run, the compile lock, the portable bundle."""

import json
import shutil
import sys
import tarfile
import time
import warnings

import pytest

redis = pytest.importorskip("redis")

from fxpass.jit import remote as R  # noqa: E402
from fxpass.jit.bundle import export_bundle, import_bundle  # noqa: E402
from fxpass.jit.cache import USED, ArtifactCache  # noqa: E402
from fxpass.testing.redis_server import RedisServer  # noqa: E402

if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (apt-get install -y redis-server)",
                allow_module_level=True)

KEY = "ab" * 16
OTHER = "cd" * 16


@pytest.fixture(scope="module")
def server():
    with RedisServer() as r:
        yield r


@pytest.fixture
def url(server):
    """A fresh database of the shared server per test (the tier is per URL)."""
    url = server.url
    c = server.client()
    c.flushall()
    # a new URL per test: its own tier state (a URL that failed stays off in a process)
    url = f"{url}?client_name=t{time.monotonic_ns()}"
    return url


def _cache(tmp_path, url, name="a"):
    return ArtifactCache(tmp_path / name, remote=url)


def _raw_key(key=KEY, suffix=".x"):
    return f"fxpass:a:{key}{suffix}"


def test_write_through_then_read_through(tmp_path, url, server):
    a = _cache(tmp_path, url, "a")
    a.put(KEY, ".x", b"compiled bytes")
    assert server.client().exists(_raw_key())
    b = _cache(tmp_path, url, "b")  # another machine: empty local cache
    assert b.get(KEY, ".x") == b"compiled bytes"
    assert b.origin[KEY] == "remote" and b.record(KEY, True) == "remote hit"
    # the verified hit was written locally: no remote needed any more
    assert ArtifactCache(tmp_path / "b", remote=False).get(KEY, ".x") == b"compiled bytes"
    assert b.get(OTHER, ".x") is None  # a miss in both tiers


@pytest.mark.parametrize("fault", ["flip", "truncate", "tools", "hostile_key", "garbage"])
def test_untrusted_entries_are_refused(tmp_path, url, server, fault):
    a = _cache(tmp_path, url, "a")
    a.put(KEY, ".x", b"the right artifact " * 20)
    c = server.client()
    raw = c.get(_raw_key())
    if fault == "flip":  # one byte of the artifact
        bad = raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:]
    elif fault == "truncate":
        bad = raw[: len(raw) - 7]
    elif fault == "garbage":
        bad = b"\x00" * 10
    else:  # a well-formed entry that is not this process's: re-packed with a changed field
        n = int.from_bytes(raw[len(R.MAGIC) + 32: len(R.MAGIC) + 36], "big")
        head = len(R.MAGIC) + 36
        m, data = json.loads(raw[head:head + n]), raw[head + n:]
        if fault == "tools":
            m["tools"] = {**m["tools"], "fxpass": "0.0.1-other"}
        else:  # another region's entry filed under this key (checksum consistent)
            m["key"] = OTHER
        bad = R.tier(url).pack(m, data)
    c.set(_raw_key(), bad)
    b = _cache(tmp_path, url, "b")
    before = R.STATS["remote_refused"]
    with pytest.warns(UserWarning, match="refused"):
        assert b.get(KEY, ".x") is None
    assert R.STATS["remote_refused"] == before + 1
    why = b.refused[KEY]
    expect = {"flip": "checksum", "truncate": "truncated", "tools": "tool versions",
              "hostile_key": "manifest is for key", "garbage": "truncated"}[fault]
    assert expect in why
    assert b.record(KEY, False).startswith("compiled (remote refused")
    assert not (tmp_path / "b" / KEY[:2]).exists()  # nothing refused reached the local cache
    b.put(KEY, ".x", b"the right artifact " * 20)  # the local compile heals the store
    assert R.tier(url).unpack(c.get(_raw_key()), KEY, ".x")[1] is None


def test_signed_entries(tmp_path, server, monkeypatch):
    url = f"{server.url}?client_name=signed{time.monotonic_ns()}"
    monkeypatch.setenv(R.SECRET_ENV, "fleet-secret")
    a = _cache(tmp_path, url, "a")
    a.put(KEY, ".x", b"signed")
    assert _cache(tmp_path, url, "b").get(KEY, ".x") == b"signed"
    # an entry another writer made without the secret is refused
    R._TIERS.pop(url)
    monkeypatch.setenv(R.SECRET_ENV, "")
    unsigned = R.tier(url).pack({"x": 1}, b"")
    R._TIERS.pop(url)
    monkeypatch.setenv(R.SECRET_ENV, "fleet-secret")
    server.client().set(_raw_key(), unsigned)
    with pytest.warns(UserWarning, match="signature"):
        assert _cache(tmp_path, url, "c").get(KEY, ".x") is None


def test_large_artifacts_stay_local(tmp_path, url, server, monkeypatch):
    monkeypatch.setenv(R.MAX_BYTES_ENV, "100")
    url = url + "x"
    a = _cache(tmp_path, url, "a")
    a.put(KEY, ".big", b"w" * 101)
    a.put(KEY, ".small", b"m" * 10)
    assert not server.client().exists(_raw_key(suffix=".big"))
    assert server.client().exists(_raw_key(suffix=".small"))


def test_redis_down_costs_one_bounded_warning(tmp_path):
    with RedisServer() as r:
        url = r.url
    t = time.monotonic()
    c = ArtifactCache(tmp_path, remote=url)  # nothing listens there any more
    with pytest.warns(UserWarning, match="unusable") as w:
        assert c.get(KEY, ".x") is None
        assert c.put(KEY, ".x", b"local") is not None  # the local cache still works
        assert c.get(OTHER, ".x") is None
        with c.compiling(KEY):
            pass
    assert len([x for x in w if "unusable" in str(x.message)]) == 1
    assert c.get(KEY, ".x") == b"local"
    assert time.monotonic() - t < 30  # bounded (a generous bound, not a timing assert)


def test_redis_killed_mid_run(tmp_path):
    r = RedisServer()
    try:
        url = r.url
        a = ArtifactCache(tmp_path / "a", remote=url)
        a.put(KEY, ".x", b"one")
        r.proc.kill()
        r.proc.wait(timeout=10)
        with pytest.warns(UserWarning, match="unusable"):
            assert a.put(OTHER, ".x", b"two") is not None
        assert a.get(OTHER, ".x") == b"two"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            assert ArtifactCache(tmp_path / "b", remote=url).get(KEY, ".x") is None
    finally:
        r.stop()


def test_slow_redis_is_bounded_by_the_timeout(tmp_path):
    import threading

    with RedisServer("--enable-debug-command", "yes") as r:
        url = f"{r.url}?socket_timeout=0.2&socket_connect_timeout=0.2"
        a = ArtifactCache(tmp_path / "a", remote=url)
        busy = threading.Thread(target=lambda: r.client().execute_command("DEBUG", "SLEEP", "1"))
        busy.start()
        time.sleep(0.1)
        with pytest.warns(UserWarning, match="unusable.*Timeout"):
            assert a.get(KEY, ".x") is None  # answered by the timeout, not the server
        assert busy.is_alive()  # the server was still asleep
        busy.join()
        assert a.put(KEY, ".x", b"local") is not None


def test_redis_full_stops_publishing(tmp_path):
    with RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as r:
        a = ArtifactCache(tmp_path / "a", remote=r.url)
        with pytest.warns(UserWarning, match="full"):
            for i in range(8):
                assert a.put(f"{i:02x}" * 16, ".x", bytes(1 << 20)) is not None
        assert R.tier(r.url).up  # reads go on


def test_compile_lock_waits_then_times_out(tmp_path, url, server, monkeypatch):
    monkeypatch.setenv(R.LOCK_WAIT_ENV, "0.3")
    url = url + "lock"
    c = server.client()
    c.set(f"fxpass:lock:{KEY}", "someone-else", px=60_000)  # another process compiles it
    cache = _cache(tmp_path, url)
    before = (R.STATS["lock_waits"], R.STATS["lock_timeouts"])
    with pytest.warns(UserWarning, match="compiling it here"), cache.compiling(KEY):
        pass  # the waiter compiles itself
    assert (R.STATS["lock_waits"], R.STATS["lock_timeouts"]) == (before[0] + 1, before[1] + 1)
    assert c.get(f"fxpass:lock:{KEY}") == b"someone-else"  # never released another's lock
    # a free lock is taken and released; a held one (a background build) outlives the block
    with cache.compiling(OTHER):
        assert c.exists(f"fxpass:lock:{OTHER}")
        done = cache.hold(OTHER)
    assert c.exists(f"fxpass:lock:{OTHER}")
    with cache.compiling(OTHER):  # this process holds it: never waits for itself
        pass
    done()
    assert not c.exists(f"fxpass:lock:{OTHER}")


def test_url_and_missing_client(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="not a Redis URL"):
        ArtifactCache(tmp_path, remote="http://host:6379")
    assert R.redact("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r'pip install "fxpass\[fleet\]"'):
        ArtifactCache(tmp_path, remote="redis://127.0.0.1:1/0?client_name=nopkg")
    monkeypatch.setenv(R.ENV, "redis://127.0.0.1:1/0?client_name=nopkg2")
    with pytest.raises(ImportError, match="FXPASS_REMOTE_CACHE"):
        ArtifactCache(tmp_path)
    assert ArtifactCache(tmp_path, remote=False).remote is None


def test_bundle_round_trip_and_refusals(tmp_path):
    a = ArtifactCache(tmp_path / "a", remote=False)
    a.put(KEY, ".model", b"m" * 100)
    a.put(KEY, ".meta.json", b"{}")
    out = tmp_path / "b.tar"
    s = export_bundle(out, tmp_path / "a", used_only=False)
    assert s["entries"] == 2
    got = import_bundle(out, tmp_path / "new")
    assert got["imported"] == 2 and not got["refused"]
    assert ArtifactCache(tmp_path / "new", remote=False).get(KEY, ".model") == b"m" * 100
    # used_only: what this process read or stored under that root
    assert (str(a.root), KEY, ".model") in USED
    assert export_bundle(tmp_path / "u.tar", tmp_path / "a")["entries"] == 2
    # a hostile bundle: a flipped byte, a path outside, a link, an entry without manifest
    bad = tmp_path / "bad.tar"
    with tarfile.open(out) as src, tarfile.open(bad, "w") as dst:
        for m in src:
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name == f"entries/{KEY}.model":
                data = b"n" + data[1:]
            dst.addfile(m, __import__("io").BytesIO(data) if data is not None else None)
        evil = tarfile.TarInfo("../../etc/evil")
        evil.size = 1
        dst.addfile(evil, __import__("io").BytesIO(b"x"))
        link = tarfile.TarInfo(f"entries/{OTHER}.x")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        dst.addfile(link)
        lone = tarfile.TarInfo(f"entries/{OTHER}.y")
        lone.size = 1
        dst.addfile(lone, __import__("io").BytesIO(b"y"))
    got = import_bundle(bad, tmp_path / "new2")
    reasons = " | ".join(got["refused"])
    assert got["imported"] == 1  # only the untouched .meta.json
    assert "checksum mismatch" in reasons and "not a bundle entry" in reasons
    assert "no manifest" in reasons
    assert not (tmp_path / "etc").exists()
    assert ArtifactCache(tmp_path / "new2", remote=False).get(KEY, ".model") is None


def test_cli_cache_export_import(tmp_path, capsys):
    from fxpass.cli import main

    a = ArtifactCache(tmp_path / "a", remote=False)
    a.put(KEY, ".model", b"m" * 100)
    assert main(["cache", "export", str(tmp_path / "b.tar"), "--cache-dir",
                 str(tmp_path / "a")]) == 0
    assert "exported 1 entries" in capsys.readouterr().out
    assert main(["cache", "import", str(tmp_path / "b.tar"), "--cache-dir",
                 str(tmp_path / "n")]) == 0
    assert "imported 1 entries" in capsys.readouterr().out
    assert ArtifactCache(tmp_path / "n", remote=False).get(KEY, ".model") == b"m" * 100
    # a damaged bundle: refused entries are listed and the exit code says so
    with tarfile.open(tmp_path / "b.tar") as t:
        names = t.getnames()
    assert f"manifests/{KEY}.model.json" in names
    with tarfile.open(tmp_path / "half.tar", "w") as t:
        t.add(a.path(KEY, ".model"), arcname=f"entries/{KEY}.model")
    assert main(["cache", "import", str(tmp_path / "half.tar"), "--cache-dir",
                 str(tmp_path / "m")]) == 1
    assert "no manifest" in capsys.readouterr().err
