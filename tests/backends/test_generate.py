"""generate() through fxpass_bpu: static cache, two graphs, one region each, eager's tokens.

Greedy fp32 tokens must be identical to eager's. Graph and region counts come from
``fxpass.compile_reports()``. Models are real transformers classes from small configs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxpass
from fxpass.backends.bpu import compile_for_generate
from fxpass.hf import generation
from fxpass.hf.generation import GrowingCacheWarning
from fxpass.jit.runtime import RegionFallbackWarning
from fxpass.tools import zoo

# the second tier (pytest -m slow): long generation and many-architecture sweeps
pytestmark = pytest.mark.slow

DECODERS = ["qwen3", "llama", "mistral", "gpt2"]


def _model(name: str):
    model, kw = zoo.get(name, layers=2, tokens=8)
    return model, kw["input_ids"]


def _generate(model, ids, n=6, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def _new_reports(before):
    return fxpass.compile_reports()[before:]


@pytest.mark.parametrize("device", ["bpu", "ort"])
@pytest.mark.parametrize("name", DECODERS)
def test_static_cache_generate_is_two_graphs_of_one_region(name, device, opts):
    """On the BPU and on the ort device: the same framework, the device's capability."""
    model, ids = _model(name)
    expected = _generate(model, ids, cache_implementation="static")
    before = len(fxpass.compile_reports())
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device=device)
    got = _generate(model, ids)
    again = _generate(model, ids, n=10)  # another length under the same ceiling: no recompile
    assert torch.equal(got, expected)
    torch.testing.assert_close(again[:, : got.shape[1]], got, rtol=0, atol=0)
    reports = _new_reports(before)
    assert len(reports) == 2, [r.summary() for r in reports]
    for r in reports:
        assert len(r.regions) == 1, str(r)
        assert r.regions[0].fallback is None, str(r)
        assert r.mac_share == 1.0, str(r)
        assert r.rewrites.get("kv_cache_update", 0) == 2 * 2, r.rewrites  # K and V per layer
        # only the embedding and integer index arithmetic stay on the CPU (plus rotary cos/sin,
        # which the BPU table lacks, and the cache writes themselves); eq/le compare positions
        # (the cache-write one-hot, a causal mask built in the graph)
        allowed = ("embedding", "int64", "eq.Tensor", "le.Tensor", "index_select", "copy_",
                   "cos", "sin")
        odd = [why for why in r.cpu_reasons if not any(a in why for a in allowed)]
        assert not odd, odd


def test_decode_step_writes_the_cache_in_place_and_copies_no_cache(opts):
    model, ids = _model("qwen3")
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=32, options=opts)
    _generate(model, ids)
    decode = _new_reports(before)[1]
    (region,) = decode.regions
    # the region's outputs are the logits and the new K/V slots, never a whole cache
    assert region.outputs == 1 + 2 * 2, str(decode)
    assert "aten.index_copy_.default is not in the nash-p operator table" in decode.cpu_reasons


def test_host_fusions_fire_and_keep_eager_tokens(opts):
    model, ids = _model("qwen3")
    expected = _generate(model, ids, cache_implementation="static")
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=32, options=opts)
    assert torch.equal(_generate(model, ids), expected)
    for r in _new_reports(before):
        fused = r.regions[0].fusions
        # 2 layers: input norm, q/k norms, post-attention norm, final norm; residuals fold in
        assert fused.get("rms_normalization", 0) >= 5, fused
        assert fused.get("skip_rms_normalization", 0) >= 2, fused
        # every layer's attention (GQA over the static cache) is one Attention node
        assert fused.get("attention") == model.config.num_hidden_layers, fused
        # q and k of every layer rotate in one RotaryEmbedding node
        assert fused.get("rotary_embedding") == 2 * model.config.num_hidden_layers, fused
        assert "host fusions: " in str(r)


def test_host_fusions_can_be_switched_off(opts):
    model, ids = _model("qwen3")
    expected = _generate(model, ids, cache_implementation="static")
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=32, options={**opts, "host_fusions": False})
    assert torch.equal(_generate(model, ids), expected)
    assert all(not r.regions[0].fusions for r in _new_reports(before))


def test_dynamic_cache_warns_once_and_names_the_fix(opts):
    model, ids = _model("qwen3")
    expected = _generate(model, ids, n=4)
    model.forward = torch.compile(model.forward, backend="fxpass_bpu", dynamic=False, options=opts)
    import fxpass.hf.generation as gen

    gen._warned = False
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _generate(model, ids, n=4)
    assert torch.equal(got, expected)
    growing = [x for x in w if issubclass(x.category, GrowingCacheWarning)]
    assert len(growing) == 1, [str(x.message) for x in w]
    assert 'cache_implementation="static"' in str(growing[0].message)
    assert "compile_for_generate" in str(growing[0].message)


def test_sampling_with_a_seed_matches_eager(opts):
    model, ids = _model("llama")
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model.generate(
            ids, max_new_tokens=6, do_sample=True, top_k=0, cache_implementation="static"
        )
        compile_for_generate(model, max_cache_len=32, options=opts)
        torch.manual_seed(1)
        got = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0)
    assert torch.equal(got, expected)


def test_batch_size_change_recompiles_and_matches(opts):
    model, ids = _model("qwen3")
    ids2 = torch.cat([ids, ids.flip(-1)])
    expected1 = _generate(model, ids, cache_implementation="static")
    expected2 = _generate(model, ids2, cache_implementation="static")
    compile_for_generate(model, max_cache_len=32, options=opts)
    assert torch.equal(_generate(model, ids), expected1)
    assert torch.equal(_generate(model, ids2), expected2)
    assert torch.equal(_generate(model, ids), expected1)


def test_cache_overflow_raises_like_eager(opts):
    from transformers import StaticCache

    model, ids = _model("qwen3")

    def overflow(m):
        cache = StaticCache(config=m.config, max_cache_len=4)  # shorter than the 8-token prompt
        with torch.no_grad():
            return m(ids, past_key_values=cache, use_cache=True)

    with pytest.raises((IndexError, RuntimeError)) as eager_err:
        overflow(model)
    model.forward = torch.compile(model.forward, backend="fxpass_bpu", dynamic=False, options=opts)
    with pytest.raises((IndexError, RuntimeError)) as ours:
        overflow(model)
    assert "index" in str(ours.value).lower(), (str(eager_err.value), str(ours.value))


def test_compile_for_generate_rejects_bad_input():
    with pytest.raises(ValueError, match="max_cache_len"):
        compile_for_generate(torch.nn.Linear(2, 2), max_cache_len=0)
    with pytest.raises(ValueError, match="max_cache_len"):  # a bool is no length
        compile_for_generate(_model("qwen3")[0], max_cache_len=True)
    # options are checked here, not at the first generate() inside Dynamo's own error
    with pytest.raises(TypeError, match="'strict' .* must be a bool"):
        compile_for_generate(_model("qwen3")[0], max_cache_len=8, options={"strict": "yes"})
    with pytest.raises(TypeError, match="generation_config"):
        compile_for_generate(torch.nn.Linear(2, 2), max_cache_len=8)


def test_max_new_tokens_past_the_cache_ceiling_recompiles_and_matches(opts):
    model, ids = _model("qwen3")
    expected = _generate(model, ids, n=12, cache_implementation="static")
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=12, options=opts)  # shorter than 8 + 12
    assert torch.equal(_generate(model, ids, n=12), expected)
    reports = _new_reports(before)
    assert len(reports) == 2 and all(len(r.regions) == 1 for r in reports)


def test_printed_report_shows_rewrites_per_rule(opts):
    model, ids = _model("gpt2")
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=32, options=opts)
    _generate(model, ids, n=2)
    text = str(_new_reports(before)[-1])
    assert "rewrites: " in text and "kv_cache_update x4" in text, text


def _sliding(window: int = 8):
    """Mistral with a sliding window: HF's static cache keeps a Python-int token counter."""
    model, kw = zoo.get("mistral", layers=2, tokens=4, sliding_window=window)
    return model, kw["input_ids"]


def test_sliding_window_cache_is_one_graph_per_regime(opts):
    from fxpass.hf.generation import RecompileWarning
    from fxpass.hf.steps import STEPS

    model, ids = _sliding()
    # 4 prompt tokens + 12 new cross the 8-slot window: the cache fills, then rolls
    expected = _generate(model, ids, n=12, cache_implementation="static")
    short = _generate(model, ids, n=3, cache_implementation="static")
    before = len(fxpass.compile_reports())
    trusted, replayed = STEPS["trusted"], STEPS["replayed"]
    compile_for_generate(model, max_cache_len=32, options=opts)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        # 4 + 3 tokens fit the window: prefill and one decode graph
        assert torch.equal(_generate(model, ids, n=3), short)
        assert len(_new_reports(before)) == 2
        got = _generate(model, ids, n=12)
        again = _generate(model, ids, n=12)  # the counter restarts: no new graph
    assert torch.equal(got, expected) and torch.equal(again, expected)
    reports = _new_reports(before)
    # prefill, decode while the window fills, decode once it is full: not one per token
    assert len(reports) == 3, [r.summary() for r in reports]
    for r in reports:
        assert len(r.regions) == 1 and r.regions[0].fallback is None, str(r)
        assert r.mac_share == 1.0, str(r)
        assert not any("symbolic shapes" in n for n in r.notes), r.notes
    rolled = reports[-1].rewrites
    assert rolled.get("roll_to_cat") == 2 * 2 and rolled.get("index_put_to_copy") == 2 * 2, rolled
    assert not [x for x in w if issubclass(x.category, RecompileWarning)]
    # the regime changes mid-call, which only the full guard check sees: no step is trusted
    # (nor replayed)
    assert (STEPS["trusted"], STEPS["replayed"]) == (trusted, replayed)


def test_sliding_window_recompiles_warn_once_naming_the_fix(opts):
    import fxpass.hf.generation as gen

    model, ids = _sliding()
    expected = _generate(model, ids, n=4, cache_implementation="static")
    # the plain torch.compile path: the counter is specialized, one graph per token
    model.forward = torch.compile(model.forward, backend="fxpass_bpu", dynamic=False, options=opts)
    gen._recompiles.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _generate(model, ids, n=4, cache_implementation="static")
    assert torch.equal(got, expected)
    warned = [str(x.message) for x in w if issubclass(x.category, gen.RecompileWarning)]
    assert len(warned) == 1, warned
    assert "cumulative_length_int" in warned[0] and "compile_for_generate" in warned[0]


def _eager_then_compiled(model, ids, max_cache_len: int, opts):
    """Greedy generate() with per-step scores: eager (static cache), then compiled; and the
    compile reports of the compiled run."""
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(ids, cache_implementation="static", **kw)
        before = len(fxpass.compile_reports())
        compile_for_generate(model, max_cache_len=max_cache_len, options=opts)
        got = model.generate(ids, **kw)
    return expected, got, _new_reports(before)


def _seq2seq(name: str):
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    if name == "t5":  # unscaled attention, relative position bias, cross-attention cache
        cfg = T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                       num_heads=4, decoder_start_token_id=0)
        model = T5ForConditionalGeneration(cfg)
    else:
        cfg = BartConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4,
                         encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)
        model = BartForConditionalGeneration(cfg)
    return model.eval(), torch.randint(2, 512, (1, 8))


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_generate_matches_eager_scores(name, opts):
    # Not a decoder-only model: the decoder's first call writes a whole cross-attention cache
    # (8 positions at once) beside the one-token self-attention cache. T5's K and V cache
    # updates shared a fake value, and the attention decomposition read V as K: different
    # logits from the first token (found by trying encoder-decoders, which no issue names).
    model, ids = _seq2seq(name)
    expected, got, reports = _eager_then_compiled(model, ids, 16, opts)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores, strict=True):  # fp32 logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert 1 <= len(reports) <= 2, [r.summary() for r in reports]
    assert all(len(r.regions) == 1 for r in reports), [str(r) for r in reports]


def test_bf16_generate_is_one_region_per_graph(opts):
    # BF16 promotion casts each new K/V row back to BF16 for the cache write-back right where
    # the row is computed: that CPU cast sealed the region mid-layer (3 regions for 2 layers)
    # until the partitioner learnt to sink CPU nodes to their first user.
    model, ids = _model("qwen3")
    model = model.to(torch.bfloat16)
    expected, got, reports = _eager_then_compiled(model, ids, 32, opts)
    # the regions compute in float32 (more accurate than eager's BF16 steps): BF16 tolerances
    first = ids.shape[1] + 1
    assert torch.equal(got.sequences[:, :first], expected.sequences[:, :first])
    torch.testing.assert_close(got.scores[0], expected.scores[0], rtol=2e-2, atol=2e-2)
    assert len(reports) == 2, [r.summary() for r in reports]
    assert [len(r.regions) for r in reports] == [1, 1], [str(r) for r in reports]


def test_compile_for_generate_again_recompiles_the_models_own_forward(opts):
    """Found by a probe: a second call (to change max_cache_len) raised torch's "already has a
    get_compiler_config attribute" from inside the first compile's wrapper."""
    from fxpass.hf.generation import UNCOMPILED

    model, ids = _model("qwen3")
    own = model.forward
    expected = _generate(model, ids, cache_implementation="static")
    compile_for_generate(model, max_cache_len=32, options=opts)
    assert torch.equal(_generate(model, ids), expected)
    compile_for_generate(model, max_cache_len=16, options=opts)
    assert getattr(model.forward, UNCOMPILED) == own  # not the first compile's wrapper
    assert model.generation_config.max_cache_len == 16
    assert torch.equal(_generate(model, ids), expected)


def test_an_input_growing_every_call_warns_once_naming_the_cause(opts):
    """Found by a probe: MPT under transformers 5 keeps no KV cache, so generate() feeds the
    whole sequence at every token; each length was a new graph until Dynamo's limit, with no
    word from fxpass. Lengths that jump (new prompts) are ordinary recompiles."""
    import fxpass.hf.generation as gen

    w = torch.randn(16, 16)

    def step(x):
        return torch.softmax(x @ w, dim=-1).sum(1)

    c = torch.compile(step, backend="fxpass_bpu", dynamic=False, options=opts)
    gen._recompiles.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (4, 9, 15):  # jumps: no warning
            x = torch.randn(1, n, 16)
            torch.testing.assert_close(c(x), step(x))
        quiet = [str(m.message) for m in caught if issubclass(m.category, gen.RecompileWarning)]
        for n in (16, 17, 18, 19):  # one longer every call
            x = torch.randn(1, n, 16)
            torch.testing.assert_close(c(x), step(x))
    warned = [str(m.message) for m in caught if issubclass(m.category, gen.RecompileWarning)]
    assert not quiet
    assert len(warned) == 1, warned
    assert "grew by one along dim 1" in warned[0] and "fixed length" in warned[0]


def test_a_weight_variant_rebuilt_at_run_time_is_no_recompile(opts):
    """From the review: Dynamo keeps its last recompile reason after a compile ends, and the
    per-layer variants of a graph-broken stack, built at run time, counted one length change
    once per layer: a false "grows every call" warning."""
    import fxpass.hf.generation as gen
    from tests.backends.test_backend import _stack  # a graph break inside each layer

    m = _stack(3)
    c = torch.compile(m, backend="fxpass_bpu", dynamic=False, options=opts)
    gen._recompiles.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (8, 9):
            x = torch.randn(1, n, 16)
            torch.testing.assert_close(c(x), m(x))
    assert not [w for w in caught if issubclass(w.category, gen.RecompileWarning)]


class _ThreadSpy:
    """A logits processor: HF calls it between two forward calls of generate()."""

    def __init__(self, fail_at: int | None = None):
        self.seen: list[int] = []
        self.fail_at = fail_at

    def __call__(self, input_ids, scores):
        self.seen.append(torch.get_num_threads())
        if self.fail_at is not None and len(self.seen) >= self.fail_at:
            raise RuntimeError("spy stops generate()")
        return scores


@pytest.mark.parametrize("loop_threads", [1, None])
def test_hf_loop_between_steps_runs_on_loop_threads(opts, loop_threads):
    """Over a real vocabulary HF's per-step logits ops are parallel, and torch's OpenMP workers
    then spin into the next step's region (benchmarks.probes.loop_threads)."""
    from transformers import LogitsProcessorList

    model, ids = _model("qwen3")
    expected = _generate(model, ids, cache_implementation="static")
    compile_for_generate(model, max_cache_len=32, options=opts, loop_threads=loop_threads)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    import fxpass.jit.guarded as be

    steps = []
    real = be.GuardedGraph.__call__

    def entry(self, *args):  # the backend's entry: before the graph sets its own count
        steps.append(torch.get_num_threads())
        return real(self, *args)

    try:
        be.GuardedGraph.__call__ = entry
        spy = _ThreadSpy()
        got = _generate(model, ids, logits_processor=LogitsProcessorList([spy]))
        after = torch.get_num_threads()
    finally:
        be.GuardedGraph.__call__ = real
        torch.set_num_threads(prev)
    assert torch.equal(got, expected)
    assert len(spy.seen) == 6 and set(spy.seen) == {1 if loop_threads else 2}, spy.seen
    assert len(steps) == 6 and set(steps) == {2}, steps  # every step gets the caller's count
    assert after == 2  # the caller's count once generate() returns


def test_loop_threads_state_is_per_python_thread():
    """From the review: a forward on another thread inside this one's generate() took this
    thread's count and kept loop_threads after."""
    import threading

    from fxpass.hf.generation import _GenerateState

    loop = _GenerateState(1)
    loop.caller = 2
    seen = []
    t = threading.Thread(target=lambda: seen.append(loop.caller))
    t.start()
    t.join()
    assert seen == [None] and loop.caller == 2


def test_generate_that_raises_restores_the_callers_threads(opts):
    from transformers import LogitsProcessorList

    model, ids = _model("qwen3")
    compile_for_generate(model, max_cache_len=32, options=opts)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="spy stops"):
            _generate(model, ids, logits_processor=LogitsProcessorList([_ThreadSpy(3)]))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(prev)
    assert after == 2


def test_compile_for_generate_rejects_bad_loop_threads():
    model, _ = _model("qwen3")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="loop_threads"):
            compile_for_generate(model, max_cache_len=16, loop_threads=bad)


@pytest.mark.parametrize("sliding", [False, True])
def test_step_counters_config_is_set_only_for_a_cache_that_counts_in_python(sliding):
    """The per-call config write cost 0.12-0.24 ms of cold Python per decode step; a cache
    without HF's Python-int counter must not pay it, one with it must still trace it
    symbolic, and the wrapper must not keep a finished generate()'s cache alive."""
    import gc
    import weakref

    from transformers import StaticCache

    from fxpass.hf.generation import (
        STEP_COUNTERS,
        _GenerateState,
        _step_counters_symbolic,
    )

    model, _ = _sliding() if sliding else _model("qwen3")
    seen = []

    def compiled(*args, **kwargs):
        seen.append(torch.compiler.config.dynamic_sources)
        return "out"

    forward = _step_counters_symbolic(compiled, model.forward, _GenerateState(None))
    before = torch.compiler.config.dynamic_sources
    cache = StaticCache(config=model.config, max_cache_len=16)
    assert forward(past_key_values=cache) == "out"
    assert forward(past_key_values=cache) == "out"  # decided once per cache object
    forward()  # no cache at all: the safe path, the config set
    assert seen[-1].endswith(STEP_COUNTERS)
    assert [STEP_COUNTERS in s for s in seen[:2]] == [sliding, sliding], seen
    assert torch.compiler.config.dynamic_sources == before  # restored after every call
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None


def _prompt(model, n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, n), generator=g)


@pytest.mark.parametrize("name", ["qwen3", "gpt2"])
def test_any_prompt_length_reuses_the_compiled_prefill(name, opts):
    """A new prompt length used to be a new prefill graph (seconds of compile each, eager past
    Dynamo's recompile limit). Now one length is the compiled chunk: shorter prompts and a
    longer prompt's tail run eagerly, its chunks reuse the graph. GPT-2 reads absolute
    positions, so a chunk at the wrong offset would change its tokens."""
    model, _ = _model(name)
    lengths = [8, 3, 13, 1, 8, 21, 16, 5, 24]
    prompts = [_prompt(model, n, seed=n) for n in lengths]
    expected = [_generate(model, p, cache_implementation="static") for p in prompts]
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=40, options=opts, prefill_chunk=8)
    graphs = []
    for p, e in zip(prompts, expected, strict=True):
        assert torch.equal(_generate(model, p), e), p.shape
        graphs.append(len(_new_reports(before)))
    # prefill (the first prompt, 8 tokens) and decode, for every length: the first chunk gets
    # the explicit mask HF passes the later ones (21 = 8 + 8 + a 5-token tail)
    assert graphs == [2] * len(lengths), graphs
    for r in _new_reports(before):
        assert len(r.regions) == 1 and r.regions[0].fallback is None, str(r)


def test_prompt_chunks_keep_eager_tokens_for_a_padded_batch(opts):
    """Left padding: HF slices the mask per chunk; batch 2, rows of different lengths. The
    region answers every chunk itself: the fused chunk attention (one row of a batch only,
    onnxruntime's rule) is not used for it, so nothing is declined."""
    model, _ = _model("llama")
    ids = _prompt(model, 13, batch=2, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second row is an 8-token prompt, left-padded
    expected = _generate(model, ids, attention_mask=mask, cache_implementation="static")
    compile_for_generate(model, max_cache_len=40, options=opts, prefill_chunk=4)
    before = len(fxpass.compile_reports())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionFallbackWarning)
        assert torch.equal(_generate(model, ids, attention_mask=mask), expected)
    # 13 = 4 + 4 + 4 (chunks) + 1 (the tail, a decode-shaped step); with padding HF passes
    # every chunk an explicit mask, so the first chunk and the later ones share a graph
    assert len(_new_reports(before)) == 2


def test_sliding_window_prompt_chunks_compile_per_cache_regime_not_per_length(opts):
    """HF's sliding layer takes a Python branch per cache regime: a chunk on an empty window,
    one that crosses it, one on a full window. Chunked prompts that reach those regimes add a
    prefill graph each, once; further lengths reuse them."""
    model, _ = _sliding(window=8)
    lengths = [6, 13, 20, 27]
    prompts = [_prompt(model, n, seed=n) for n in lengths]
    expected = [_generate(model, p, cache_implementation="static") for p in prompts]
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=48, options=opts, prefill_chunk=6)
    graphs = []
    for p, e in zip(prompts, expected, strict=True):
        assert torch.equal(_generate(model, p), e), p.shape
        graphs.append(len(_new_reports(before)))
    # 6 (+6 new: both decode regimes), 13 = 6 + 6 crossing the window + 1, 20 = ... + a
    # chunk on a full window, 27: nothing new
    assert graphs == [3, 4, 5, 5], graphs
    assert all(len(r.regions) == 1 for r in _new_reports(before))


def test_prefill_chunk_none_per_call_compiles_the_exact_length(opts):
    """``prefill_chunk_size=None`` in a generate() call opts out: the old exact-length graph."""
    model, _ = _model("qwen3")
    a, b = _prompt(model, 8), _prompt(model, 11, seed=1)
    expected = _generate(model, b, cache_implementation="static")
    compile_for_generate(model, max_cache_len=40, options=opts)
    before = len(fxpass.compile_reports())
    _generate(model, a)
    assert torch.equal(_generate(model, b, prefill_chunk_size=None), expected)
    assert len(_new_reports(before)) == 3  # 8-token prefill, decode, 11-token prefill


def test_compile_for_generate_rejects_bad_prefill_chunk():
    model, _ = _model("qwen3")
    for bad in (0, -2, True, 2.0, 17):
        with pytest.raises(ValueError, match="prefill_chunk"):
            compile_for_generate(model, max_cache_len=16, prefill_chunk=bad)


def _own_config(config: str, cls: str, **kw):
    """A small model from its family's own config (only sizes set): the architectures
    benchmark's shared config sets ``num_key_value_heads`` on families that ignore it."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = getattr(tf, config)(vocab_size=512, hidden_size=64, num_hidden_layers=2, **kw)
    return getattr(tf, cls)(cfg).eval()


def _falcon_chunked_prefill_fails(model, ids) -> bool:
    """transformers 5.23 sizes Falcon's (multi-query) early-initialized static cache with the
    wrong head count, so its own chunked prefill fails, eagerly too, on its own config."""
    try:
        _generate(model, ids, n=2, cache_implementation="static", prefill_chunk_size=4)
    except RuntimeError:
        return True
    return False


def test_a_model_whose_chunked_prefill_fails_runs_again_without_chunks(opts):
    from fxpass.hf.prefill import PrefillChunkWarning

    model = _own_config("FalconConfig", "FalconForCausalLM", num_attention_heads=4)
    a, b = _prompt(model, 8), _prompt(model, 11, seed=1)
    hf_fails = _falcon_chunked_prefill_fails(model, a)
    expected = [_generate(model, p, cache_implementation="static") for p in (a, b)]
    compile_for_generate(model, max_cache_len=40, options=opts)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = [_generate(model, p) for p in (a, b)]
    assert all(torch.equal(x, e) for x, e in zip(got, expected, strict=True))
    ours = [x for x in w if issubclass(x.category, PrefillChunkWarning)]
    if hf_fails:  # once, naming the model and HF's error; the second prompt does not try again
        assert len(ours) == 1, [str(x.message) for x in w]
        assert "FalconForCausalLM" in str(ours[0].message)
        assert "index_copy_" in str(ours[0].message)
    else:  # fixed in transformers: chunks stay on
        assert not ours, [str(x.message) for x in ours]


def test_an_error_after_the_prefill_is_not_retried(opts):
    """Only a failure inside the chunked prefill runs generate() again: a logits processor
    that raises at the third step raises once, after three calls, not six."""
    from transformers import LogitsProcessorList

    model, ids = _model("qwen3")
    compile_for_generate(model, max_cache_len=32, options=opts)
    spy = _ThreadSpy(3)
    with pytest.raises(RuntimeError, match="spy stops"):
        _generate(model, ids, logits_processor=LogitsProcessorList([spy]))
    assert len(spy.seen) == 3


class _Streamer:
    """HF's streamer protocol (``put`` then ``end``), recording what it is sent."""

    def __init__(self):
        self.puts: list[torch.Tensor] = []

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        pass


def test_a_streamer_never_sees_a_retried_prompt(opts):
    """Falcon's chunked prefill fails in transformers 5.23; a retry would stream the prompt a
    second time, so a streamer's call is not chunked until a chunked call has worked."""
    model = _own_config("FalconConfig", "FalconForCausalLM", num_attention_heads=4)
    ids = _prompt(model, 8)
    expected = _generate(model, ids, cache_implementation="static")
    compile_for_generate(model, max_cache_len=40, options=opts)
    streamer = _Streamer()
    got = _generate(model, ids, streamer=streamer)
    assert torch.equal(got, expected)
    assert torch.equal(streamer.puts[0], ids)  # the prompt, once
    assert torch.equal(torch.cat([p.reshape(-1) for p in streamer.puts[1:]]),
                       got[0, ids.shape[1]:])


def _prefill_calls(model, ids) -> list[int]:
    """Tokens per forward call of one generate() (the decode steps are the 1s at the end)."""
    return [n for n, _ in _masks_seen(model, ids)]


def test_the_automatic_chunk_is_chosen_again_after_a_warm_up_prompt(opts):
    """From the review: a one-token warm-up fixed the chunk at 1 for the model's life, and a
    30-token prompt then ran as 30 calls."""
    model, _ = _model("qwen3")
    compile_for_generate(model, max_cache_len=64, options=opts)
    assert _prefill_calls(model, _prompt(model, 1)) == [1, 1]
    assert _prefill_calls(model, _prompt(model, 30, seed=1)) == [30, 1]
    assert _prefill_calls(model, _prompt(model, 40, seed=2)) == [30, 10, 1]  # chosen once


def test_an_error_before_any_forward_call_is_not_retried_and_keeps_chunks(opts):
    """From the review: a bad argument raised twice, blamed HF's chunked prefill and turned
    chunks off for good."""
    from fxpass.hf.prefill import PrefillChunkWarning

    model, _ = _model("qwen3")
    compile_for_generate(model, max_cache_len=40, options=opts, prefill_chunk=8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="bogus"):
            _generate(model, _prompt(model, 8), bogus=1)
    assert not [x for x in w if issubclass(x.category, PrefillChunkWarning)]
    assert _prefill_calls(model, _prompt(model, 20, seed=1)) == [8, 8, 4, 1]  # still chunked


@pytest.mark.parametrize("option", ["use_cache", "output_hidden_states"])
def test_options_chunks_would_change_are_left_unchunked(option, opts):
    """HF chunks only into a cache (use_cache=False raised inside HF), and returns only the
    last chunk's prefill hidden states: those calls keep the exact length."""
    model, _ = _model("qwen3")
    ids = _prompt(model, 13)
    kw = {"use_cache": False} if option == "use_cache" else {
        "output_hidden_states": True, "return_dict_in_generate": True}
    # 3 new tokens: without a cache every step is a new input length, so a new graph
    expected = _generate(model, ids, n=3, cache_implementation="static", **kw)
    compile_for_generate(model, max_cache_len=40, options=opts, prefill_chunk=8)
    got = _generate(model, ids, n=3, **kw)
    if option == "use_cache":
        assert torch.equal(got, expected)
    else:
        assert torch.equal(got.sequences, expected.sequences)
        assert [h.shape for h in got.hidden_states[0]] == [
            h.shape for h in expected.hidden_states[0]]


def test_opt_on_its_own_config_keeps_chunks(opts):
    """The architectures benchmark's OPT (and GPT-NeoX, Bloom, ...) fell back only because its
    shared config sets num_key_value_heads, which HF's cache sizing reads and OPT ignores; on
    OPT's own config the prompts run in chunks, with eager's tokens and no warning."""
    from fxpass.hf.prefill import PrefillChunkWarning

    model = _own_config("OPTConfig", "OPTForCausalLM", ffn_dim=128, num_attention_heads=4,
                        word_embed_proj_dim=64)
    prompts = [_prompt(model, 8), _prompt(model, 21, seed=1)]
    expected = [_generate(model, p, cache_implementation="static") for p in prompts]
    compile_for_generate(model, max_cache_len=40, options=opts, prefill_chunk=8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = [_generate(model, p) for p in prompts]
        calls = _prefill_calls(model, prompts[1])
    assert all(torch.equal(x, e) for x, e in zip(got, expected, strict=True))
    assert not [x for x in w if issubclass(x.category, PrefillChunkWarning)]
    assert calls == [8, 8, 5, 1]


def _masks_seen(model, ids, n=2) -> list[tuple[int, list]]:
    """(tokens, the masks HF passed) per forward call of one generate()."""
    import functools

    compiled, seen = model.forward, []

    @functools.wraps(compiled)  # HF picks the arguments it passes from the signature
    def spy(*args, **kwargs):
        m = kwargs.get("attention_mask")
        masks = list(m.values()) if isinstance(m, dict) else [m]
        seen.append((kwargs["input_ids"].shape[-1], [None if x is None else x.clone()
                                                     for x in masks]))
        return compiled(*args, **kwargs)

    model.forward = spy
    try:
        _generate(model, ids, n=n)
    finally:
        model.forward = compiled
    return seen


def test_compiled_chunks_get_hf_mask_and_eager_calls_keep_hf_choice(opts):
    """HF leaves out the mask of a causal first chunk and passes one to the later chunks; the
    two compiled as two graphs. The compiled chunks now always get HF's mask: the first one is
    the plain causal mask (token i sees keys 0..i of the 40 slots). A prompt shorter than the
    chunk runs eagerly and keeps HF's choice (no mask: SDPA's is_causal), as in eager."""
    model, _ = _model("qwen3")
    long, short = _prompt(model, 21), _prompt(model, 5, seed=1)
    expected = [_generate(model, p, n=2, cache_implementation="static") for p in (long, short)]
    before = len(fxpass.compile_reports())
    compile_for_generate(model, max_cache_len=40, options=opts, prefill_chunk=8)
    seen = _masks_seen(model, long)
    assert [n for n, _ in seen] == [8, 8, 5, 1]
    (first,) = seen[0][1]
    causal = torch.ones(8, 40).tril().bool()  # [i, j]: j <= i
    assert first is not None and first.shape == (1, 1, 8, 40)
    assert torch.equal(first[0, 0], causal)
    assert all(m is not None for _, masks in seen for m in masks)
    seen = _masks_seen(model, short)
    assert [n for n, _ in seen] == [5, 1] and seen[0][1] == [None]
    assert len(_new_reports(before)) == 2  # one prefill graph, one decode graph
    for p, e in zip((long, short), expected, strict=True):
        assert torch.equal(_generate(model, p, n=2), e)
    assert len(_new_reports(before)) == 2


def test_a_model_with_its_own_mask_function_keeps_it(opts):
    """Models whose class writes its own ``create_masks_for_generate`` (Bloom's alibi, Gemma 3's
    image tokens) keep it: spelling their masks out with the generic functions would drop what
    theirs adds. The generic one is wrapped once, also when compiled again."""
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    compile_for_generate(bloom, max_cache_len=16, options=opts)
    assert "create_masks_for_generate" not in vars(bloom)
    model, _ = _model("qwen3")
    compile_for_generate(model, max_cache_len=16, options=opts)
    mine = vars(model)["create_masks_for_generate"]
    compile_for_generate(model, max_cache_len=24, options=opts)
    again = vars(model)["create_masks_for_generate"]
    assert again is not mine  # the new compile's wrapper, not the old one's
    import functools

    @functools.wraps(again)  # a caller's own wrapper around ours is the caller's: kept
    def theirs(*args, **kwargs):
        return again(*args, **kwargs)

    model.create_masks_for_generate = theirs
    compile_for_generate(model, max_cache_len=24, options=opts)
    assert vars(model)["create_masks_for_generate"] is theirs
