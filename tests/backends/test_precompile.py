"""fxpass.precompile: the traced model saved as an entry of the artifact cache, loaded by the
next ``Precompiled`` (or process) without tracing again; every entry checked before it runs
(its key, the traced sources, Dynamo's guards at each call), a refused entry traced again, a
model that cannot be precompiled run under torch.compile. Values against eager, float32:
atol=rtol=1e-4 (onnxruntime's kernels against PyTorch's)."""

import pickle
import warnings
import zlib

import pytest
import torch

import fxpass
import fxpass.tools.zoo as zoo
from fxpass.jit import precompile as P
from fxpass.jit.cache import ArtifactCache

TOL = dict(atol=1e-4, rtol=1e-4)


class Scaled(torch.nn.Module):
    """A forward that reads a Python attribute: Dynamo guards on its value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 16)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


def _stats() -> dict:
    return dict(P.STATS)


def _delta(before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in P.STATS.items() if v != before.get(k, 0)}


@pytest.mark.slow  # a transformers model traced twice (6 s): the fast tier's budget
def test_entry_is_stored_then_loaded_without_a_trace(opts):
    torch.manual_seed(0)
    model, kw = zoo.get("qwen3", layers=1, hidden=64, heads=4, kv_heads=2, vocab=128, tokens=3)
    with torch.no_grad():
        ref = model(**kw).logits
        s = _stats()
        out = fxpass.precompile(model, "ort", opts)(**kw).logits
        assert _delta(s) == {"traced": 1}
        torch.testing.assert_close(out, ref, **TOL)
        # a new Precompiled (as a new process would): the entry, not a trace
        torch._dynamo.reset()
        s = _stats()
        fast = fxpass.precompile(model, "ort", opts)
        out = fast(**kw).logits
        assert _delta(s) == {"local_hit": 1}
        assert list(fast.sources.values()) == ["local hit"]
        torch.testing.assert_close(out, ref, **TOL)
        # another input signature is another entry
        kw2 = {**kw, "input_ids": kw["input_ids"][:, :2]}
        s = _stats()
        torch.testing.assert_close(fast(**kw2).logits, model(**kw2).logits, **TOL)
        assert _delta(s) == {"traced": 1}
    entries = list((opts_dir := ArtifactCache(opts["cache_dir"]).root).rglob("*" + P.SUFFIX))
    assert len(entries) == 2, opts_dir
    # the entry holds the trace, not the weights
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(e.stat().st_size < 4 * weights for e in entries)


def _one_entry(cache_dir) -> tuple[str, bytes]:
    cache = ArtifactCache(cache_dir)
    (path,) = cache.root.rglob("*" + P.SUFFIX)
    key = path.name[: -len(P.SUFFIX)]
    return key, cache.get(key, P.SUFFIX)


@pytest.mark.parametrize("damage", ["garbage", "source", "format", "oversized"])
def test_bad_entry_is_refused_and_traced_again(opts, damage, monkeypatch):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 32)
    with torch.no_grad():
        ref = model(x)
        fxpass.precompile(model, "ort", opts)(x)
        key, raw = _one_entry(opts["cache_dir"])
        entry = pickle.loads(zlib.decompress(raw))
        if damage == "garbage":
            bad = raw[:100]
        elif damage == "source":  # the traced source changed since (an edited install)
            entry["sources"] = [(m, a, b, "0" * 64) for m, a, b, _ in entry["sources"]]
            bad = zlib.compress(pickle.dumps(entry))
        elif damage == "format":
            entry["format"] = "fxpass-precompiled-0"
            bad = zlib.compress(pickle.dumps(entry))
        else:  # decompresses past the bound (a bomb would): refused before unpickling
            monkeypatch.setattr(P, "MAX_ENTRY_BYTES", len(zlib.decompress(raw)) + 1000)
            entry["pad"] = bytes(2000)
            bad = zlib.compress(pickle.dumps(entry))
        ArtifactCache(opts["cache_dir"]).put(key, P.SUFFIX, bad)
        torch._dynamo.reset()
        s = _stats()
        fast = fxpass.precompile(model, "ort", opts)
        out = fast(x)
    torch.testing.assert_close(out, ref, **TOL)
    assert _delta(s) == {"refused": 1, "traced": 1}
    why = {"garbage": "unloadable entry", "source": "changed since the trace",
           "format": "not a precompiled fxpass entry", "oversized": "once decompressed"}[damage]
    (where,) = fast.sources.values()
    assert where.startswith("traced (") and why in where, where
    # the good entry was stored over the bad one
    assert pickle.loads(zlib.decompress(_one_entry(opts["cache_dir"])[1]))["format"] == P.FORMAT


def test_guards_still_run_on_every_call(opts):
    """An attribute the trace read as a constant changes: a loaded entry's guards fail and the
    model is traced again, never run with the old value."""
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 32)
    with torch.no_grad():
        fast = fxpass.precompile(model, "ort", opts)
        torch.testing.assert_close(fast(x), model(x), **TOL)
        model.scale = 3.0
        s = _stats()
        torch.testing.assert_close(fast(x), model(x), **TOL)
        assert _delta(s) == {"traced": 1}
        # a loaded entry is checked too: the stored one was traced with scale 3
        torch._dynamo.reset()
        model.scale = 2.0
        fast = fxpass.precompile(model, "ort", opts)
        s = _stats()
        torch.testing.assert_close(fast(x), model(x), **TOL)
        assert _delta(s) == {"traced": 1}
        assert list(fast.sources.values()) == ["traced (its guards failed on these inputs)"]
        # weights written in place after compile: the compiled graph's own guard rebuilds
        model.a.weight.mul_(0.5)
        torch.testing.assert_close(fast(x), model(x), **TOL)


class Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if y.sum().item() > 0:  # data-dependent control flow: no single graph
            return y * 2
        return y - 1


def test_a_model_that_cannot_be_captured_whole_runs_under_torch_compile(opts):
    torch.manual_seed(0)
    model, x = Breaks(), torch.randn(4, 32)
    with torch.no_grad():
        s = _stats()
        fast = fxpass.precompile(model, "ort", opts)
        with pytest.warns(UserWarning, match="cannot be precompiled.*torch.compile"):
            out = fast(x)
        torch.testing.assert_close(out, model(x), **TOL)
        assert _delta(s) == {"fallback": 1}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not per call
            torch.testing.assert_close(fast(-x), model(-x), **TOL)
        strict = fxpass.precompile(model, "ort", {**opts, "strict": True})
        with pytest.raises(RuntimeError, match="cannot be precompiled.*strict=True"):
            strict(x)


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(TypeError, match="takes an nn.Module"):
        fxpass.precompile(lambda x: x, "ort")
    with pytest.raises(TypeError, match="unknown option"):
        fxpass.precompile(Scaled(), "ort", {"no_such_option": 1})


def test_options_reach_the_loaded_graph(opts, tmp_path, monkeypatch):
    """An entry traced with the default options, loaded by a Precompiled with
    freeze_weights=False: weights are inputs at every call, so a write is seen without a
    rebuild. cache=False: nothing stored, every Precompiled traces."""
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 32)
    with torch.no_grad():
        fxpass.precompile(model, "ort", opts)(x)
        torch._dynamo.reset()
        s = _stats()
        fast = fxpass.precompile(model, "ort", {**opts, "freeze_weights": False})
        torch.testing.assert_close(fast(x), model(x), **TOL)
        assert _delta(s) == {"local_hit": 1}
        n = len(fxpass.compile_reports())
        model.b.bias.add_(1.0)
        torch.testing.assert_close(fast(x), model(x), **TOL)
        assert len(fxpass.compile_reports()) == n  # nothing rebuilt
        monkeypatch.setenv("FXPASS_CACHE_DIR", str(tmp_path / "default"))
        off = {"min_compute_macs": 0, "cache": False}
        s = _stats()
        for _ in range(2):
            torch.testing.assert_close(fxpass.precompile(model, "ort", off)(x), model(x), **TOL)
        assert _delta(s) == {"traced": 2}
    assert not list((tmp_path / "default").rglob("*"))


def test_a_call_that_records_gradients_runs_eagerly(opts):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 32)
    fast = fxpass.precompile(model, "ort", opts)
    s = _stats()
    with pytest.warns(UserWarning, match="inference graphs only.*torch.no_grad"):
        out = fast(x)
    out.sum().backward()  # the gradients are eager's
    assert model.a.weight.grad is not None
    assert _delta(s) == {}  # nothing traced
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), **TOL)
    assert _delta(s) == {"traced": 1}
    with pytest.raises(RuntimeError, match="inference graphs only.*strict=True"):
        fxpass.precompile(model, "ort", {**opts, "strict": True})(x)
    # an input that records gradients, on a model whose weights do not
    for p in model.parameters():
        p.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    s = _stats()
    fast(xg).sum().backward()
    assert xg.grad is not None and _delta(s) == {}
