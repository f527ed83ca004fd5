"""The host's attention fusion (``backends/onnx/host/attention.py``), end to end through
``torch.compile``: which forms fuse into one ``Attention`` node, which must not, and that every
one matches eager (float32: atol 1e-5 scaled by the output's magnitude)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fxpass


def _run(fn, *args, opts):
    before = len(fxpass.compile_reports())
    expected = fn(*args)
    # strict: a region failing in onnxruntime at run time raises instead of running eagerly
    strict = {**opts, "strict": True}
    got = torch.compile(fn, backend="fxpass_bpu", dynamic=False, options=strict)(*args)
    (report,) = fxpass.compile_reports()[before:]
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * max(1.0, e.abs().max().item()))
    assert report.regions and all(r.fallback is None for r in report.regions), str(report)
    return sum(r.fusions.get("attention", 0) for r in report.regions)


def _qkv(b=2, hq=8, hk=4, q_len=3, s_len=11, d=16):
    return torch.randn(b, hq, q_len, d), torch.randn(b, hk, s_len, d), torch.randn(b, hk, s_len, d)


def _proj(x, w):  # a matmul in front, so the region has compute and the inputs are computed
    return x @ w


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "mha"])
@pytest.mark.parametrize("mask", ["none", "bool", "additive", "causal"])
@pytest.mark.parametrize("q_len", [1, 5], ids=["decode", "prefill"])
def test_attention_fuses_and_matches_eager(gqa, mask, q_len, opts):
    q, k, v = _qkv(hk=4 if gqa else 8, q_len=q_len, s_len=11)
    w = torch.randn(16, 16) / 4
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, q_len, 11) > 0.3
        m[1, :, 0] = False  # a fully masked row: 0, as the safe softmax gives
    elif mask == "additive":
        m = torch.randn(2, 1, q_len, 11)
        m[0, :, -1] = float("-inf")

    def fn(q, k, v, *m_):
        return F.scaled_dot_product_attention(
            _proj(q, w), _proj(k, w), v, attn_mask=m_[0] if m_ else None,
            is_causal=mask == "causal", enable_gqa=gqa, scale=0.3,
        )

    args = (q, k, v) + ((m,) if m is not None else ())
    assert _run(fn, *args, opts=opts) == 1


def _special(case: str):
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 6, 16), torch.randn(1, 1, 6, 16)
    m = torch.zeros(1, 1, 1, 6)
    if case == "inf key at a masked position":
        k[0, 0, 2], m[..., 2] = float("inf"), float("-inf")
        q.abs_()
    elif case == "inf key":
        k[0, 0, 2] = float("inf")
        q.abs_()
    elif case == "nan query":
        q[0, 0, 0, 3] = float("nan")
    elif case == "nan value":
        v[0, 0, 4, 0] = float("nan")
    elif case == "nan in mask":
        m[..., 2] = float("nan")
    elif case == "+inf in mask":
        m[..., 1] = float("inf")
    elif case == "every key masked":
        m[...] = float("-inf")
    elif case == "overflowing scores":
        q, k = q * 1e20, k * 1e20
    elif case == "-0 and huge values":
        q[..., 0], v[..., 1] = -0.0, 1e38  # 3e38: eager's own kernel overflows (fuzz class)
    return q, k, v, m


def _sdpa_with_matmul(q, k, v, m):
    return F.scaled_dot_product_attention(q @ torch.eye(16), k, v, attn_mask=m, enable_gqa=True)


SPECIAL = [
    "inf key at a masked position", "inf key", "nan query", "nan value", "nan in mask",
    "+inf in mask", "every key masked", "overflowing scores", "-0 and huge values",
]


@pytest.mark.parametrize("case", SPECIAL)
def test_special_values_match_eager(case, opts):
    args = _special(case)
    expected = _sdpa_with_matmul(*args)
    before = len(fxpass.compile_reports())
    got = torch.compile(_sdpa_with_matmul, backend="fxpass_bpu", dynamic=False, options=opts)(*args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    (report,) = fxpass.compile_reports()[before:]
    assert sum(r.fusions.get("attention", 0) for r in report.regions) == 1


@pytest.mark.parametrize("causal", [False, True], ids=["additive-all-masked", "causal"])
def test_non_finite_scores_take_the_decomposed_branch(causal, opts):
    """onnxruntime's Attention adds every mask (a NaN at a masked position spreads) and gives
    0 on a row whose keys are all masked even when a score is NaN or inf; eager replaces
    masked scores (masked_fill) and gives NaN there. The fused node therefore runs only when
    the guard proves every score finite; these inputs take the decomposed branch and get
    eager's NaNs exactly (without the guard: 32 and 160 elements differed)."""
    q, k, v, m = _special("inf key")
    if causal:
        q = torch.randn(1, 2, 6, 16)
        k[0, 0, 2] = torch.randn(16)
        k[0, 0, 5, 3] = float("nan")  # a future key: only the last row sees it

        def fn(q, k, v):
            return F.scaled_dot_product_attention(
                q @ torch.eye(16), k, v, is_causal=True, enable_gqa=True
            )

        args = (q, k, v)
    else:
        m[...] = float("-inf")
        fn, args = _sdpa_with_matmul, (q, k, v, m)
    expected = fn(*args)
    assert expected.isnan().any() and not expected.isnan().all() if causal else True
    got = torch.compile(fn, backend="fxpass_bpu", dynamic=False, options=opts)(*args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_guard_keeps_the_fused_branch_on_ordinary_inputs(opts):
    """The guard's bound is loose (sum|q| * sum|k|), so ordinary activations, and large but
    safe ones, stay on the fused node: checked by running the region's model with the
    decomposed branch made to fail."""
    import onnx

    from fxpass.backends.onnx.host import build as C

    seen = []
    real = C.fuse_for_ort

    def spy(proto, *args):
        fused, counts = real(proto, *args)
        seen.append(fused)
        return fused, counts

    q, k, v, m = _special("none")
    k = k * 1e3
    C.fuse_for_ort = spy
    try:
        torch.compile(_sdpa_with_matmul, backend="fxpass_bpu", dynamic=False, options={
            **opts, "cache": False})(q, k, v, m)
    finally:
        C.fuse_for_ort = real
    (model,) = seen
    (if_node,) = [n for n in model.graph.node if n.op_type == "If"]
    attrs = {a.name: a for a in if_node.attribute}
    assert [n.op_type for n in attrs["then_branch"].g.node] == ["Attention"]
    # poison the decomposed branch: if it ran, the output would be NaN
    bad = onnx.helper.make_node("Identity", ["poison"], [attrs["else_branch"].g.output[0].name])
    else_g = attrs["else_branch"].g
    del else_g.node[:]
    else_g.node.append(bad)
    model.graph.initializer.append(onnx.numpy_helper.from_array(
        np.full((*q.shape[:-1], v.shape[-1]), np.nan, np.float32), "poison"))
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), (q, k, v, m), strict=True)}
    (out,) = sess.run(None, feeds)
    torch.testing.assert_close(torch.from_numpy(out), _sdpa_with_matmul(q, k, v, m))


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 11), (1, 1, 3, 11), (1, 8, 1, 11), (3, 11)])
def test_broadcast_masks_fuse_and_match_eager(shape, gqa, opts):
    """onnxruntime's kernel wants the mask's last two dims to be [L, S] exactly: a key-padding
    mask [B, 1, 1, S] failed the region (found in review); the mask is expanded first."""
    q, k, v = _qkv(hk=4 if gqa else 8, q_len=3, s_len=11)
    w = torch.randn(16, 16) / 4
    m = torch.rand(*shape) > 0.3

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(_proj(q, w), k, v, attn_mask=m, enable_gqa=gqa)

    assert _run(fn, q, k, v, m, opts=opts) == 1


def test_very_negative_finite_masks_match_eager(opts):
    """HF pads with ``finfo.min``, not -inf: eager averages v over a row masked that way, and
    onnxruntime's kernel returned 0 for it (found in review). Such masks fail the guard and
    run the decomposed branch."""
    q, k, v = _qkv(q_len=2, s_len=4)
    w = torch.randn(16, 16) / 4
    m = torch.zeros(2, 1, 2, 4)
    m[0, 0, 0] = torch.finfo(torch.float32).min
    m[1, 0, 1, :2] = -1e35

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(_proj(q, w), k, v, attn_mask=m, enable_gqa=True)

    assert _run(fn, q, k, v, m, opts=opts) == 1  # fused, and still eager's answer


@pytest.mark.parametrize("scale", [0.0, -0.25])
def test_non_positive_scale_is_not_fused(scale, opts):
    """onnxruntime refuses scale <= 0 when the session is built (the region fell back to
    eager, found in review): such attention stays decomposed."""
    q, k, v = _qkv(hk=8)
    w = torch.randn(16, 16) / 4

    def fn(q, k, v):
        return F.scaled_dot_product_attention(_proj(q, w), k, v, scale=scale)

    assert _run(fn, q, k, v, opts=opts) == 0


@pytest.mark.parametrize("which", ["k", "v"])
def test_k_and_v_repeated_differently_are_not_fused(which, opts):
    """Hand-written attention repeating only k (or only v) matched and failed in onnxruntime
    at the first call (found in review): k and v must have the same heads."""
    q, k, v = _qkv(hk=4)
    w = torch.randn(16, 16) / 4

    def rep(x):
        return x.unsqueeze(2).expand(2, 4, 2, 11, 16).reshape(2, 8, 11, 16)

    def fn(q, k, v):
        # one side is the GQA repeat, the other 8 heads in a different layout (cat)
        kk = rep(k) if which == "k" else torch.cat([k, k], 1)
        vv = torch.cat([v, v], 1) if which == "k" else rep(v)
        s = (_proj(q, w) @ kk.transpose(-2, -1)) * 0.25
        return torch.ops.aten._safe_softmax(s, -1) @ vv

    assert _run(fn, q, k, v, opts=opts) == 0  # eager's answer, no fallback, not fused


def test_attention_weights_used_elsewhere_are_not_fused(opts):
    """A softmax that is also returned has a user outside the match: fusing would lose it."""
    q, k, v = _qkv(hk=8)
    w = torch.randn(16, 16) / 4

    def fn(q, k, v):
        s = (_proj(q, w) @ k.transpose(-2, -1)) * 0.25
        p = torch.softmax(s, -1)
        return p @ v, p

    assert _run(fn, q, k, v, opts=opts) == 0


def test_plain_softmax_is_not_fused(opts):
    """Without the safe-softmax tail a fully masked row is NaN in eager; Attention gives 0."""
    q, k, v = _qkv(hk=8)
    w = torch.randn(16, 16) / 4
    m = torch.zeros(2, 1, 3, 11)
    m[0, :, 0] = float("-inf")

    def fn(q, k, v, m):
        return torch.softmax((_proj(q, w) @ k.transpose(-2, -1)) * 0.25 + m, -1) @ v

    expected = fn(q, k, v, m)
    assert expected.isnan().any()
    before = len(fxpass.compile_reports())
    got = torch.compile(fn, backend="fxpass_bpu", dynamic=False, options=opts)(q, k, v, m)
    torch.testing.assert_close(got, expected, equal_nan=True)
    (report,) = fxpass.compile_reports()[before:]
    assert all(not r.fusions.get("attention") for r in report.regions)


def test_without_the_kernel_nothing_fuses(opts, monkeypatch):
    """onnxruntime releases the project allows (>= 1.20) may lack opset 23's Attention on the
    CPU: the probe says so once, and the regions stay decomposed instead of failing."""
    from fxpass.backends.onnx.host import attention

    assert attention.kernel_available(), "the pinned onnxruntime has the kernel"
    monkeypatch.setattr(attention, "kernel_available", lambda: False)
    q, k, v = _qkv()
    w = torch.randn(16, 16) / 4

    def fn(q, k, v):
        return F.scaled_dot_product_attention(_proj(q, w), k, v, enable_gqa=True)

    assert _run(fn, q, k, v, opts=opts) == 0


def test_fusion_switched_off(opts):
    q, k, v = _qkv()
    w = torch.randn(16, 16) / 4

    def fn(q, k, v):
        return F.scaled_dot_product_attention(_proj(q, w), k, v, enable_gqa=True)

    assert _run(fn, q, k, v, opts={**opts, "host_fusions": False}) == 0
