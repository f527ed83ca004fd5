"""Artifact cache: reused by a second process, corruption detected and rebuilt, keys honest."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import fxpass
from fxpass.jit.cache import ArtifactCache, region_key
from tests.conftest import trace

SCRIPT = textwrap.dedent(
    """
    import json, sys, time, torch
    # the model only; the backend is found through its entry point
    import fxpass.tools.zoo as zoo
    model, kw = zoo.get("qwen3", layers=1)
    t = time.perf_counter()
    with torch.no_grad():
        out = torch.compile(model, backend="fxpass_bpu", dynamic=False,
                            options={"min_compute_macs": 0, "cache_dir": sys.argv[1]})(**kw)
        ref = model(**kw)
    import fxpass
    r = fxpass.compile_reports()[-1]
    print(json.dumps({"cached": [g.cached for g in r.regions], "regions": len(r.regions),
                      "err": (out.logits - ref.logits).abs().max().item(),
                      "seconds": time.perf_counter() - t}))
    """
)


def _run(cache_dir):
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess round trip
def test_second_process_reuses_artifacts_and_corruption_is_rebuilt(tmp_path):
    first = _run(tmp_path)
    assert first["regions"] == 1 and first["cached"] == [False] and first["err"] < 1e-4
    second = _run(tmp_path)
    assert second["cached"] == [True] and second["err"] < 1e-4
    # corrupt every artifact: detected, rebuilt, still correct
    arts = [p for p in tmp_path.rglob("*.onnx")]
    assert arts
    for p in arts:
        p.write_bytes(p.read_bytes()[:-7] + b"garbage")
    third = _run(tmp_path)
    assert third["cached"] == [False] and third["err"] < 1e-4
    assert not list(tmp_path.rglob(".build-*")), "the scratch directory of a build is removed"


def test_cache_key_covers_node_arguments_and_full_weights():
    x = torch.randn(4, 8)
    k1 = region_key(trace(lambda a: torch.nn.functional.layer_norm(a, (8,), eps=1e-5), x))
    k2 = region_key(trace(lambda a: torch.nn.functional.layer_norm(a, (8,), eps=1e-6), x))
    assert k1 != k2  # eps is a node argument
    m = torch.nn.Linear(64, 64)
    g = torch.fx.symbolic_trace(m)
    a = region_key(g, march="nash-p")
    with torch.no_grad():
        m.weight[63, 63] += 1  # one element, far from any sample
    assert region_key(g, march="nash-p") != a
    assert region_key(g, march="nash-e") != region_key(g, march="nash-p")


def test_corrupt_manifest_and_atomic_put(tmp_path):
    c = ArtifactCache(tmp_path)
    c.put("abcd", ".bin", b"payload")
    assert c.get("abcd", ".bin") == b"payload"
    art, man = c._paths("abcd", ".bin")
    man.write_text("{not json")
    with pytest.warns(UserWarning, match="corrupt"):
        assert c.get("abcd", ".bin") is None
    assert not art.exists()
    assert not list(tmp_path.rglob("*.tmp"))  # no temp files left behind
    fxpass.compile_reports()  # public accessor exists


def test_put_file_moves_and_get_path_verifies_by_streaming(tmp_path):
    """Large host models go in by file and come out as a verified path (issue 12: no copy of
    the weights as bytes beside the session); the manifest is the same as put's."""
    c = ArtifactCache(tmp_path / "cache")
    payload = bytes(range(256)) * 40_000  # 10 MB: more than one 8 MB checksum chunk
    src = tmp_path / "opt.onnx"
    src.write_bytes(payload)
    art = c.put_file("ab12", ".ort.onnx", src)
    assert art is not None and not src.exists(), "moved, not copied"
    assert c.get_path("ab12", ".ort.onnx") == (art, len(payload))
    assert c.get("ab12", ".ort.onnx") == payload  # the bytes path agrees with the streamed one
    data = bytearray(payload)
    data[9_000_000] ^= 1  # one bit, in the second chunk
    art.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checksum mismatch"):
        assert c.get_path("ab12", ".ort.onnx") is None
    assert not art.exists()


# -- cached plans: a warm compile skips the rules and the partitioner (issue 12, item 3) --------

from fxpass.jit import backend as backend_mod  # noqa: E402
from fxpass.jit import digest as digest_mod  # noqa: E402
from fxpass.jit import options as options_mod  # noqa: E402
from fxpass.jit import plan as plan_mod  # noqa: E402
from fxpass.jit.runtime import RegionFallbackWarning  # noqa: E402

XS = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
    ).eval()


def _compile(m, x=XS, **options):
    """A fresh Dynamo graph compiled and run once: (max error vs eager, report, stats delta)."""
    torch._dynamo.reset()
    before = dict(backend_mod.STATS)
    with torch.no_grad():
        got = torch.compile(
            m, backend="fxpass_bpu", dynamic=False, options={"min_compute_macs": 0, **options}
        )(x)
        err = (got - m(x)).abs().max().item()
    delta = {k: v - before.get(k, 0) for k, v in backend_mod.STATS.items()}
    return err, fxpass.compile_reports()[-1], {k: v for k, v in delta.items() if v}


def test_warm_compile_loads_the_plan_and_runs_no_rule(tmp_path):
    m = _mlp()
    err, r, d = _compile(m, cache_dir=str(tmp_path))
    assert err < 1e-5 and d == {"plan_miss": 1, "rules": 1, "partition": 1, "plan_stored": 1,
                               "region_compiles": 1}
    err, r2, d = _compile(m, cache_dir=str(tmp_path))
    assert err < 1e-5
    assert d == {"plan_hit": 1}, d  # no rules, no partition: the ledger says so
    assert [g.cached for g in r2.regions] == [True]
    assert r2.offloaded_macs == r.offloaded_macs and r2.call_nodes == r.call_nodes
    assert any("plan loaded" in n for n in r2.notes)



@pytest.mark.parametrize("rows", [1, 16], ids=["weights-as-inputs", "prepacked-inits"])
def test_warm_plan_hit_binds_in_place_weights(rows, tmp_path, monkeypatch):
    """A plan hit binds the weights its regions read in place (one row with
    ``prepack_one_row=False``: graph inputs; otherwise onnxruntime initializers) through the
    plan's attribute -> placeholder map. The first
    version of binding by region attribute passed the plan's placeholder map instead: every
    such region missed its plan (a warm Qwen3 process: 0.35 s instead of 0.25 s), which the
    small-weights MLP above could not show."""
    from fxpass.backends.onnx.host import build as compile_mod

    # a model onnxruntime saves optimized reads its own file, never initializers: keep the
    # entry unoptimized so the hit binds them (as for a region with attention ``If``s)
    monkeypatch.setattr(compile_mod, "saves_prepacked", lambda proto: False)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 128)).eval()
    x = torch.randn(rows, 128)
    opts = {"cache_dir": str(tmp_path), "tiered": False, "prepack_one_row": rows > 1}
    err, _, d = _compile(m, x, **opts)
    assert err < 1e-5 and d.get("plan_stored") == 1
    if rows == 1:  # the weights are graph inputs of the stored model, fed in place
        (meta,) = tmp_path.rglob("*.host.json")
        assert json.loads(meta.read_bytes())["shared"], "one row: weights fed as inputs"
    err, r2, d = _compile(m, x, **opts)
    assert err < 1e-5 and d == {"plan_hit": 1}, d
    assert [g.cached for g in r2.regions] == [True]

@pytest.mark.parametrize(
    "change",
    ["weight", "option", "graph", "rule_set"],
)
def test_plan_misses_on_any_change(tmp_path, change):
    m = _mlp()
    assert _compile(m, cache_dir=str(tmp_path))[2]["plan_stored"] == 1
    x, opts = XS, {"cache_dir": str(tmp_path)}
    if change == "weight":
        with torch.no_grad():
            m[2].weight[15, 31] += 0.5  # one element: a full digest, not a sample
    elif change == "option":
        opts["host_fusions"] = False
    elif change == "graph":
        x = torch.randn(5, 16)
    else:
        opts["disable"] = ["cse"]
    err, _, d = _compile(m, x, **opts)
    assert err < 1e-5
    assert d.get("plan_miss") == 1 and d.get("rules") == 1 and "plan_hit" not in d


def test_graph_key_covers_plugin_rule_version_and_source(tmp_path, monkeypatch):
    from fxpass._capture import capture_graphs as _cg
    from fxpass.plugins import select_rules

    (c,) = _cg(_mlp(), XS)
    rules = select_rules(target="bpu")
    opts = options_mod.from_options({"cache_dir": str(tmp_path)}, "bpu")
    k = plan_mod.graph_key(c.gm, opts, rules, opts.get_device())
    assert plan_mod.graph_key(c.gm, opts, rules, opts.get_device()) == k  # stable
    monkeypatch.setattr(digest_mod, "_dist_version", lambda dist: "99.0")
    assert plan_mod.graph_key(c.gm, opts, rules, opts.get_device()) != k  # a plugin upgrade
    monkeypatch.undo()
    monkeypatch.setattr(digest_mod, "module_digest", lambda name: "edited")
    assert plan_mod.graph_key(c.gm, opts, rules, opts.get_device()) != k  # an edited rule module
    monkeypatch.undo()
    assert plan_mod.graph_key(c.gm, opts, rules[:-1], opts.get_device()) != k  # one rule fewer
    assert plan_mod.graph_key(c.gm, opts.replace(march="nash-e"), rules, opts.get_device()) != k
    # found by a probe: a bisection's FXPASS_REWRITE_LIMIT over a warm cache loaded the
    # unlimited plan; the folding bounds change the rules' result too
    for name, value in (("FXPASS_REWRITE_LIMIT", "0"), ("FXPASS_FOLD_MIN_BYTES", "0")):
        monkeypatch.setenv(name, value)
        assert plan_mod.graph_key(c.gm, opts, rules, opts.get_device()) != k, name
        monkeypatch.delenv(name)
    assert plan_mod.graph_key(c.gm, opts, rules, opts.get_device()) == k


def test_fxpass_check_reaches_the_backend(monkeypatch):
    """Found by a probe: the backend passed check=False explicitly, so FXPASS_CHECK=1 did
    nothing there, and a bad value was not even read."""
    monkeypatch.setenv("FXPASS_CHECK", "1")
    assert options_mod.from_options({"cache": False}, "bpu").check is True
    assert options_mod.from_options({"cache": False, "check": False}, "bpu").check is False
    monkeypatch.setenv("FXPASS_CHECK", "maybe")
    with pytest.raises(ValueError, match="FXPASS_CHECK='maybe' is invalid"):
        options_mod.from_options({"cache": False}, "bpu")



def test_source_digest_covers_subpackages_and_keys_every_region(tmp_path, monkeypatch):
    """Found by a probe: a fix inside ``backends/onnx/lowering/`` (a subpackage) changed no
    key, so a warm cache kept loading the old, wrong model. The source digest now walks
    subpackages, and region keys (not only plan keys) include it."""
    pkg = tmp_path / "probe_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "emit.py").write_text("OP = 'Relu'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = digest_mod.source_digest.__wrapped__("probe_pkg")
    (pkg / "sub" / "emit.py").write_text("OP = 'Abs'\n")
    digest_mod._file_digest.cache_clear()  # files are read once per process
    assert digest_mod.source_digest.__wrapped__("probe_pkg") != before

    g = torch.fx.symbolic_trace(torch.nn.Linear(8, 8))
    k = region_key(g, march="nash-p", executor="onnxruntime")
    monkeypatch.setattr(digest_mod, "source_digest", lambda *pkgs: "an edited lowering")
    assert region_key(g, march="nash-p", executor="onnxruntime") != k


def test_region_failing_on_a_plan_hit_rebuilds_its_eager_graph(tmp_path, monkeypatch):
    from fxpass.jit.runtime import RegionCall

    m = _mlp()
    _compile(m, cache_dir=str(tmp_path))
    loaded = []
    real_apply = plan_mod.apply

    def apply(*a, **kw):
        loaded.append(real_apply(*a, **kw))
        return loaded[-1]

    monkeypatch.setattr(plan_mod, "apply", apply)
    torch._dynamo.reset()
    before = backend_mod.STATS["rules"]
    with torch.no_grad():
        f = torch.compile(
            m,
            backend="fxpass_bpu",
            dynamic=False,
            options={"min_compute_macs": 0, "cache_dir": str(tmp_path)},
        )
        f(XS)
        assert backend_mod.STATS["rules"] == before and loaded[0] is not None  # a hit

        def broken(*a):
            raise RuntimeError("device lost")

        calls = [c for c in loaded[0].modules() if isinstance(c, RegionCall)]
        assert len(calls) == 1 and calls[0]._eager_factory is not None  # not built yet
        calls[0].executor = broken
        with pytest.warns(RegionFallbackWarning, match="device lost"):
            got = f(XS)
        assert (got - m(XS)).abs().max().item() < 1e-5
        f(XS)
    assert backend_mod.STATS["rules"] == before + 1  # rebuilt on demand, once


def test_weight_digest_is_memoized_exact_and_keeps_nothing_alive():
    import gc
    import weakref

    t = torch.randn(64, 64)
    h0, m0 = digest_mod.STATS["hashed"], digest_mod.STATS["memo"]
    d = digest_mod.tensor_digest(t)
    assert digest_mod.tensor_digest(t.detach()) == d  # same storage and version: memo
    assert (digest_mod.STATS["hashed"], digest_mod.STATS["memo"]) == (h0 + 1, m0 + 1)
    with torch.no_grad():
        t[63, 63] += 1  # an in-place write bumps the version: hashed again, and differs
    assert digest_mod.tensor_digest(t) != d
    assert digest_mod.tensor_digest(t.clone()) == digest_mod.tensor_digest(t)  # content only
    bf = torch.randn(8, 8).to(torch.bfloat16)  # no numpy bf16: hashed through a uint8 view
    assert digest_mod.tensor_digest(bf) != digest_mod.tensor_digest(bf.float())
    assert digest_mod.tensor_digest(t.t()) != digest_mod.tensor_digest(t)  # non-contiguous
    ref = weakref.ref(t)
    n = len(digest_mod._MEMO)
    del t
    gc.collect()
    assert ref() is None and len(digest_mod._MEMO) < n  # the memo held no reference


def test_regions_compile_in_parallel_and_keep_per_region_fallback(tmp_path, monkeypatch):
    class TwoRegions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            h = torch.relu(self.a(x))
            h = torch.cumsum(h, dim=-1)  # not in the nash-p table: splits the graph
            return self.b(h)

    m = TwoRegions().eval()
    err, r, d = _compile(m, cache_dir=str(tmp_path))
    assert err < 1e-4 and len(r.regions) == 2 and all(g.fallback is None for g in r.regions)
    assert d.get("parallel_compiles") == 1
    real = backend_mod.compile_region

    def flaky(rg, name, *a, **kw):
        if name.endswith("_r0"):
            raise RuntimeError("hbdk4 says no")
        return real(rg, name, *a, **kw)

    monkeypatch.setattr(backend_mod, "compile_region", flaky)
    with pytest.warns(UserWarning, match="hbdk4 says no"):
        err, r, d = _compile(m, cache=False)
    assert err < 1e-4 and [g.fallback is None for g in r.regions] == [False, True]
    with pytest.raises(RuntimeError, match="region .*_r0 failed to compile: hbdk4 says no"):
        _compile(m, cache=False, strict=True)


def test_rule_identity_covers_the_helpers_beside_a_rule(tmp_path, monkeypatch):
    """Found by a probe: a plugin fixed a constant in its ``helpers.py`` and the warm plan
    kept the old rewrite; a rule's identity named its own module's source only."""
    import sys
    import types

    from fxpass.jit import digest

    pkg = tmp_path / "probeplugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("SCALE = 2.0\n")
    (pkg / "rule.py").write_text("from probeplugin.helpers import SCALE\ndef fn(): return SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import probeplugin.rule as mod

    rule = types.SimpleNamespace(name="r", plugin="probeplugin", fn=mod.fn)

    def identity():
        digest.source_digest.cache_clear()
        digest._file_digest.cache_clear()
        return digest.rule_identity(rule)

    before = identity()
    assert identity() == before  # stable
    (pkg / "helpers.py").write_text("SCALE = 1.0\n")
    assert identity() != before
    for name in ("probeplugin.rule", "probeplugin.helpers", "probeplugin"):
        sys.modules.pop(name, None)


def test_rule_identity_of_a_rule_in_a_namespace_package(tmp_path, monkeypatch):
    """From the review: a namespace package (no __init__.py) has a __path__ but no __file__;
    hashing its directory raised out of the plan key, sending every graph to eager."""
    import sys

    from fxpass.jit import digest

    (tmp_path / "nsorg" / "rules").mkdir(parents=True)  # nsorg: a namespace package
    (tmp_path / "nsorg" / "rules" / "__init__.py").write_text("")
    (tmp_path / "nsorg" / "rules" / "r.py").write_text("def fn(): return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import nsorg.rules.r as mod

    class Rule:
        name, plugin, fn = "r", "nsorg", staticmethod(mod.fn)

    identity = digest.rule_identity(Rule())
    assert identity[-1] is not None  # nsorg.rules (a regular package) is still covered
    for name in ("nsorg.rules.r", "nsorg.rules", "nsorg"):
        sys.modules.pop(name, None)
