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


def _stepping(model, check_all=True):
    steps = inputs.StepInputs(check_all=check_all)
    model.prepare_inputs_for_generation = inputs.stepping(model.prepare_inputs_for_generation,
                                                          steps)
    steps.active = True
    return steps


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
    steps = _stepping(model)
    before = _counts()
    got = _generate(model, ids)
    assert steps.off is None
    assert torch.equal(got, expected)
    # the first decode step is HF's; each of the N - 2 after it is stepped and matched HF's
    assert _delta(before) == {"stepped": 0, "checked": N - 2, "off": 0}


def test_left_padded_batch_steps_with_its_mask():
    """A padded row's zeros stay masked in every step (the 2-D mask is read, not assumed)."""
    model, kw = zoo.get("llama", layers=2, tokens=6)
    ids = torch.cat([kw["input_ids"], kw["input_ids"].flip(-1)])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded by three
    expected = _generate(model, ids, attention_mask=mask)
    steps = _stepping(model)
    before = _counts()
    got = _generate(model, ids, attention_mask=mask)
    assert steps.off is None and torch.equal(got, expected)
    assert _delta(before)["checked"] == N - 2


def test_checked_once_per_call_then_stepped():
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    steps = _stepping(model, check_all=False)
    for _ in range(2):  # each call is checked anew
        steps.start()
        before = _counts()
        assert torch.equal(_generate(model, ids), expected)
        assert _delta(before) == {"stepped": N - 3, "checked": 1, "off": 0}


def test_a_sliding_window_never_steps():
    """Mistral with a window of 4: its mask would equal the closed form until the window
    fills, so stepping is refused by the config, before any check."""
    model, kw = zoo.get("mistral", layers=2, tokens=6, sliding_window=4)
    assert not inputs.generic(model)
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
    steps = _stepping(model, check_all=False)
    before = _counts()
    got = _generate(model, ids)
    assert torch.equal(got, expected)
    assert _delta(before) == {"stepped": 0, "checked": 0, "off": 1}
    assert "attention_mask" in steps.off and "differ" in steps.off


def test_outside_generate_and_nested_calls_are_hfs():
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    steps = _stepping(model)
    steps.active = False  # outside compile_for_generate's generate(): HF's function
    before = _counts()
    assert torch.equal(_generate(model, ids), expected)
    assert _delta(before) == {"stepped": 0, "checked": 0, "off": 0}


def test_compile_for_generate_steps_and_keeps_eager_tokens(opts):
    model, kw = zoo.get("qwen3", layers=2, tokens=6)
    ids = kw["input_ids"]
    expected = _generate(model, ids)
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    before = _counts()
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)
    assert torch.equal(got, expected)
    assert _delta(before) == {"stepped": N - 3, "checked": 1, "off": 0}
    # compiled again: HF's function is wrapped once, not twice
    generation.compile_for_generate(model, max_cache_len=32, options=opts, device="ort")
    hf = getattr(model.prepare_inputs_for_generation, inputs.UNSTEPPED)
    assert not hasattr(hf, inputs.UNSTEPPED)
