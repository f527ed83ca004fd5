"""The remote artifact cache with real compiles on a real redis-server: a fresh machine takes
its regions from the fleet (its prepacked weights rebuilt from its own weights), a damaged
entry is refused and compiled, reports and ``explain``'s lookup say where each region came
from; slow tier: 8 processes on an empty Redis compile each region once, and a bundle
preloads a fresh process that then compiles nothing."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("redis")

import fxpass  # noqa: E402
import fxpass.tools.zoo as zoo  # noqa: E402
from fxpass.jit import remote as R  # noqa: E402
from fxpass.jit.cache import ArtifactCache  # noqa: E402
from fxpass.testing.redis_server import RedisServer  # noqa: E402

if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed", allow_module_level=True)

#: a model whose region is tiered (first tier from the published model, weights rebuilt)
MODEL = dict(layers=1, hidden=256, heads=4, kv_heads=2, vocab=512)
#: publish models and plans, never the weights file (as for a real model's 100 MB)
ENV = {R.MAX_BYTES_ENV: str(256 * 1024)}


@pytest.fixture(scope="module")
def server():
    with RedisServer() as r:
        yield r


@pytest.fixture
def fleet(server, monkeypatch):
    """An empty Redis, a new tier URL, a tiered region even for a small model."""
    from fxpass.backends.onnx.host import prepare

    server.client().flushall()
    url = f"{server.url}?client_name=m{os.getpid()}{id(monkeypatch)}"
    monkeypatch.setenv(R.MAX_BYTES_ENV, ENV[R.MAX_BYTES_ENV])
    monkeypatch.setattr(prepare, "TIER_MIN_BYTES", 0)
    return url


def _compile(cache_dir, url):
    from fxpass.backends.bpu import settle

    torch._dynamo.reset()
    model, kw = zoo.get("qwen3", **MODEL)
    with torch.no_grad():
        ref = model(**kw).logits
        f = torch.compile(model, backend="fxpass_bpu", dynamic=False,
                          options={"min_compute_macs": 0, "cache_dir": str(cache_dir),
                                   "remote_cache": url, "executor": "onnxruntime"})
        out = f(**kw).logits
        settle()  # the second tier (and its entry) built
        again = f(**kw).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, ref, atol=1e-4, rtol=1e-4)
    return fxpass.compile_reports()[-1]


def _region_key(server):
    keys = [k.decode() for k in server.client().scan_iter(match="fxpass:a:*.host.json")]
    assert len(keys) == 1, keys
    return keys[0][len("fxpass:a:"):-len(".host.json")]


@pytest.mark.slow  # a fresh process (5 s): the fast tier's budget
def test_fresh_machine_takes_its_regions_from_the_fleet(tmp_path, fleet, server):
    before = R.STATS.copy()
    rep = _compile(tmp_path / "a", fleet)
    assert [r.source for r in rep.regions] == ["compiled"]
    key = _region_key(server)
    c = server.client()
    assert c.exists(f"fxpass:a:{key}.host.onnx") and c.exists(f"fxpass:a:{key}.fast.onnx")
    assert not c.exists(f"fxpass:a:{key}.host.bin")  # the weights file stays with each client
    # the entry is far smaller than the weights
    published = sum(c.strlen(k) for k in c.scan_iter(match="fxpass:a:*"))
    weights = (tmp_path / "a" / key[:2] / f"{key}.host.bin").stat().st_size
    assert published < weights / 2
    assert R.locate(ArtifactCache(tmp_path / "b", remote=fleet), key) == "remote hit"
    assert R.locate(ArtifactCache(tmp_path / "a", remote=False), key) == "local hit"

    mid = R.STATS.copy()
    rep = _compile(tmp_path / "b", fleet)  # a new machine: empty local cache, warm Redis
    assert [r.source for r in rep.regions] == ["remote hit"]
    assert "remote hit" in str(rep)
    assert R.STATS["region_compiled"] == mid["region_compiled"] == before["region_compiled"] + 1
    assert R.STATS["region_weights_rebuilt"] == mid["region_weights_rebuilt"] + 1
    # its weights file was rebuilt locally: the next process there is a local hit
    assert (tmp_path / "b" / key[:2] / f"{key}.host.bin").is_file()
    rep = _compile(tmp_path / "b", fleet)
    assert [r.source for r in rep.regions] == ["local hit"]


def test_damaged_remote_entry_is_refused_and_compiled(tmp_path, fleet, server):
    _compile(tmp_path / "a", fleet)
    key = _region_key(server)
    c = server.client()
    name = f"fxpass:a:{key}.host.onnx"
    raw = c.get(name)
    c.set(name, raw[:-100] + bytes([raw[-100] ^ 0xFF]) + raw[-99:])  # one flipped byte
    assert "checksum mismatch" in R.locate(ArtifactCache(tmp_path / "x", remote=fleet), key)
    before = R.STATS.copy()
    with pytest.warns(UserWarning, match="refused"):
        rep = _compile(tmp_path / "b", fleet)  # equal to eager, checked inside
    assert rep.regions[0].source.startswith("compiled (remote refused: .host.onnx: checksum")
    assert R.STATS["region_compiled"] == before["region_compiled"] + 1
    assert R.STATS["remote_refused"] > before["remote_refused"]
    # the local compile published a good entry over the bad one
    assert R.tier(fleet).unpack(c.get(name), key, ".host.onnx")[1] is None


@pytest.mark.slow
def test_redis_killed_mid_run(tmp_path, monkeypatch):
    from fxpass.backends.onnx.host import prepare

    monkeypatch.setattr(prepare, "TIER_MIN_BYTES", 0)
    r = RedisServer()
    try:
        _compile(tmp_path / "a", r.url)  # publishes
        r.proc.kill()
        r.proc.wait(timeout=10)
        with pytest.warns(UserWarning, match="unusable") as w:
            rep = _compile(tmp_path / "b", r.url)  # equal to eager, checked inside
        assert [x for x in w if "unusable" in str(x.message)][1:] == []  # one warning
        assert [g.source for g in rep.regions] == ["compiled"]
    finally:
        r.stop()


def test_explain_says_where_each_region_comes_from(tmp_path, fleet, server, monkeypatch):
    """explain looks each region's key up in both tiers, compiling and storing nothing."""
    from fxpass.jit import backend as B
    from fxpass.tools import explain as E

    keys = []
    real = B.region_cache_key
    monkeypatch.setattr(B, "region_cache_key", lambda rg, o: keys.append(real(rg, o)) or keys[-1])
    options = {"min_compute_macs": 0, "cache_dir": str(tmp_path / "e"), "remote_cache": fleet}
    info = E.explain("qwen3-tiny", "bpu", options, progress=False)
    assert [r["cache"] for g in info["graphs"] for r in g["regions"]] == ["compiled"]
    assert "cache: compiled" in E.render(info)
    assert not list((tmp_path / "e").glob("*/*"))  # nothing stored
    key = keys[-1]
    monkeypatch.setattr(B, "region_cache_key", lambda rg, o: key)  # the same region again

    def where():
        return E._cache_lookup(options, None)(None)

    ArtifactCache(tmp_path / "pub", remote=fleet).put(key, ".x", b"artifact")
    assert where() == "remote hit"  # another machine published it
    assert where() == "remote hit"  # the lookup stored nothing locally
    ArtifactCache(tmp_path / "e", remote=False).put(key, ".x", b"artifact")
    assert where() == "local hit"
    server.client().set(f"fxpass:a:{key}.y", b"garbage")
    options["cache_dir"] = str(tmp_path / "other")
    assert where() == "compiled (remote refused: .y: truncated entry (7 bytes))"


CHILD = textwrap.dedent("""
    import json, os, sys, torch
    import fxpass
    import fxpass.tools.zoo as zoo
    from fxpass.backends.onnx.host import prepare
    prepare.TIER_MIN_BYTES = 0
    spec = json.loads(sys.argv[1])
    if spec.get("import"):
        from fxpass.jit.bundle import import_bundle
        assert not import_bundle(spec["import"], spec["cache"])["refused"]
    model, kw = zoo.get("qwen3", **spec["model"])
    opts = {"min_compute_macs": 0, "cache_dir": spec["cache"], "executor": "onnxruntime"}
    if spec.get("url"):
        opts["remote_cache"] = spec["url"]
    with torch.no_grad():
        ref = model(**kw).logits
        f = (fxpass.precompile(model, "bpu", opts) if spec.get("precompile") else
             torch.compile(model, backend="fxpass_bpu", dynamic=False, options=opts))
        out = f(**kw)
    from fxpass.backends.bpu import settle
    settle()
    with torch.no_grad():  # the second tier, built meanwhile, answers the same
        again = f(**kw)
    if spec.get("export"):
        from fxpass.jit.bundle import export_bundle
        export_bundle(spec["export"], spec["cache"])
    from fxpass.jit.backend import CACHE_STATS, STATS
    from fxpass.jit.precompile import STATS as PRE
    import fxpass
    print("RESULT " + json.dumps({"err": max((out.logits - ref).abs().max().item(),
                                             (again.logits - ref).abs().max().item()),
                                  "cache": dict(CACHE_STATS), "stats": dict(STATS),
                                  "entries": dict(PRE),
                                  "sources": [g.source for r in fxpass.compile_reports()
                                              for g in r.regions]}))
""")


def _children(specs, env=None):
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(s)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, **ENV, **(env or {})}) for s in specs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-3000:]
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")][-1]
        out.append(json.loads(line[len("RESULT "):]))
    return out


@pytest.mark.slow
def test_eight_processes_on_an_empty_redis_compile_each_region_once(tmp_path, server):
    server.client().flushall()
    specs = [{"model": MODEL, "cache": str(tmp_path / f"c{i}"), "url": server.url}
             for i in range(8)]
    res = _children(specs)
    assert all(r["err"] < 1e-4 for r in res)
    compiled = sum(r["cache"].get("region_compiled", 0) for r in res)
    remote = sum(r["cache"].get("region_remote_hit", 0) for r in res)
    assert compiled == 1, [r["cache"] for r in res]
    assert remote == 7
    assert sum(r["cache"].get("lock_timeouts", 0) for r in res) == 0


@pytest.mark.slow
@pytest.mark.parametrize("pre", [False, True], ids=["torch.compile", "precompile"])
def test_bundle_preloads_a_process_that_compiles_nothing(tmp_path, pre):
    bundle = str(tmp_path / "warm.tar")
    (first,) = _children([{"model": MODEL, "cache": str(tmp_path / "a"), "export": bundle,
                           "precompile": pre}])
    assert first["cache"].get("region_compiled") == 1
    (second,) = _children([{"model": MODEL, "cache": str(tmp_path / "new"), "import": bundle,
                            "precompile": pre}])
    assert second["err"] < 1e-4
    assert second["entries"] == ({"local_hit": 1} if pre else {})  # not even a trace
    assert second["cache"].get("region_compiled", 0) == 0
    assert second["cache"].get("region_weights_rebuilt", 0) == 0
    assert second["cache"]["region_local_hit"] == 1
    assert second["stats"].get("plan_hit") == 1 and not second["stats"].get("rules")


@pytest.mark.slow
def test_untiered_region_from_the_fleet_is_a_plan_hit_with_its_weights_rebuilt(tmp_path, server):
    """A one-token region is not tiered where it compiles, and the fleet keeps no weights
    file: a new machine's plan hit rebuilds the prepacked session from its own weights
    (behind the entry's in-place model), instead of compiling cold."""
    server.client().flushall()
    one = {**MODEL, "tokens": 1}
    (first,) = _children([{"model": one, "cache": str(tmp_path / "a"), "url": server.url}])
    assert first["sources"] == ["compiled"]
    (fresh,) = _children([{"model": one, "cache": str(tmp_path / "b"), "url": server.url}])
    assert fresh["err"] < 1e-4
    assert fresh["sources"][0] == "remote hit"
    assert fresh["stats"].get("plan_hit") and not fresh["stats"].get("region_compiles")
    assert fresh["cache"]["region_weights_rebuilt"] == 1
    (local,) = _children([{"model": one, "cache": str(tmp_path / "b"), "url": server.url}])
    assert local["sources"][0] == "local hit"
    assert not local["cache"].get("region_weights_rebuilt")


@pytest.mark.slow
def test_precompiled_entry_starts_a_fresh_machine_without_a_trace(tmp_path, server):
    """fxpass.precompile through the fleet: the second machine loads the trace and its regions
    from Redis (into its own cache directory, not the first machine's), signed entries only."""
    server.client().flushall()
    signed = {R.SECRET_ENV: "fleet-secret"}
    spec = {"model": MODEL, "url": server.url, "precompile": True}
    (first,) = _children([{**spec, "cache": str(tmp_path / "a")}], signed)
    assert first["entries"] == {"traced": 1} and first["sources"][0] == "compiled"
    (fresh,) = _children([{**spec, "cache": str(tmp_path / "b")}], signed)
    assert fresh["err"] < 1e-4
    assert fresh["entries"] == {"remote_hit": 1}  # no trace
    assert fresh["sources"][0] == "remote hit" and fresh["stats"].get("plan_hit")
    assert list((tmp_path / "b").rglob("*.host.onnx"))  # its own directory
    # without the secret the store's entries are not code this process runs
    (unsigned,) = _children([{**spec, "cache": str(tmp_path / "c")}], {R.SECRET_ENV: ""})
    assert unsigned["err"] < 1e-4
    assert unsigned["entries"] == {"unshared": 1, "traced": 1}
