"""Decode steps replayed without Dynamo's frame (``fxpass.hf.replay``): eager's tokens, only
on quiet calls, and never for a frame with Python effects to replay."""

from __future__ import annotations

import warnings

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from fxpass.hf import generation, steps
from fxpass.jit.held import HELD
from fxpass.tools import zoo

N = 8  # new tokens: a prefill and N - 1 decode steps


def _generate(model, ids, n=N, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def _counted(model, ids, **kw):
    before = steps.STEPS.copy()
    out = _generate(model, ids, **kw)
    return out, {k: steps.STEPS[k] - before[k] for k in ("full", "trusted", "replayed")}


class _Box:  # (not a SimpleNamespace: Dynamo breaks the graph at its __setattr__)
    calls, flag = 0, False


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_decode_steps_replay_the_graph_with_eager_tokens(opts):
    model, inputs = zoo.get("qwen3", layers=2, tokens=6)
    ids = inputs["input_ids"]
    expected = _generate(model, ids, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    got, n = _counted(model, ids)
    assert torch.equal(got, expected)
    # prefill and the first decode step compile, the second runs every guard and is watched,
    # the third is trusted and teaches the plan: the rest are replayed
    assert n == {"full": 3, "trusted": 1, "replayed": N - 4}, n
    again, n = _counted(model, ids)  # a new call learns again, from its first two steps
    assert torch.equal(again, expected)
    assert n == {"full": 2, "trusted": 1, "replayed": N - 3}, n
    # a call with the caller's code between steps is not quiet: trusted steps, no replay
    other, n = _counted(model, ids, stopping_criteria=StoppingCriteriaList([_Never()]))
    assert torch.equal(other, expected)
    assert n == {"full": 2, "trusted": N - 2, "replayed": 0}, n


def test_a_replayed_step_returns_what_the_frame_returns(opts, monkeypatch):
    """The forward's output object from a replayed step: the same type and fields as the
    compiled frame's, the cache the object passed in, and the last step's logits eager's on
    the same tokens (fp32: rtol 1e-4, atol 1e-5)."""
    from fxpass.hf import replay

    model, inputs = zoo.get("llama", layers=2, tokens=6)
    ids = inputs["input_ids"]
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    with torch.no_grad():
        framed = model(ids[:, :1])  # through Dynamo's frame (no cache: a plain forward)
    outputs = []
    call = replay.Plan.__call__

    def keep(self, kwargs, hold):
        out = call(self, kwargs, hold)
        outputs.append((out, kwargs["past_key_values"]))
        return out

    monkeypatch.setattr(replay.Plan, "__call__", keep)
    tokens = _generate(model, ids)
    assert len(outputs) == N - 4
    for out, cache in outputs:
        assert type(out) is type(framed) and set(out.keys()) == set(framed.keys())
        assert out.past_key_values is cache
    uncompiled = getattr(model.forward, generation.UNCOMPILED)
    with torch.no_grad():
        ref = uncompiled(tokens[:, :-1]).logits[:, -1]
    torch.testing.assert_close(outputs[-1][0].logits[:, -1], ref, rtol=1e-4, atol=1e-5)


def _graph_of(fn, *args):
    """The guarded graph ``fn``'s one compiled frame ran (through ``HELD.tap``)."""
    compiled = torch.compile(fn, backend="fxpass_ort", dynamic=False,
                             options={"min_compute_macs": 0, "cache": False})
    HELD.tap = tap = []
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(*args)
    finally:
        HELD.tap = None
    (graph, _, _), = tap
    return graph


def test_a_frame_that_writes_python_state_is_never_replayed():
    """``GuardedGraph.pure``: set only for frames whose Python effects are no-ops (an
    attribute written back to its value, the frame's own ``**kwargs``)."""
    torch._dynamo.reset()
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    box = _Box()

    def counts(x, w):
        box.calls += 1  # state that outlives the call: a replay would skip it
        return torch.relu(x @ w)

    def sets_and_resets(x, w, **kwargs):
        box.flag = True
        kwargs["seen"] = True  # the call's own dict
        y = torch.relu(x @ w)
        box.flag = False
        return y

    def plain(x, w):
        return torch.relu(x @ w)

    assert _graph_of(counts, x, w).pure is False
    assert box.calls == 1
    assert _graph_of(sets_and_resets, x, w).pure is True
    assert _graph_of(plain, x, w).pure is True


class _Drift(torch.nn.Module):
    """A logit bias whose schedule a function Dynamo does not trace advances after the LM
    head: Python outside the step's one graph (with nested graph breaks on, the forward stays
    one frame) that a replay would skip (found in review)."""

    def __init__(self, inner, vocab):
        super().__init__()
        self.inner = inner
        self.register_buffer("t", torch.zeros(()))
        self.register_buffer("vocab_ids", torch.arange(vocab))

    @torch.compiler.disable
    def _advance(self):
        self.t.add_(1)

    def forward(self, x):
        y = self.inner(x) + 50.0 * (self.vocab_ids == self.t + 100)  # boosts token 100 + t
        self._advance()
        return y


def test_a_forward_with_a_graph_break_is_never_replayed(opts):
    with torch._dynamo.config.patch(nested_graph_breaks=True):
        _graph_break_case(opts)


def _graph_break_case(opts):
    import copy

    model, inputs = zoo.get("qwen3", layers=2, tokens=6)
    model.lm_head = _Drift(model.lm_head, model.config.vocab_size)
    ids = inputs["input_ids"]
    reference = copy.deepcopy(model)
    expected = _generate(reference, ids, cache_implementation="static")
    assert expected[0, -3:].tolist() == [105, 106, 107]  # the bias sets every token
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    model.lm_head.t.zero_()
    got, n = _counted(model, ids)
    assert torch.equal(got, expected)
    assert n["replayed"] == 0 and n["trusted"] == 0, n


def test_a_frame_that_changes_the_grad_mode_is_never_replayed():
    """Dynamo keeps a frame's grad-mode change out of its side effects (the graph stays
    pure); watching the call sees it and learns no plan."""
    from fxpass.hf import replay

    torch._dynamo.reset()
    x, w = torch.randn(4, 16), torch.randn(16, 16)

    def enables(x, w):
        torch._C._set_grad_enabled(True)
        return torch.relu(x @ w)

    compiled = torch.compile(enables, backend="fxpass_ort", dynamic=False,
                             options={"min_compute_macs": 0, "cache": False})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(x, w)  # compiles
        torch._C._set_grad_enabled(False)
        _, seen = replay.watched(compiled, (x, w), {})
        assert torch.is_grad_enabled()  # the frame's effect, which a replay would not make
        torch._C._set_grad_enabled(False)
        _, plain = replay.watched(_graph_of_call(x, w), (x, w), {})
    assert seen is None and plain is not None


def _graph_of_call(x, w):
    compiled = torch.compile(lambda x, w: torch.relu(x @ w), backend="fxpass_ort",
                             dynamic=False, options={"min_compute_macs": 0, "cache": False})
    compiled(x, w)
    return compiled


def test_beam_search_is_never_replayed(opts):
    """HF's beam search reorders the static cache by rebinding its buffers every step: no
    argument is the same object twice, so no plan is learned (docs/generation.md says so)."""
    model, inputs = zoo.get("qwen3", layers=2, tokens=6)
    ids = inputs["input_ids"]
    expected = _generate(model, ids, num_beams=2, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    got, n = _counted(model, ids, num_beams=2)
    assert torch.equal(got, expected)
    assert n["replayed"] == 0, n
