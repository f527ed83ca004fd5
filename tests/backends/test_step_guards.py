"""Later decode steps of one generate() call check only the differentiating guards
(``fxpass.hf.steps``): eager's tokens, and every guard wherever that is not sound.

Greedy fp32 tokens must equal eager's exactly. ``steps.STEPS`` counts the steps run each way.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
import warnings

import pytest
import torch
from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import StaticLayer

from fxpass.hf import generation, quiet, steps
from fxpass.jit.held import HELD
from fxpass.tools import zoo

N = 8  # new tokens: a prefill and N - 1 decode steps


def _model(name: str = "qwen3", **kw):
    model, inputs = zoo.get(name, layers=2, tokens=6, **kw)
    return model, inputs["input_ids"]


def _generate(model, ids, n=N, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def _run(model, ids, **kw):
    """The output, the steps that skipped the full guard check (trusted or replayed,
    ``fxpass.hf.replay``) and those that ran it."""
    before = steps.STEPS.copy()
    out = _generate(model, ids, **kw)
    now = steps.STEPS
    skipped = sum(now[k] - before[k] for k in ("trusted", "replayed"))
    return out, skipped, now["full"] - before["full"]


def test_later_steps_trust_and_keep_eager_tokens(opts):
    model, ids = _model()
    expected = _generate(model, ids, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    got, trusted, full = _run(model, ids)
    assert torch.equal(got, expected)
    # prefill, the first decode step (compiles), the second (every guard, same graph): the
    # N - 3 steps after them check only the differentiating guards
    assert (trusted, full) == (N - 3, 3)
    # a new call starts over with every guard: nothing compiles, so one decode step suffices
    again, trusted, full = _run(model, ids)
    assert torch.equal(again, expected)
    assert (trusted, full) == (N - 2, 2)


@pytest.mark.slow  # (the second tier: each compiles two models or twice)
def test_a_batch_of_another_size_is_told_apart_and_matches(opts):
    model, ids = _model()
    batch = torch.cat([ids, ids.flip(-1)])
    expected = _generate(model, batch, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    _generate(model, ids)
    got, trusted, _ = _run(model, batch)  # batch 2: its prefill and decode graphs compile
    assert torch.equal(got, expected) and trusted == N - 3


@pytest.mark.slow  # (the second tier: each compiles two models or twice)
def test_a_change_between_calls_is_seen_by_the_full_check(opts):
    """What the guards protect between two generate() calls still recompiles: the first
    steps of every call run every guard."""
    model, ids = _model()
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    _generate(model, ids)
    for layer in model.model.layers:
        layer.self_attn.scaling *= 4.0
    uncompiled = getattr(model.forward, generation.UNCOMPILED)
    compiled_forward, model.forward = model.forward, uncompiled
    expected = _generate(model, ids, cache_implementation="static")
    model.forward = compiled_forward
    got, trusted, _ = _run(model, ids)
    assert torch.equal(got, expected)
    assert trusted == N - 3  # the decode graph was compiled again, then trusted


@pytest.mark.parametrize("compiled_beside_it", [False, True])
def test_another_python_thread_keeps_every_guard(opts, compiled_beside_it):
    """torch's stance is process-wide: with another (non-fxpass) Python thread alive, no step
    runs under it. Graphs compiled while it was alive are still this model's (their backend
    object is), so once it is gone the steps are trusted again."""
    model, ids = _model()
    expected = _generate(model, ids, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    if not compiled_beside_it:
        _generate(model, ids)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="user-thread")
    other.start()
    try:
        got, trusted, full = _run(model, ids)
    finally:
        stop.set()
        other.join()
    assert torch.equal(got, expected)
    assert (trusted, full) == (0, N)
    again, trusted, _ = _run(model, ids)
    assert torch.equal(again, expected) and trusted == N - 2


def test_step_guards_all_checks_every_step(opts):
    model, ids = _model()
    expected = _generate(model, ids, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort",
                                    step_guards="all")
    got, trusted, _ = _run(model, ids)
    assert torch.equal(got, expected) and trusted == 0


def test_a_non_default_stance_is_left_alone(opts):
    model, ids = _model()
    expected = _generate(model, ids, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    _generate(model, ids)
    with torch.compiler.set_stance("fail_on_recompile"):
        got, trusted, _ = _run(model, ids)
    assert torch.equal(got, expected) and trusted == 0


def _scale_attention(model):
    for layer in model.model.layers:  # a constant the graphs bake in, same shapes
        layer.self_attn.scaling *= 4.0


def _other_weights(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


@pytest.mark.slow  # (the second tier: compiles two models)
@pytest.mark.parametrize("change, trusts", [(_scale_attention, 0), (_other_weights, 1)],
                         ids=["another-constant", "other-weights"])
def test_two_models_of_one_class_keep_eager_tokens(opts, change, trusts):
    """Under the stance Dynamo checks no module attribute or weight, and HF's forward wrapper
    is one code object for every model. A second model whose graphs have the same shapes but
    another constant would pass: while such graphs exist, no step of either is trusted. Two
    instances that differ only in their weights share Dynamo's graphs (fxpass's weight guard
    builds each its own variant): the one whose calls compiled them may trust its steps, and
    replay them (``fxpass.hf.replay``). Both keep eager's tokens either way."""
    model, ids = _model()
    other, _ = _model()
    change(other)
    expected = _generate(model, ids, cache_implementation="static")
    expected_other = _generate(other, ids, cache_implementation="static")
    assert not torch.equal(expected, expected_other)
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    generation.compile_for_generate(other, max_cache_len=32, options=opts, device="ort")
    for _ in range(2):
        counts = []
        for m, want in ((model, expected), (other, expected_other)):
            before = steps.STEPS.copy()
            assert torch.equal(_generate(m, ids), want)
            counts.append(tuple(steps.STEPS[k] - before[k] for k in ("trusted", "replayed")))
    # the first decode step runs every guard and is watched, the second (trusted) teaches
    # the plan; the N - 3 after them replay
    assert counts == [(trusts, trusts and N - 3), (0, 0)], counts


@pytest.mark.slow  # (the second tier: compiles twice)
def test_compiling_the_model_again_keeps_its_graphs_its_own(opts):
    """compile_for_generate again with equal options: the new torch.compile hits the graphs
    of the first (an equal backend), which stay this model's, so its steps are trusted."""
    model, ids = _model()
    expected = _generate(model, ids, cache_implementation="static")
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    _generate(model, ids)
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    got, trusted, full = _run(model, ids)
    assert torch.equal(got, expected) and (trusted, full) == (N - 2, 2)


def test_a_trusted_step_that_misses_runs_again_under_every_guard():
    """A change the step's signature cannot see (a tensor inside an object passed by
    identity): the differentiating guards miss, torch refuses to compile under the stance,
    and the step runs again under every guard, with the right answer."""

    class Box:
        def __init__(self, t):
            self.t = t

    def raw(x, box):
        return x + box.t.sum()

    fn = torch.compile(raw, backend="eager", dynamic=False)
    guards = steps.StepGuards("auto", steps.Owner(raw, fn))
    x, box = torch.ones(2), Box(torch.ones(3))
    before = steps.STEPS.copy()
    for _ in range(3):  # compiles, runs every guard, then trusted
        assert torch.equal(guards.call(fn, (x, box), {}, True), x + 3)
    box.t = torch.ones(5)  # same box, same signature: the next step is trusted and misses
    assert torch.equal(guards.call(fn, (x, box), {}, True), x + 5)
    assert torch.equal(guards.call(fn, (x, box), {}, True), x + 5)
    counts = {k: steps.STEPS[k] - before[k] for k in ("trusted", "missed", "full")}
    assert counts == {"trusted": 1, "missed": 1, "full": 4}, counts


def test_bad_step_guards_is_refused_naming_the_choices():
    model, _ = _model()
    with pytest.raises(ValueError, match=r"step_guards must be one of \('auto', 'all'\)"):
        generation.compile_for_generate(model, max_cache_len=32, step_guards="none")


def test_signature_tells_shapes_values_and_objects_apart():
    a, cache = torch.zeros(1, 1, dtype=torch.long), object()
    mask = {"full": torch.zeros(1, 1, 1, 8)}
    sig = steps.signature((), {"input_ids": a, "past_key_values": cache, "use_cache": True,
                               "attention_mask": mask})
    assert sig == steps.signature((), {"use_cache": True, "past_key_values": cache,
                                       "input_ids": torch.ones(1, 1, dtype=torch.long),
                                       "attention_mask": {"full": torch.ones(1, 1, 1, 8)}})
    for change in ({"input_ids": torch.zeros(1, 2, dtype=torch.long)},
                   {"input_ids": torch.zeros(1, 1, dtype=torch.int32)},
                   {"input_ids": torch.zeros(1, 2, dtype=torch.long)[:, :1]},
                   {"past_key_values": object()}, {"use_cache": False}, {"use_cache": 1},
                   {"attention_mask": {"full": torch.zeros(1, 1, 1, 4)}}):
        other = {"input_ids": a, "past_key_values": cache, "use_cache": True,
                 "attention_mask": mask, **change}
        assert steps.signature((), other) != sig, change


class _CountedGuard(list):
    """A weight guard's entries that count how often the guard reads them."""

    reads = 0

    def __iter__(self):
        _CountedGuard.reads += 1
        return super().__iter__()


def _count_weight_guards(monkeypatch) -> None:
    """Graphs compiled from here on keep their weight guard in a :class:`_CountedGuard`."""
    from fxpass.jit.guarded import GuardedGraph

    snapshot = GuardedGraph._snapshot
    monkeypatch.setattr(GuardedGraph, "_snapshot",
                        lambda self, gm: _CountedGuard(snapshot(self, gm)))


class _Never(StoppingCriteria):
    """A stopping criterion of the caller's: the call is not quiet; ``write`` runs once, after
    step ``at``."""

    def __init__(self, write=None, at=0):
        self.write, self.at, self.seen = write, at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.seen += 1
        if self.write is not None and self.seen == self.at:
            self.write()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_quiet_call_skips_the_weight_guard_on_trusted_steps(opts, monkeypatch):
    """With nothing of the caller's between steps, only the steps under every guard read the
    weight guard; with a stopping criterion of the caller's, every step reads it."""
    model, ids = _model()
    expected = _generate(model, ids, cache_implementation="static")
    _count_weight_guards(monkeypatch)
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    _generate(model, ids)
    for criteria, reads in ((None, 2), (StoppingCriteriaList([_Never()]), N)):
        _CountedGuard.reads = 0
        got, trusted, full = _run(model, ids, stopping_criteria=criteria)
        assert torch.equal(got, expected)
        assert (trusted, full, _CountedGuard.reads) == (N - 2, 2, reads)


def test_a_weight_the_callers_code_writes_between_trusted_steps_is_seen(opts):
    """A stopping criterion flips the final norm's sign after the fifth token, between two
    trusted steps: the compiled model follows eager's tokens, which change there."""
    model, ids = _model()
    reference = copy.deepcopy(model)

    def flip(m):
        return lambda: m.model.norm.weight.mul_(-1.0)

    expected = _generate(reference, ids, cache_implementation="static",
                         stopping_criteria=StoppingCriteriaList([_Never(flip(reference), 5)]))
    assert not torch.equal(expected, _generate(model, ids, cache_implementation="static"))
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    _generate(model, ids)
    with pytest.warns(UserWarning, match="changed after compile; recompiling"):
        got, trusted, _ = _run(model, ids,
                               stopping_criteria=StoppingCriteriaList([_Never(flip(model), 5)]))
    assert torch.equal(got, expected) and trusted > 0


@pytest.mark.parametrize("arg", quiet.CALLERS_CODE)
def test_every_callers_argument_makes_a_call_not_quiet(arg):
    model, ids = _model()
    generation.compile_for_generate(model, max_cache_len=32, device="ort")
    assert quiet.quiet_call(model, (ids,), {arg: None}, generation._ours)
    assert not quiet.quiet_call(model, (ids,), {arg: object()}, generation._ours)


class _Mode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Layer(StaticLayer):
    def get_seq_length(self):
        return super().get_seq_length()


def test_quiet_names_what_runs_between_steps():
    model, ids = _model()
    generation.compile_for_generate(model, max_cache_len=32, device="ort")

    def is_quiet(*args, **kwargs):
        return quiet.quiet_call(model, (ids, *args), kwargs, generation._ours)

    assert is_quiet() and is_quiet(None, None)
    assert not is_quiet(None, StoppingCriteriaList())  # anything past the config
    assert not is_quiet(past_key_values=_Layer(max_cache_len=32))  # a class of the caller's
    cache = StaticCache(config=model.config, max_cache_len=32)
    assert is_quiet(past_key_values=cache)
    cache.layers[0] = _Layer(max_cache_len=32)  # a layer class of the caller's
    assert not is_quiet(past_key_values=cache)
    handle = model.register_forward_pre_hook(lambda m, a: None)
    assert not is_quiet()
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert not is_quiet()
    finally:
        handle.remove()
    with _Mode():
        assert not is_quiet()
    sys.settrace(lambda *a: None)
    try:
        assert not is_quiet()
    finally:
        sys.settrace(None)
    assert not is_quiet(ids.as_subclass(_Sub))  # its __torch_function__ runs per op
    assert is_quiet()


def test_a_function_on_the_model_or_its_class_makes_a_call_not_quiet():
    model, ids = _model()
    generation.compile_for_generate(model, max_cache_len=32, device="ort")

    def is_quiet():
        return quiet.quiet_call(model, (ids,), {}, generation._ours)

    cls, name = type(model), "_update_model_kwargs_for_generation"
    setattr(model, name, lambda *a, **k: None)
    assert not is_quiet()
    setattr(model, name, getattr(cls, name))
    assert not is_quiet()  # a plain function: the class's, but not bound to the model
    delattr(model, name)
    setattr(model, name, getattr(model, name))
    assert is_quiet()  # the class's own, bound
    delattr(model, name)
    compiled = model.forward  # wrapped as accelerate's hooks wrap it: its markers copied

    @functools.wraps(compiled)
    def hooked(*args, **kwargs):
        return compiled(*args, **kwargs)

    model.forward = hooked
    assert not is_quiet()
    model.forward = compiled
    assert is_quiet()
    original = getattr(cls, name)

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    setattr(cls, name, patched)  # patched on the class, by name and module transformers'
    try:
        assert not is_quiet()
    finally:
        setattr(cls, name, original)
    assert is_quiet()


class _Sub(torch.Tensor):
    pass


_INNER: list = []


@torch.library.custom_op("fxpass_test_step_guards::inner", mutates_args=())
def _call_inner(t: torch.Tensor) -> torch.Tensor:
    return _INNER[0](t)


@_call_inner.register_fake
def _(t):
    return torch.empty_like(t)


def test_the_held_flag_is_the_first_graphs_alone(opts):
    """A trusted step's flag skips the weight guard of the forward's own graph only: a
    compiled model called from inside it (through a custom op) checks its weights."""
    torch.manual_seed(0)
    inner = torch.nn.Linear(8, 8)
    _INNER[:] = [inner]
    outer = torch.compile(lambda t: _call_inner(t * 2.0) + 1.0, backend="fxpass_ort",
                          dynamic=False, options=opts)
    x = torch.randn(2, 8)
    with torch.no_grad():
        outer(x)  # compiled around the eager inner model
        _INNER[:] = [torch.compile(inner, backend="fxpass_ort", dynamic=False, options=opts)]
        _INNER[0](x)
        outer(x)
        inner.weight.mul_(-1.0)
        HELD.on = True
        try:
            with pytest.warns(UserWarning, match="changed after compile; recompiling"):
                got = outer(x)
        finally:
            HELD.on = False
        assert torch.allclose(got, inner(x * 2.0) + 1.0, atol=1e-6)


def test_a_model_first_compiled_inside_a_custom_op_sees_its_weights_unchanged(opts):
    """Compiled from inside an op's kernel (where autograd's keys are off), a weight's
    ``detach()`` gets a version counter of its own, at 0: the guard reads the weight's own
    counter, so the next call does not take an unchanged weight for a written one (it
    recompiled with a warning before), and a write after that is still seen."""
    torch.manual_seed(0)
    inner = torch.nn.Linear(8, 8)
    assert inner.weight._version > 0  # its init wrote it in place
    _INNER[:] = [torch.compile(inner, backend="fxpass_ort", dynamic=False, options=opts)]
    outer = torch.compile(lambda t: _call_inner(t * 2.0) + 1.0, backend="fxpass_ort",
                          dynamic=False, options=opts)
    x = torch.randn(2, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.allclose(outer(x), inner(x * 2.0) + 1.0, atol=1e-6)
        assert not [w for w in seen if "changed after compile" in str(w.message)]
        inner.weight.mul_(-1.0)
        assert torch.allclose(outer(x), inner(x * 2.0) + 1.0, atol=1e-6)
        assert [w for w in seen if "changed after compile" in str(w.message)]
