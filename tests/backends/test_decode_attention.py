"""The host's decode-attention fusion (``backends/onnx/host/decode_attention.py``): a single
token's attention over a static cache runs as one ``GroupQueryAttention``. Every answer is
compared with eager on the same inputs (float32: rtol 1e-5, atol 1e-5), caches included; a
call the fused kernel cannot answer exactly is declined and answered eagerly (or raises under
``strict``), never answered wrong."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxpass
from fxpass.backends.onnx.host.decode_attention import kernel_available
from fxpass.jit.runtime import RegionFallbackWarning

H, HK, S = 4, 2, 12


def _weights(d: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n * d, 16, generator=g) / 4 for n in (H, HK, HK)]


def _step(d: int):
    wq, wk, wv = _weights(d)

    def step(k_cache, v_cache, x, p, mask):  # one token: write its key and value, attend
        q = F.linear(x, wq).view(1, 1, H, d).transpose(1, 2)
        k = F.linear(x, wk).view(1, 1, HK, d).transpose(1, 2)
        v = F.linear(x, wv).view(1, 1, HK, d).transpose(1, 2)
        k_cache.index_copy_(2, p, k)
        v_cache.index_copy_(2, p, v)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                              enable_gqa=True)

    return step


def _inputs(d: int, pos: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(1, HK, S, d, generator=g) for _ in range(2)]
    for c in caches:
        c[:, :, pos + 1:] = 0  # a generation's cache: nothing written past the position yet
    return caches, torch.randn(1, 16, generator=g), torch.tensor([pos])


def _compile(step, opts, strict=True):
    return torch.compile(step, backend="fxpass_ort", dynamic=False,
                         options={**opts, "strict": strict})


def _check(compiled, step, d, pos, mask, fused=1):
    return against_eager(compiled, step, _inputs(d, pos), mask, "decode_attention", fused)


def against_eager(compiled, step, inputs, mask, fusion, fused):
    """``compiled`` against eager ``step`` on the same ``inputs`` (caches included), and
    ``fused`` regions of ``fusion`` if this call compiled (None: not counted)."""
    (kc, vc), x, p = inputs
    want_k, want_v = kc.clone(), vc.clone()
    want = step(want_k, want_v, x, p, mask)
    before = len(fxpass.compile_reports())
    got = compiled(kc, vc, x, p, mask)
    reports = fxpass.compile_reports()[before:]
    if reports and fused is not None:
        (report,) = reports
        assert sum(r.fusions.get(fusion, 0) for r in report.regions) == fused, str(report)
    for g, w in ((got, want), (kc, want_k), (vc, want_v)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    return got, want


def _causal(pos, window=None, additive=False, masked=float("-inf")):
    slots = torch.arange(S)
    keep = slots <= pos
    if window is not None:
        keep &= slots > pos - window
    if not additive:
        return keep.view(1, 1, 1, S)
    bias = -0.1 * (pos - slots).abs().float()  # an ALiBi-like moderate bias where attended
    return torch.where(keep, bias, masked).view(1, 1, 1, S)


def test_the_kernel_is_here():
    assert kernel_available()  # else nothing below would exercise the fusion


@pytest.mark.parametrize("mask", ["causal", "window", "additive", "finfo-min"])
def test_fuses_and_matches_eager_at_every_position(mask, opts):
    step = _step(8)
    compiled = _compile(step, opts)
    masked = torch.finfo(torch.float32).min if mask == "finfo-min" else float("-inf")
    for pos in (0, 3, S - 1):
        m = _causal(pos, window=3 if mask == "window" else None,
                    additive=mask in ("additive", "finfo-min"), masked=masked)
        _check(compiled, step, 8, pos, m)


def test_a_mask_reading_past_the_position_is_declined_never_answered_wrong(opts):
    step = _step(8)
    future = _causal(4).clone()
    future[..., 7] = True  # attends a slot past the written one: the kernel never reads it
    with pytest.raises(RuntimeError, match="decode_attention"):
        _compile(step, opts)(*_inputs(8, 4)[0], *_inputs(8, 4)[1:], future)
    compiled = _compile(step, opts, strict=False)
    with pytest.warns(RegionFallbackWarning, match="decode_attention"):
        _check(compiled, step, 8, 4, future)
    _check(compiled, step, 8, 5, _causal(5))  # the region's own answer again


@pytest.mark.parametrize("value", ["written-slot-masked", "nan", "huge"])
def test_masks_it_cannot_answer_exactly_are_declined(value, opts):
    mask = _causal(4, additive=True).clone()
    mask[..., {"written-slot-masked": 4, "nan": 2, "huge": 1}[value]] = {
        "written-slot-masked": float("-inf"), "nan": float("nan"), "huge": 1e31}[value]
    step = _step(8)
    with pytest.raises(RuntimeError, match="decode_attention"):
        _compile(step, opts)(*_inputs(8, 4)[0], *_inputs(8, 4)[1:], mask)


def test_non_finite_values_where_it_reads_them_match_eager(opts):
    step = _step(8)
    compiled = _compile(step, opts)
    (kc, vc), x, p = _inputs(8, 6)
    kc[0, 1, 2, 3], vc[0, 0, 4, 1] = float("nan"), float("inf")
    want_k, want_v = kc.clone(), vc.clone()
    want = step(want_k, want_v, x, p, _causal(6))
    got = compiled(kc, vc, x, p, _causal(6))
    assert want.isnan().any() and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_nan_stored_past_the_position_is_not_read(opts):
    """The one documented difference: eager weights a slot past the position by zero, and
    0 * NaN is NaN; the kernel never reads it. Ours is eager's answer over slots 0..pos."""
    step = _step(8)
    compiled = _compile(step, opts)
    (kc, vc), x, p = _inputs(8, 6)
    vc[0, 1, 9, 0] = float("nan")
    got = compiled(kc.clone(), vc.clone(), x, p, _causal(6))
    assert step(kc.clone(), vc.clone(), x, p, _causal(6)).isnan().any()  # eager: NaN
    trimmed = step(kc[:, :, :7].clone(), vc[:, :, :7].clone(), x, p,
                   _causal(6)[..., :7])
    torch.testing.assert_close(got, trimmed, rtol=1e-5, atol=1e-5)


def test_head_sizes_the_kernel_refuses_keep_the_attention_kernel(opts):
    step = _step(4)  # the kernel takes head sizes in multiples of 8
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionFallbackWarning)
        _check(_compile(step, opts), step, 4, 5, _causal(5), fused=0)


class _Wants:
    """A region executor that asks to update its input 0 in place (and records the grant)."""

    def __init__(self):
        self.granted = None

    def in_place_inputs(self):
        return {0}

    def grant(self, inputs):
        self.granted = set(inputs)


def _graph(after: str):
    """cache -> region(cache, x) -> row, then ``after``: the write-back of the row, a read,
    nothing, a write of something else, a view taken before and read after, or the cache
    passed twice."""
    from fxpass.aot.writes import grant_in_place

    g = torch.fx.Graph()
    cache, x = g.placeholder("cache"), g.placeholder("x")
    ex = _Wants()

    def region(c, y):
        return (y,)

    view = g.call_function(torch.ops.aten.slice.Tensor, (cache, 2, 0, 1)) if (
        after == "view") else None
    call = g.call_function(region, (cache, x))
    row = g.call_function(operator.getitem, (call, 0))
    if after in ("write", "view", "twice"):
        g.call_function(torch.ops.aten.index_copy_.default, (cache, 2, x, row))
    elif after == "read":
        g.call_function(torch.ops.aten.add.Tensor, (cache, row))
    elif after == "other":
        g.call_function(torch.ops.aten.index_copy_.default, (cache, 2, x, x))
    if after == "twice":
        call.args = (cache, cache)
    g.output((row, view) if view is not None else row)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    n = grant_in_place(gm, lambda node: ex if node is call else None)
    return n, ex.granted


@pytest.mark.parametrize("after,granted", [
    ("write", {0}), ("none", set()), ("read", set()), ("other", set()), ("view", set()),
    ("twice", set())])
def test_an_input_is_written_in_place_only_where_the_program_writes_it_back(after, granted):
    assert _graph(after) == (len(granted), granted)


def test_a_position_outside_the_cache_writes_nothing_and_is_declined(opts):
    """A hand-written cache write (``where``, no ``index_copy``) at a position past the cache:
    eager writes nothing; the fused kernel must not write its row anywhere either."""
    wq, wk, wv = _weights(8)

    def step(k_cache, v_cache, x, p, mask):
        q = F.linear(x, wq).view(1, 1, H, 8).transpose(1, 2)
        k = F.linear(x, wk).view(1, 1, HK, 8).transpose(1, 2)
        v = F.linear(x, wv).view(1, 1, HK, 8).transpose(1, 2)
        hit = (torch.arange(S) == p).view(1, 1, S, 1)
        k_all, v_all = torch.where(hit, k, k_cache), torch.where(hit, v, v_cache)
        k_cache.copy_(k_all)
        v_cache.copy_(v_all)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)

    compiled = _compile(step, opts, strict=False)
    before = len(fxpass.compile_reports())
    _check(compiled, step, 8, 3, _causal(3))  # fused
    (report,) = fxpass.compile_reports()[before:]
    assert report.streamlined.get("in_place_inputs") == 2, report.streamlined  # written there
    (kc, vc), x, _ = _inputs(8, 3)
    want_k, want_v = kc.clone(), vc.clone()
    p = torch.tensor(S)  # past the cache: no slot is written
    with pytest.warns(RegionFallbackWarning, match="decode_attention"):  # declined, named
        got = compiled(kc, vc, x, p, _causal(S - 1))
    want = step(want_k, want_v, x, p, _causal(S - 1))
    for g, w in ((got, want), (kc, want_k), (vc, want_v)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_the_compiled_step_writes_its_caches_in_place(opts):
    step = _step(8)
    before = len(fxpass.compile_reports())
    _check(_compile(step, opts), step, 8, 4, _causal(4))
    (report,) = fxpass.compile_reports()[before:]
    assert report.streamlined.get("in_place_inputs") == 2, report.streamlined  # k and v


def test_a_tiered_executor_hands_every_grant_to_its_second_tier():
    """Two callers granted {0, 1} and {0}: the tier built later gets both, so it keeps {0}."""
    from fxpass.backends.onnx.host.ort import TieredExecutor

    class Tier(_Wants):
        def __init__(self):
            super().__init__()
            self.seen = []

        def grant(self, inputs):
            self.seen.append(set(inputs))

        def __call__(self, *tensors):
            return tensors

    first, second = Tier(), Tier()
    tiered = TieredExecutor(first, lambda: second)
    tiered.grant({0, 1})
    tiered.grant({0})
    assert tiered.wait() is second
    assert first.seen == second.seen == [{0, 1}, {0}]

    class RowTier(Tier):  # one that declares its rows also gets what each caller skips
        def in_place_rows(self):
            return {0: (3, 2)}

        def grant(self, inputs, written=frozenset()):
            self.seen.append((set(inputs), set(written)))

    first, second = RowTier(), RowTier()
    tiered = TieredExecutor(first, lambda: second)
    assert tiered.in_place_rows() == {0: (3, 2)}
    tiered.grant({0, 1}, {3})
    tiered.grant({0})
    assert tiered.wait() is second
    assert first.seen == second.seen == [({0, 1}, {3}), ({0}, set())]


def test_rows_its_kernel_wrote_are_neither_returned_nor_written_again(opts, monkeypatch):
    """The kernel writes each new row into its cache; the program's own write-back of that row
    is skipped and the executor leaves the row out, except on a call the region answers
    eagerly (here: its session fails): then the program writes eager's rows."""
    import gc

    from fxpass.backends.onnx.host.ort import OrtExecutor

    def executors():
        return [o for o in gc.get_objects() if type(o) is OrtExecutor]

    older = executors()
    step = _step(8)
    compiled = _compile(step, opts, strict=False)
    before = len(fxpass.compile_reports())
    for pos in (2, 3, 4):  # the first call learns the output shapes; then rows are left out
        _check(compiled, step, 8, pos, _causal(pos))
    (report,) = fxpass.compile_reports()[before:]
    assert report.streamlined.get("written_rows") == 2, report.streamlined
    mine = [o for o in executors() if not any(o is e for e in older)]  # this test's region
    assert any(len(o._skip) == 2 for o in mine), [o._skip for o in mine]
    def fail(self, tensors):  # the kernel never runs: the eager fallback's rows must be
        raise RuntimeError("session lost")  # written by the program

    monkeypatch.setattr(OrtExecutor, "_bound", fail)
    with pytest.warns(RegionFallbackWarning, match="session lost"):
        _check(compiled, step, 8, 6, _causal(6))
