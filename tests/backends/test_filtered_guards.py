"""fxpass_bpu under torch's guard filters (``options={"guard_filter_fn": ...}``).

torch documents its filters as unsafe: they drop Dynamo's guards on modules, so Dynamo no
longer recompiles when the model changes. fxpass's own weight guard still runs, so replaced
or written weights stay correct; a weight whose dtype or shape changed cannot be served by the
traced graph at all, and must be a clear error, not a failure deep inside a region.
"""

from __future__ import annotations

import warnings

import pytest
import torch

FILTER = torch.compiler.skip_guard_on_all_nn_modules_unsafe


class Mlp(torch.nn.Module):
    """Token ids in, like a language model: a new weight dtype leaves the input as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 16)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.emb(ids))))


def _compiled(m: torch.nn.Module, opts: dict, **extra):
    return torch.compile(
        m, backend="fxpass_bpu", dynamic=False, options={**opts, **extra}
    )


def test_weights_replaced_or_written_stay_correct_under_a_guard_filter(opts):
    m = Mlp().eval()
    x = torch.randint(0, 10, (4,))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "weight ... changed after compile; recompiling"
        c = _compiled(m, opts, guard_filter_fn=FILTER)
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
        m.a.weight = torch.nn.Parameter(torch.randn(32, 16))  # replaced
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)
        m.b.weight.mul_(-2.0)  # written in place
        torch.testing.assert_close(c(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_weight_of_another_dtype_or_shape_is_a_clear_error_under_a_guard_filter(
        opts, change):
    m = Mlp().eval()
    x = torch.randint(0, 10, (4,))
    with torch.no_grad():
        c = _compiled(m, opts, guard_filter_fn=FILTER)
        c(x)
        if change == "dtype":
            m.double()
            want = r"weight .*is now torch\.float64 .*traced for torch\.float32"
        else:  # same input, a narrower output layer
            m.b.weight = torch.nn.Parameter(torch.randn(8, 32))
            m.b.bias = torch.nn.Parameter(torch.randn(8))
            want = r"weight .*is now torch\.float32 \(8, 32\).*traced for .*\(16, 32\)"
        with pytest.raises(RuntimeError, match=want) as e:
            c(x)
    assert "guard_filter_fn" in str(e.value) and "compile again" in str(e.value)


def test_without_a_filter_dynamo_recompiles_on_a_dtype_change(opts):
    """The control: the check sits where only filtered or skipped guards let a call through."""
    m = Mlp().eval()
    x = torch.randint(0, 10, (4,))
    with torch.no_grad():
        c = _compiled(m, opts)
        c(x)
        m.double()
        torch.testing.assert_close(c(x), m(x), rtol=1e-9, atol=1e-9)


@pytest.mark.slow  # the fast tier's 4-minute budget
def test_compile_for_generate_passes_a_guard_filter_to_torch(opts):
    """torch.compile takes guard_filter_fn out of the options; compile_for_generate validated
    it as an unknown backend option. With the filter the weight guard still sees a replaced
    weight, so the tokens follow eager's with the new weight."""
    from fxpass.backends.bpu import compile_for_generate
    from fxpass.tools import zoo

    model, kw = zoo.get("qwen3", layers=2, tokens=8)
    ids = kw["input_ids"]

    def generate():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  cache_implementation="static")

    calls = []

    def spy(entries):
        calls.append(len(entries))
        return FILTER(entries)

    options = {**opts, "guard_filter_fn": spy}
    expected = generate()
    compile_for_generate(model, max_cache_len=32, options=options)
    assert torch.equal(generate(), expected)
    assert calls, "torch never called the filter"
    assert options["guard_filter_fn"] is spy  # torch pops the key from what it gets: a copy
    up = model.model.layers[0].mlp.up_proj
    up.weight = torch.nn.Parameter(torch.randn_like(up.weight))
    compiled = model.forward
    model.forward = compiled._fxpass_uncompiled
    expected = generate()  # eager, with the new weight
    model.forward = compiled
    assert torch.equal(generate(), expected)  # rebuilt for the new weight, not stale
