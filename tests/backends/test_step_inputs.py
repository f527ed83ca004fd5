"""Decode inputs stepped by one position (``fxpass.hf.inputs``) are HF's own, step by step.

Most cases run HF's ``generate()`` eagerly over a static cache with the stepping installed
by hand and ``check_all=True``: every stepped input is compared with what HF's
``prepare_inputs_for_generation`` returns for the same step (keys, dtypes, shapes, strides and
values), so a wrong mask or id fails the check, and the tokens must be eager's exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fxpass.hf import generation, inputs
from fxpass.tools import zoo

N = 8  # new tokens: a prefill and N - 1 decode steps


def _generate(model, ids, n=N, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              cache_implementation="static", **kw)


def _stepping(model, check_all=False):
    """Stepping installed by hand; every stepped dict is also compared with what HF's
    function returns for the same call (``compared``), and the stepped one is what the model
    gets."""
    steps = inputs.StepInputs(check_all=check_all)
    hf = model.prepare_inputs_for_generation
    stepped = inputs.stepping(hf, steps)
    compared = []

    @functools.wraps(hf)  # HF reads the signature to tell which arguments the model takes
    def prepare(input_ids, **kw):
        before = inputs.COUNTS["stepped"]
        out = stepped(input_ids, **kw)
        if inputs.COUNTS["stepped"] > before:
            why = inputs.differs(out, hf(input_ids, **kw))
            assert why is None, why
            compared.append(input_ids.shape[1])
        return out

    model.prepare_inputs_for_generation = prepare
    steps.active = True
    return steps, compared


def _counts():
    return dict(inputs.COUNTS)


def _delta(before):
    return {k: inputs.COUNTS[k] - before.get(k, 0) for k in ("stepped", "checked", "off")}


@pytest.mark.parametrize("family", ["qwen3", "llama", "gpt2"])
def test_every_stepped_input_is_hfs(family):
    model, kw = zoo.get(family, tokens=6) if family == "gpt2" else zoo.get(
        family, layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    steps, compared = _stepping(model)
    before = _counts()
    got = _generate(model, ids)
    assert steps.off is None
    assert torch.equal(got, expected)
    # the first decode step is HF's, the second is checked against HF's, and the N - 3 after
    # them are stepped (each also compared with HF's above)
    assert _delta(before) == {"stepped": N - 3, "checked": 1, "off": 0}
    assert len(compared) == N - 3


def test_check_all_compares_every_step():
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    steps, compared = _stepping(model, check_all=True)
    before = _counts()
    assert torch.equal(_generate(model, ids), expected) and steps.off is None
    assert _delta(before) == {"stepped": 0, "checked": N - 2, "off": 0} and not compared


def test_left_padded_batch_steps_with_its_mask():
    """A padded row's zeros stay masked in every step (the 2-D mask is read, not assumed)."""
    model, kw = zoo.get("llama", layers=2, tokens=6)
    ids = torch.cat([kw["input_ids"], kw["input_ids"].flip(-1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded by three
    expected = _generate(model, ids, attention_mask=mask)
    steps, compared = _stepping(model)
    got = _generate(model, ids, attention_mask=mask)
    assert steps.off is None and torch.equal(got, expected)
    assert len(compared) == N - 3


def test_rows_that_finish_early_step_on():
    """A row that generates the end token gets pad tokens from then on while the other row
    goes on; its mask keeps growing as HF's does."""
    model, kw = zoo.get("llama", layers=2, tokens=6)
    ids = torch.cat([kw["input_ids"], kw["input_ids"].flip(-1)])
    free = _generate(model, ids, n=N)
    eos = int(free[0, ids.shape[1] + 2])  # row 0's third new token ends it
    assert eos not in free[1, ids.shape[1]:].tolist()  # (row 1 runs to the end)

    def run():
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0, cache_implementation="static")

    expected = run()
    steps, compared = _stepping(model)
    got = run()
    assert torch.equal(got, expected) and steps.off is None
    assert (got[0, ids.shape[1] + 3:] == 0).all() and len(compared) == N - 3


def test_checked_once_per_call_then_stepped():
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    steps, _ = _stepping(model)
    for _ in range(2):  # each call is checked anew
        steps.start()
        before = _counts()
        assert torch.equal(_generate(model, ids), expected)
        assert _delta(before) == {"stepped": N - 3, "checked": 1, "off": 0}


def test_differs_names_what_differs():
    mask = torch.zeros(1, 1, 1, 8, dtype=torch.bool)
    mask[..., :3] = True
    ids = torch.tensor([[5]])
    cache = object()
    hf = {"input_ids": ids, "past_key_values": cache, "attention_mask": {"full_attention": mask}}
    assert inputs.differs(dict(hf), hf) is None
    bit = mask.clone()
    bit[..., 3] = True
    cases = [
        ({**hf, "attention_mask": {"full_attention": bit}}, "attention_mask['full_attention']"),
        ({**hf, "input_ids": torch.tensor([[5, 5]])[:, :1]}, "input_ids"),  # strides (1, 1)
        ({**hf, "past_key_values": object()}, "another object"),
        (dict(reversed(list(hf.items()))), "keys"),
        ({**hf, "attention_mask": mask}, "attention_mask"),
    ]
    for mine, why in cases:
        got = inputs.differs(mine, hf)
        assert got is not None and why in got, (why, got)


def test_a_sliding_window_never_steps():
    """Mistral with a window of 4: its mask would equal the closed form until the window
    fills, so stepping is refused by the config, before any check."""
    model, kw = zoo.get("mistral", layers=2, tokens=6, sliding_window=4)
    assert not inputs.can_step(model)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    generation.compile_for_generate(model, max_cache_len=32, device="ort")
    assert not hasattr(model.prepare_inputs_for_generation, inputs.UNSTEPPED)
    before = _counts()
    assert torch.equal(_generate(model, ids), expected)
    assert _delta(before) == {"stepped": 0, "checked": 0, "off": 0}


def test_a_mask_that_is_not_the_closed_form_turns_stepping_off():
    """A mask function that changes HF's answer after the first decode step (as another
    transformers might): the check catches it, names it, and HF's inputs are used."""
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    from transformers.generation.utils import create_masks_for_generate

    @functools.wraps(create_masks_for_generate)
    def odd(*args, **kwargs):
        masks = create_masks_for_generate(*args, **kwargs)
        seen = kwargs["past_key_values"].get_seq_length()
        if isinstance(masks, dict) and seen > ids.shape[1]:  # from the second decode step
            masks = {k: v.clone() for k, v in masks.items()}
            for v in masks.values():
                v[..., 0] = False  # the first position hidden
        return masks

    model.create_masks_for_generate = odd
    expected = _generate(model, ids)
    steps, _ = _stepping(model)
    before = _counts()
    got = _generate(model, ids)
    assert torch.equal(got, expected)
    assert _delta(before) == {"stepped": 0, "checked": 0, "off": 1}
    assert "attention_mask" in steps.off and "differ" in steps.off


def test_outside_generate_is_hfs():
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    steps, _ = _stepping(model)
    steps.active = False  # outside compile_for_generate's generate(): HF's function
    before = _counts()
    assert torch.equal(_generate(model, ids), expected)
    assert _delta(before) == {"stepped": 0, "checked": 0, "off": 0}


def test_compile_for_generate_steps_and_keeps_eager_tokens(opts):
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)

    def run():
        before = _counts()
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        assert torch.equal(got, expected)
        return _delta(before)

    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    assert run() == {"stepped": N - 3, "checked": 1, "off": 0}
    # compiled again: HF's method is wrapped once, not twice, and still steps
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    hf = getattr(model.prepare_inputs_for_generation, inputs.UNSTEPPED)
    assert not hasattr(hf, inputs.UNSTEPPED) and hf.__func__ is type(
        model).prepare_inputs_for_generation
    assert run() == {"stepped": N - 3, "checked": 1, "off": 0}
    # read per call: a config given a window after compile is not stepped
    own = generation._ours  # (the stepped inputs and spelled-out masks compile_for_generate sets)
    model.config.layer_types = ["sliding_attention"] * len(model.config.layer_types)
    assert not inputs.can_step(model, own)
    model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
    assert inputs.can_step(model, own)


@pytest.mark.parametrize("why", ["instance masks", "instance prepare", "eager attention"])
def test_what_can_step_refuses(why):
    """A mask or input function set on the instance may change HF's answer at any step (the
    one check per call would miss a change after it); eager attention's masks are additive."""
    model, _ = zoo.get("qwen3", layers=2, tokens=6)
    assert inputs.can_step(model)
    if why == "instance masks":
        model.create_masks_for_generate = lambda *a, **k: None
        assert inputs.can_step(model, lambda f: True)  # fxpass's own (spelled-out) is fine
    elif why == "instance prepare":
        model.prepare_inputs_for_generation = lambda *a, **k: {}
    else:
        model.config._attn_implementation = "eager"
    assert not inputs.can_step(model)


def test_a_callers_wrapper_of_the_stepped_inputs_is_the_callers():
    """``functools.wraps`` copies the stepped function's markers onto a wrapper: fxpass's own
    functions are told by identity, so the wrapper is not stepped through, and compiling again
    keeps it instead of unwrapping it."""
    model, _ = zoo.get("qwen3", layers=2, tokens=6)
    generation.compile_for_generate(model, max_cache_len=32, device="ort")
    stepped = model.prepare_inputs_for_generation
    assert inputs.can_step(model, generation._ours)

    @functools.wraps(stepped)
    def mine(*args, **kwargs):
        return stepped(*args, **kwargs)

    model.prepare_inputs_for_generation = mine
    assert not inputs.can_step(model, generation._ours)
    generation.compile_for_generate(model, max_cache_len=32, device="ort")
    assert vars(model)["prepare_inputs_for_generation"] is mine
