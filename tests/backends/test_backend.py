"""torch.compile(model, backend="fxpass_bpu") end to end on stock transformers models."""

import warnings

import pytest
import torch

import fxpass
from fxpass.jit.runtime import RegionFallbackWarning
from fxpass.tools import zoo

MODELS = ["qwen3", "llama", "mistral", "gpt2", "bert", "vit"]


def _main(out):
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"] if "logits" in out else out["last_hidden_state"]


def _compare(expected, got, dtype):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    e, g = expected.float(), got.float()
    if dtype == torch.float32:
        scale = max(1.0, e.abs().max().item())
        assert (e - g).abs().max().item() <= 1e-4 * scale
    else:
        assert torch.nn.functional.cosine_similarity(e.flatten(), g.flatten(), 0) >= 0.999


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_stock_models_match_eager(name, dtype, opts):
    model, kwargs = zoo.get(name, dtype=dtype)
    before = len(fxpass.compile_reports())
    with torch.no_grad():
        expected = _main(model(**kwargs))
        compiled = torch.compile(model, backend="fxpass_bpu", dynamic=False, options=opts)
        got = _main(compiled(**kwargs))
        again = _main(compiled(**kwargs))
    reports = fxpass.compile_reports()[before:]
    assert len(reports) == 1, "one Dynamo graph per fixed-shape forward"
    r = reports[0]
    _compare(expected, got, dtype)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    assert r.regions and all(reg.fallback is None for reg in r.regions)
    assert r.mac_share == 1.0, str(r)
    if name in ("qwen3", "llama", "mistral"):
        assert len(r.regions) == 1, str(r)
        assert r.node_share >= 0.95, str(r)
    else:
        assert r.node_share >= 0.8, str(r)


class SideBranch(torch.nn.Module):
    """An unsupported op (sin) on a side branch, and a residual around an unsupported op."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        h = self.a(x)
        side = torch.sin(h)  # side branch leaves the region ...
        y = self.b(h) + side  # ... and re-enters: must not be one convex region with h
        r = torch.cos(y)  # residual around an unsupported op
        return self.c(y + r)


def test_side_branch_and_residual_around_unsupported_ops(opts):
    m = SideBranch().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = m(x)
        got = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    r = fxpass.compile_reports()[-1]
    assert len(r.regions) >= 2
    assert any("sin" in why for why in r.cpu_reasons)


def test_weights_changed_after_compile_are_never_stale(opts):
    m = SideBranch().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
        c(x)
        m.a.weight.add_(0.5)  # in-place mutation, named as the model names it
        with pytest.warns(UserWarning, match=r"weight a\.weight changed after compile"):
            got = c(x)
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
        m.b.weight = torch.nn.Parameter(torch.randn(16, 16))  # replaced tensor
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = c(x)
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)


def test_alternating_model_instances_keep_their_compiled_variants(opts):
    """Two instances of one class share Dynamo's graph (parameters are its inputs). Each set
    of weights is compiled once and kept: alternating used to rebuild on every call and, after
    two rebuilds, ran the graph eagerly for good."""
    torch.manual_seed(0)
    a, b = SideBranch().eval(), SideBranch().eval()
    x = torch.randn(4, 16)
    run = torch.compile(lambda m, x: m(x), backend="fxpass_bpu", dynamic=False, options=opts)
    before = len(fxpass.compile_reports())
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for m in (a, b):
                torch.testing.assert_close(run(m, x), m(x), rtol=1e-5, atol=1e-5)
    messages = [str(w.message) for w in caught]
    # b is another instance, not a's weights changed: compiled once, no warning
    assert not any("changed after compile" in msg or "keep changing" in msg for msg in messages)
    assert len(fxpass.compile_reports()) - before == 2  # one compile per set of weights
    a.a.weight.data.add_(1.0)  # through .data: not seen by the guard (documented) ...
    with torch.no_grad():
        a.a.weight.add_(0.5)  # ... but this is, and rebuilds a's variant only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(run(a, x), a(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(run(b, x), b(x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_generate_with_compiled_forward_matches_eager(opts):
    model, kwargs = zoo.get("qwen3", layers=1)
    ids = kwargs["input_ids"][:, :4]
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
        before = len(fxpass.compile_reports())
        model.forward = torch.compile(
            model.forward, backend="fxpass_bpu", dynamic=False, options=opts
        )
        got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(got, expected)
    reports = fxpass.compile_reports()[before:]
    assert len(reports) >= 1 and all(len(r.regions) >= 1 for r in reports)


def test_dynamic_shapes_are_specialized_without_a_warning(opts):
    """dynamic=True used to put the whole graph on the CPU with a warning asking for
    dynamic=False; now each input signature gets a static variant (fxpass/jit/shapes.py)."""
    import fxpass

    m = SideBranch().eval()
    with torch.no_grad(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c = torch.compile(m, backend="fxpass_bpu", dynamic=True, options=opts)
        for n in (3, 5):
            x = torch.randn(n, 16)
            torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert not [x for x in w if "fxpass" in str(x.message)]
    assert "shape variant 2" in str(fxpass.compile_reports()[-1])


def test_training_graph_stays_eager_with_correct_gradients(opts):
    m = SideBranch()
    x = torch.randn(4, 16)
    m(x).sum().backward()
    expected = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    with pytest.warns(UserWarning, match="inference graphs only"):
        torch.compile(m, backend="fxpass_bpu", options=opts)(x).sum().backward()
    for e, p in zip(expected, m.parameters(), strict=True):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("options, message", [
    ({"strict": "yes"}, r"'strict' \(raise instead of falling back to eager\) must be a bool; "
                        r"got str 'yes'$"),
    ({"cache_dir": 3}, r"'cache_dir' .* must be a string or a path or None; got int 3$"),
    ({"disable": "erf_gelu"}, r"must be a list; got str 'erf_gelu'; for one rule write "
                              r"\['erf_gelu'\]$"),
    ({"min_compute_macs": True}, r"must be an int or None; got bool True$"),
])
def test_option_type_errors_name_the_type_wanted(options, message):
    """Found by a probe: the message read "must be raise instead of falling back to eager;
    got str" (the help text in place of the type)."""
    from fxpass.jit.options import from_options as validate_options

    with pytest.raises(TypeError, match=message):
        validate_options(options, "bpu")


def test_options_are_validated(opts):
    m = SideBranch().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        with pytest.raises(Exception, match="unknown option.*Valid options: march"):
            torch.compile(m, backend="fxpass_bpu", options={"marhc": "nash-p"})(x)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="min_compute_macs"):
            torch.compile(m, backend="fxpass_bpu", options={"min_compute_macs": "big"})(x)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="unknown march"):
            torch.compile(m, backend="fxpass_bpu", options={"march": "nash-z"})(x)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="known rules"):
            torch.compile(m, backend="fxpass_bpu", options={"disable": ["nope"]})(x)
        torch._dynamo.reset()
        got = torch.compile(m, backend="fxpass_bpu", mode="max-autotune")(x)  # explained, ok
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="unknown mode"):
            torch.compile(m, backend="fxpass_bpu", mode="turbo")(x)


def test_strict_raises_when_a_region_cannot_run(opts, monkeypatch):
    import fxpass.backends.onnx.compile as comp
    import fxpass.backends.onnx.host.build as build

    def broken(*a, **k):
        raise RuntimeError("injected compile failure")

    monkeypatch.setattr(comp, "lower", broken)
    monkeypatch.setattr(build, "lower_weightless", broken)  # the host path's lowering
    m = SideBranch().eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="failed to compile and runs eagerly"):
            got = torch.compile(m, backend="fxpass_bpu", options={**opts, "cache": False})(x)
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="injected compile failure"):
            torch.compile(
                m, backend="fxpass_bpu", options={**opts, "cache": False, "strict": True}
            )(x)


def test_guard_keeps_one_variant_per_weights_and_evicts_stale_versions():
    """GuardedGraph directly: a second set of weights adds a variant, switching back hits it,
    and an in-place write replaces the variant of those same tensors (it can never match again)."""
    from fxpass.graph import FROZEN
    from fxpass.jit.guarded import GuardedGraph
    from fxpass.jit.options import from_options as validate_options
    from tests.conftest import trace

    x, w1, w2 = torch.randn(4, 16), torch.randn(16, 16), torch.randn(16, 16)
    gm = trace(lambda x, w: torch.relu(x @ w.t()), x, w1)
    gm.graph.find_nodes(op="placeholder")[1].meta[FROZEN] = w1
    g = GuardedGraph(gm, validate_options({"min_compute_macs": 0, "cache": False}, "bpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for w in (w1, w2, w1, w2):
            torch.testing.assert_close(g(x, w), torch.relu(x @ w.t()), rtol=1e-5, atol=1e-5)
        assert len(g.variants) == 2 and g.rebuilds == 0  # w2: another instance's weights
        w1.add_(1.0)
        torch.testing.assert_close(g(x, w1), torch.relu(x @ w1.t()), rtol=1e-5, atol=1e-5)
    assert len(g.variants) == 2 and g.rebuilds == 1  # w1's old version evicted, w2's kept
    assert all(sig[0][2] == w1._version for sig in g.variants if sig[0][1] == w1.data_ptr())


def _session_options(monkeypatch) -> list:
    """The options of every host session opened from now on (filled as they open)."""
    from fxpass.backends.onnx.host import ort as runtime

    made = []
    real_init = runtime.OrtExecutor.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self.session.get_session_options())

    monkeypatch.setattr(runtime.OrtExecutor, "__init__", spy)
    return made


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_mixed_cpu_and_region_graph_stops_pool_spinning(opts, monkeypatch):
    """A mixture-of-experts forward is several regions with torch's routing between them.
    onnxruntime's pool threads must stop spinning after each run (``force_spinning_stop``):
    left spinning they made this graph about 11x slower than eager on 2 cores
    (`benchmarks.probes.spinning`).
    Checked on every session the compile makes, cold and from a plan hit."""
    made = _session_options(monkeypatch)
    model, kwargs = zoo.get("qwen3-moe", layers=2, tokens=16)
    with torch.no_grad():
        expected = model(**kwargs).logits
        for _ in range(2):  # cold, then a plan hit from the same cache
            torch._dynamo.reset()
            before = len(fxpass.compile_reports())
            got = torch.compile(model, backend="fxpass_bpu", dynamic=False, options=opts)(
                **kwargs
            ).logits
            (r,) = fxpass.compile_reports()[before:]
            assert len(r.regions) > 1 and all(reg.fallback is None for reg in r.regions), str(r)
            _compare(expected, got, torch.float32)
    assert len(made) >= 2 * len(r.regions)
    assert {o.get_session_config_entry("session.force_spinning_stop") for o in made} == {"1"}


def test_sessions_open_without_the_memory_pattern(opts, monkeypatch):
    """Every host session opens with onnxruntime's memory pattern off: with it, a session's
    second run allocated and faulted in a fresh planned block, so each shape variant's second
    call ran 5-15% slower than its later ones (``benchmarks.probes.second_run``). Checked on
    the sessions of two shape variants, cold and from a plan hit, and their values."""
    made = _session_options(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    xs = [torch.randn(2, 32), torch.randn(5, 32)]
    with torch.no_grad():
        for _ in range(2):  # cold, then a plan hit from the same cache
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fxpass_ort", dynamic=False, options=opts)
            for x in xs * 2:  # each variant's first and second run
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(made) >= 4
    assert {o.enable_mem_pattern for o in made} == {False}


def test_max_reduction_runs_as_a_pool_in_the_region_with_eager_nan_and_inf(opts):
    """amax/amin become a max-pool over a [1, M, 1, K] view (amax_to_max_pool): the lowered
    pool must give eager's NaN, +-inf and all--inf rows, inside one region."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x, bias):
            y = self.fc(x) + bias
            return torch.amax(y, dim=-1), torch.amin(y, dim=(0, 2)), y.max(dim=1).values

    m = M().eval()
    x = torch.randn(3, 5, 8)
    bias = torch.zeros(3, 5, 8)
    bias[0, 0, 3] = float("nan")
    bias[1, 2, :] = float("-inf")
    bias[2, 4, 1] = float("inf")
    before = len(fxpass.compile_reports())
    with torch.no_grad():
        want = m(x, bias)
        got = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)(x, bias)
    (r,) = fxpass.compile_reports()[before:]
    assert len(r.regions) == 1 and r.regions[0].fallback is None, str(r)
    assert r.rewrites.get("amax_to_max_pool", 0) >= 2, str(r)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)


def test_a_graph_that_fails_before_partitioning_runs_eagerly_with_a_warning(opts, monkeypatch):
    # a failure before there are regions (here: in the rewrite phase) must not end the user's
    # program: the captured graph is eager's answer; strict=True raises
    import fxpass.jit.backend as be

    def broken(self, gm, **kw):
        raise RuntimeError("injected rule failure")

    monkeypatch.setattr(be.PassManager, "run", broken)
    m = SideBranch().eval()
    x = torch.randn(2, 16)
    before = len(fxpass.compile_reports())
    with torch.no_grad():
        with pytest.warns(RegionFallbackWarning, match="failed to compile and runs eagerly.*inj"):
            got = torch.compile(m, backend="fxpass_bpu", options={**opts, "cache": False})(x)
        torch.testing.assert_close(got, m(x), rtol=0, atol=0)
        (report,) = fxpass.compile_reports()[before:]
        assert report.regions == [] and "injected rule failure" in report.notes[0]
        torch._dynamo.reset()
        with pytest.raises(Exception, match="injected rule failure"):
            torch.compile(m, backend="fxpass_bpu", options={**opts, "strict": True})(x)


def test_check_mode_contract_errors_are_not_swallowed_by_the_fallback(opts, monkeypatch):
    # check=True asks for rule-contract failures; the graph-level fallback must not turn them
    # into a warning (review)
    import fxpass.jit.backend as be
    from fxpass import ContractError

    def broken(self, gm, **kw):
        raise ContractError("injected contract violation")

    monkeypatch.setattr(be.PassManager, "run", broken)
    m = SideBranch().eval()
    with torch.no_grad(), pytest.raises(Exception, match="injected contract violation"):
        torch.compile(m, backend="fxpass_bpu", options={**opts, "cache": False, "check": True})(
            torch.randn(2, 16)
        )


class _Block(torch.nn.Module):
    """A layer with a graph break inside: Dynamo compiles each half once, and every layer
    calls the same two graphs with its own weights."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        torch._dynamo.graph_break()
        return x + self.down(h)


def _stack(n):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block() for _ in range(n))).eval()


def test_graph_break_inside_repeated_layers_compiles_each_layers_weights(opts):
    """Found probing output_attentions=True (HF graph-breaks inside each decoder layer): the
    weight guard took layer 2's weights for layer 1's weights changed, warned, rebuilt, and
    after two rebuilds ran every layer's graph eagerly for good. Another instance's weights are
    a variant: compiled once each, no warning, and calls after the first compile nothing."""
    from fxpass.jit.backend import STATS

    m, x = _stack(6), torch.randn(4, 16)
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    before = len(fxpass.compile_reports())
    STATS.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert not [str(w.message) for w in caught if "fxpass" in str(w.message)]
    reports = fxpass.compile_reports()[before:]
    assert STATS["variants"] == len(reports) - 2  # two graphs, compiled for 6 weight sets
    assert all(r.regions for r in reports)  # none fell back to eager
    assert sum("another instance's weights" in " ".join(r.notes) for r in reports) == len(
        reports) - 2
    compiled = len(reports)
    with torch.no_grad():
        c(x)
    assert len(fxpass.compile_reports()) == before + compiled  # every variant kept


def test_more_weight_sets_than_max_variants_run_eagerly_with_a_reason(opts):
    m, x = _stack(5), torch.randn(4, 16)
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options={**opts, "max_variants": 2})
    with torch.no_grad():
        with pytest.warns(UserWarning, match="more than 2 sets of weights.*max_variants"):
            for _ in range(2):
                torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
        n = len(fxpass.compile_reports())
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert len(fxpass.compile_reports()) == n  # eager now: no more compiles
    torch._dynamo.reset()
    strict = torch.compile(
        m, backend="fxpass_bpu", dynamic=False,
        options={**opts, "max_variants": 2, "strict": True},
    )
    with torch.no_grad(), pytest.raises(Exception, match="more than 2 sets of weights"):
        for _ in range(2):
            strict(x)


def test_max_variants_must_be_positive():
    from fxpass.jit.options import from_options as validate_options

    with pytest.raises(TypeError, match="max_variants"):
        validate_options({"max_variants": 0}, "bpu")


class _CachedAttention(torch.nn.Module):
    """gpt-fast style: the KV cache is a pair of module buffers the forward writes in place."""

    def __init__(self, d=64, slots=32):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.register_buffer("k_cache", torch.zeros(1, slots, d))
        self.register_buffer("v_cache", torch.zeros(1, slots, d))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, pos):
        q, k, v = self.qkv(x).chunk(3, -1)
        self.k_cache.index_copy_(1, pos, k)
        self.v_cache.index_copy_(1, pos, v)
        self.steps += 1
        mask = torch.arange(self.k_cache.shape[1]) <= pos[-1]
        a = torch.nn.functional.scaled_dot_product_attention(
            q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.o(a)


@pytest.mark.parametrize("strict", [False, True])
def test_buffers_the_model_writes_are_state_not_frozen_weights(opts, strict):
    """Found by a probe: buffers written by the forward itself (a KV cache, a step counter)
    were frozen like weights, so every call found them changed: two warned rebuilds, then the
    graph ran eagerly for good (strict=True raised on the second call)."""
    torch.manual_seed(0)
    m, ref = _CachedAttention().eval(), _CachedAttention().eval()
    ref.load_state_dict(m.state_dict())
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options={**opts, "strict": strict})
    before = len(fxpass.compile_reports())
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(5):
            x, pos = torch.randn(1, 1, 64), torch.tensor([t])
            torch.testing.assert_close(c(x, pos), ref(x, pos), rtol=1e-5, atol=1e-5)
    assert not [str(w.message) for w in caught if "fxpass" in str(w.message)]
    reports = fxpass.compile_reports()[before:]
    assert len(reports) == 1 and len(reports[0].regions) >= 1  # compiled once, offloaded
    for name in ("k_cache", "v_cache", "steps"):
        torch.testing.assert_close(getattr(m, name), getattr(ref, name))


def test_a_frozen_buffer_written_between_calls_becomes_an_input_once(opts):
    """A buffer frozen at compile (the graph only reads it) that is then written in place
    (by the user, or by another graph of the model): the first write recompiles with the new
    values (a ``load_state_dict`` keeps BatchNorm statistics foldable), a second one makes it
    an input read at every call; no warning, never a stale answer, and later writes cost
    nothing."""
    from fxpass.jit.backend import STATS

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.register_buffer("scale", torch.ones(16))

        def forward(self, x):
            return self.lin(x) * self.scale

    m, x = Scaled().eval(), torch.randn(4, 16)
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    STATS.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
        before = len(fxpass.compile_reports())
        for _ in range(3):
            m.scale.mul_(2.0)
            torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert not [str(w.message) for w in caught if "fxpass" in str(w.message)]
    assert STATS["unfrozen_buffers"] == 1
    assert len(fxpass.compile_reports()) == before + 2  # two recompiles for three writes
    assert "now read at every call" in " ".join(fxpass.compile_reports()[-1].notes)
    with torch.no_grad():
        m.lin.weight.mul_(0.5)  # a parameter still is a weight: guarded as before
        with pytest.warns(UserWarning, match="changed after compile"):
            torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)


def _outputs_match_eager(m, x, opts):
    """Compile ``m`` (static shapes), run it on ``x`` and compare every output with eager's
    (float32 tolerances); returns the compiled outputs."""
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    with torch.no_grad():
        outs, ref = c(x), m(x)
    for got, want in zip(outs, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return outs


def test_outputs_over_one_storage_alias_as_in_eager(opts):
    """Found by a probe: ``y, y.view(2, 16), y[0]`` came back as three separate buffers, so a
    write to one output did not show in the others (eager, aot_eager and inductor share)."""

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return y, y.view(2, 16), y[0], torch.relu(y).t()  # the last: one view, not shared

    m, x = Views().eval(), torch.randn(4, 8)
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    with torch.no_grad():
        a, b, d, e = c(x)
        ref = m(x)
    for got, want in zip((a, b, d, e), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert d.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    a.mul_(0)
    assert bool((b == 0).all()) and bool((d == 0).all())
    report = fxpass.compile_reports()[-1]
    assert len(report.regions) == 1
    shared = [k for k, count in report.cpu_reasons.items() if "over the same memory" in k]
    assert len(shared) == 1 and report.cpu_reasons[shared[0]] == 2  # the view and the select


def test_a_graph_worth_offloading_that_offloads_nothing_says_why(tmp_path):
    """Found by a probe: a float64 model compiled to 0 regions without a word (only the report
    said why). A graph above ``min_compute_macs`` that offloads nothing warns once, naming its
    most common CPU reason."""
    from fxpass.jit import backend as backend_mod

    backend_mod._WARNED.discard(next((k for k in backend_mod._WARNED if "float64" in k), ""))
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 256)).double().eval()
    x = torch.randn(64, 256, dtype=torch.float64)
    c = torch.compile(m, backend="fxpass_bpu", options={"cache_dir": str(tmp_path)})
    with torch.no_grad(), pytest.warns(UserWarning, match="runs entirely on the CPU.*float64"):
        torch.testing.assert_close(c(x), m(x))
    assert not fxpass.compile_reports()[-1].regions



def test_load_state_dict_on_a_graph_broken_stack_recompiles_each_layer_once(opts):
    """Found in review: the rebuild limit was per graph, so one ``load_state_dict`` on a
    model whose layers share a graph (a graph break inside each) sent every layer's graph to
    eager after the third layer. The limit is per set of tensors now."""
    m, x = _stack(6), torch.randn(4, 16)
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c(x)
        m.load_state_dict(_stack(6).state_dict() | {"0.up.bias": torch.ones(32)})
        for _ in range(2):
            torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    messages = [str(w.message) for w in caught if "fxpass" in str(w.message)]
    assert messages and all("(1/2)" in msg for msg in messages)
    assert all(r.regions for r in fxpass.compile_reports())


class _SharedNormBlock(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.lin = norm, torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(self.norm(x))
        torch._dynamo.graph_break()
        return x + torch.relu(h)


def test_layers_sharing_a_module_are_instances_not_changes(opts):
    """Found in review: layers sharing one LayerNorm (ALBERT style) share half of their graph's
    weights, which the first rule read as one layer's weights changed: two warned rebuilds,
    then eager. Only a write in place is a change."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(16)
    m = torch.nn.Sequential(*(_SharedNormBlock(norm) for _ in range(4))).eval()
    x = torch.randn(4, 16)
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
    assert not [str(w.message) for w in caught if "fxpass" in str(w.message)]
    assert all(r.regions for r in fxpass.compile_reports() if r.macs)  # the halves with GEMMs


def test_aliased_outputs_through_split_and_views_used_inside(opts):
    """From the review of the aliasing fix: outputs that are pieces of one ``chunk`` still came
    back as separate buffers (the chain stopped at ``getitem``), and a returned view that the
    graph also used inside was pinned to the CPU between two GEMMs (two regions for one)."""

    class Pieces(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(16, 16)

        def forward(self, x):
            y = self.lin(x)
            a, b = y.chunk(2, dim=-1)
            v = y.view(-1, 16)
            return y, a, b, v, self.lin2(v)

    y, a, b, v, _ = _outputs_match_eager(Pieces().eval(), torch.randn(4, 8), opts)
    for piece in (a, b, v):
        assert piece.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    y.mul_(0)
    assert bool((a == 0).all()) and bool((b == 0).all()) and bool((v == 0).all())
    assert len(fxpass.compile_reports()[-1].regions) == 1


class _Restrides(torch.nn.Module):
    """``as_strided`` over tensors whose eager layout is not the one a region returns: a
    transposed GEMM result (a view), a CPU op's result laid out after its transposed input
    (``cos`` is no device op), and a view with a storage offset."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).t()
        z = torch.cos(y)  # on the CPU; eager keeps y's transposed layout
        w = (self.lin(x) * 2).t()[1:]  # offset 1 into its base's storage
        return (y.as_strided((4, 3), (1, 4)), z.as_strided((3, 5), (2, 3)),
                w.as_strided((3, 3), (1, 8)), w.as_strided((2, 2), (3, 1), 2))


def test_as_strided_reads_eager_layout_over_region_outputs(opts):
    """Found by a probe: a region returns its outputs contiguous, so an ``as_strided`` on the
    CPU over a value eager holds transposed read other elements, silently (Longformer's
    sliding-chunk attention: 1.4e-2 off). The reader's views are rebuilt on the CPU over a
    copy of their base in eager's strides."""
    torch.manual_seed(0)
    _outputs_match_eager(_Restrides().eval(), torch.randn(4, 8), opts)
    report = fxpass.compile_reports()[-1]
    assert report.regions  # the GEMMs still run on the device
    assert any("addresses memory" in k for k in report.cpu_reasons)


def test_restrided_lays_values_out_in_the_given_strides():
    from fxpass.partition.partition import restrided

    base = torch.arange(12.0).reshape(3, 4)
    eager = base.t()  # strides (1, 4)
    got = restrided(eager.contiguous(), [1, 4], 0)
    assert got.stride() == (1, 4) and torch.equal(got, eager)
    assert torch.equal(got.as_strided((4, 3), (3, 1)), eager.as_strided((4, 3), (3, 1)))
    sliced = base.t()[1:]  # offset 1 into the storage
    got = restrided(sliced.contiguous(), list(sliced.stride()), 1)
    assert got.storage_offset() == 1 and torch.equal(got, sliced)
    same = torch.randn(2, 3)
    assert restrided(same, [3, 1], 0) is same  # already laid out: no copy


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
def test_integer_pow_wraps_as_in_eager(opts, dtype):
    """Found by a probe: onnxruntime's integer Pow does not wrap on overflow, aten's does
    (``(-16) ** 9 == 0`` in int32); integer pow stays on the CPU."""
    w = torch.randn(8, 8)

    def f(x, i):
        return (x @ w) * (i ** 9).float() + (2 ** i).float() + (i ** i).float()

    x = torch.randn(2, 8)
    i = (torch.arange(-8, 8).reshape(2, 8) * 2).to(dtype)
    with torch.no_grad():
        got = torch.compile(f, backend="fxpass_bpu", dynamic=False, options=opts)(x, i)
    torch.testing.assert_close(got, f(x, i), rtol=1e-5, atol=1e-5)
    reasons = fxpass.compile_reports()[-1].cpu_reasons
    assert any("does not wrap on overflow" in k for k in reasons), reasons


def test_a_raising_rule_is_named_with_its_plugin_and_the_fix(opts, monkeypatch):
    """Found by a probe: a user's plugin rule that raised sent the graph to eager with
    "please report it" (to fxpass); the warning names the rule's plugin and how to skip it."""
    import fxpass.jit.backend as be
    from fxpass.rewriter import RuleError

    def broken(self, gm, **kw):
        raise RuleError("cse", "add_1", ValueError("boom"))

    monkeypatch.setattr(be.PassManager, "run", broken)
    m, x = SideBranch().eval(), torch.randn(2, 16)
    fix = r"rule 'cse' is plugin .*options=\{'disable': \['cse'\]\}"
    with torch.no_grad(), pytest.warns(RegionFallbackWarning, match=fix):
        torch.compile(m, backend="fxpass_bpu", options={**opts, "cache": False})(x)


def test_a_bad_fxpass_variable_is_an_error_naming_it(monkeypatch):
    """Found by a probe: FXPASS_REWRITE_LIMIT=abc sent every graph to eager with a warning."""
    from fxpass.jit.options import from_options as validate_options

    monkeypatch.setenv("FXPASS_REWRITE_LIMIT", "abc")
    with pytest.raises(ValueError, match="FXPASS_REWRITE_LIMIT='abc' is invalid"):
        validate_options({"cache": False}, "bpu")


def test_as_strided_of_a_split_piece_used_inside_and_returned_beside_another(opts):
    """From the review: a split piece both as_strided and used by a region, another piece
    returned: the split went to the CPU for the aliasing, its piece joined the region, and
    the region failed to compile (its input was the split's list)."""

    class Pieces(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(4, 4)

        def forward(self, x):
            p, q = self.lin(x).t().split(4)
            return p.as_strided((2, 2), (1, 4), 1), self.l2(p), q

    _outputs_match_eager(Pieces().eval(), torch.randn(4, 8), {**opts, "strict": True})
    assert all(r.fallback is None for r in fxpass.compile_reports()[-1].regions)


def test_as_strided_readers_of_one_base_share_one_copy_of_it(opts):
    """Three as_strided readers of one transposed GEMM result: one copy of it in eager's
    layout (each reader's views are its own): 1 copy + 4 views on the CPU, not 3 copies."""

    class Readers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x).t()
            return (y.as_strided((4, 3), (1, 4)), y.as_strided((2, 2), (2, 1), 1),
                    y[1:].as_strided((3,), (2,)))

    _outputs_match_eager(Readers().eval(), torch.randn(4, 8), opts)
    reasons = fxpass.compile_reports()[-1].cpu_reasons
    assert [v for k, v in reasons.items() if "addresses memory" in k] == [5], reasons


def test_a_graph_that_is_one_region_is_called_without_its_graph(monkeypatch):
    """A whole graph offloaded runs as a ``DirectRegion`` (no graph forward, module call or
    thread switch per call), returning region outputs and passed-through inputs in the graph's
    order; a failing executor still falls back to the region's eager graph."""
    from fxpass.graph import FROZEN
    from fxpass.jit.guarded import GuardedGraph
    from fxpass.jit.options import from_options as validate_options
    from fxpass.jit.runtime import DirectRegion, RegionFallbackWarning
    from tests.conftest import trace

    x, w = torch.randn(4, 16), torch.randn(16, 16)
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple:
        y = torch.relu(x @ w.t())
        return y, x, torch.tanh(y)

    gm = trace(fn, x, w)
    gm.graph.find_nodes(op="placeholder")[1].meta[FROZEN] = w
    g = GuardedGraph(gm, validate_options({"min_compute_macs": 0, "cache": False}, "ort"))
    assert isinstance(g.run, DirectRegion), type(g.run)
    assert g.run.outs == [(0, 0), (1, 0), (0, 1)]
    got = g(x, w)
    assert isinstance(got, tuple) and len(got) == 3 and got[1] is x
    torch.testing.assert_close(got[0], torch.relu(x @ w.t()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], torch.tanh(got[0]), rtol=1e-5, atol=1e-5)

    def broken(*tensors):
        raise RuntimeError("device lost")

    monkeypatch.setattr(g.run.region, "executor", broken)
    with pytest.warns(RegionFallbackWarning, match="device lost"):
        again = g(x, w)
    torch.testing.assert_close(again[0], got[0], rtol=1e-5, atol=1e-5)
