"""The host's rotary fusion (``backends/onnx/host/rotary.py``) through ``torch.compile``:
HF's rotate-half rotary becomes one ``RotaryEmbedding`` node per rotated tensor, forms it must
not take are left alone, and every case matches eager (float32: rtol 1e-5, atol 1e-5 scaled by
the output's magnitude; the kernel may fuse a multiply-add, 1 ulp)."""

from __future__ import annotations

import pytest
import torch

import fxpass


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _proj_weight():
    return torch.randn(32, 32) / 6  # a projection in front: the region has compute


def _rope(x, cos, sin):
    """HF's ``apply_rotary_pos_emb`` for one tensor."""
    return x * cos + _rotate_half(x) * sin


def _tables(pos, d, scaling=1.0):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[..., None].float() * inv  # [B, L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # HF's rotary: both halves one table
    return emb.cos() * scaling, emb.sin() * scaling


def _run(fn, *args, opts):
    before = len(fxpass.compile_reports())
    expected = fn(*args)
    got = torch.compile(fn, backend="fxpass_bpu", dynamic=False,
                        options={**opts, "strict": True})(*args)
    (report,) = fxpass.compile_reports()[before:]
    for e, g in zip(expected, got, strict=True):
        scale = max(1.0, e[e.isfinite()].abs().max().item())  # NaN and inf: where eager has them
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * scale, equal_nan=True)
    assert report.regions and all(r.fallback is None for r in report.regions), str(report)
    return sum(r.fusions.get("rotary_embedding", 0) for r in report.regions)


@pytest.mark.parametrize("scaling", [1.0, 0.8], ids=["plain", "attention_scaling"])
@pytest.mark.parametrize("b,length", [(1, 1), (2, 5)], ids=["decode", "prefill-batch2"])
def test_hf_rotary_fuses_and_matches_eager(b, length, scaling, opts):
    w = _proj_weight()
    q, k = torch.randn(b, 4, length, 32), torch.randn(b, 2, length, 32)
    pos = torch.arange(7, 7 + length).expand(b, length) + torch.arange(b)[:, None]

    def fn(q, k, pos):
        cos, sin = _tables(pos, 32, scaling)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q @ w, k @ w
        return _rope(q, cos, sin), _rope(k, cos, sin)

    assert _run(fn, q, k, pos, opts=opts) == 2


def test_partial_rotary_fuses_the_rotated_part(opts):
    """GPT-NeoX / Phi style: only the first 16 of 32 channels rotate."""
    w = _proj_weight()
    q, pos = torch.randn(1, 4, 3, 32), torch.arange(3)[None]

    def fn(q, pos):
        cos, sin = (t.unsqueeze(1) for t in _tables(pos, 16))
        q = q @ w
        rot, keep = q[..., :16], q[..., 16:]
        return (torch.cat((_rope(rot, cos, sin), keep), dim=-1),)

    assert _run(fn, q, pos, opts=opts) == 1


@pytest.mark.parametrize("same", [True, False], ids=["equal-halves", "halves-differ"])
def test_only_a_table_of_equal_halves_is_fused(same, opts):
    """The tables are concatenated inside the region (no cos/sin on the CPU in front), so the
    fusion sees Concat(a, b): a kernel fed half of a table whose halves differ would be wrong
    (the decomposed ops stay); equal halves fuse."""
    w = _proj_weight()
    q, a, b = torch.randn(1, 4, 3, 32), torch.randn(1, 3, 16), torch.randn(1, 3, 16)

    def fn(q, a, b):
        cos = torch.cat((a, a if same else b), -1)[:, None]
        sin = torch.cat((b, b), -1)[:, None]
        q = q @ w
        return (_rope(q, cos, sin),)

    assert _run(fn, q, a, b, opts=opts) == int(same)


def test_a_rotation_read_elsewhere_is_not_fused(opts):
    """rotate_half(q) is also an output: fusing would lose it."""
    w = _proj_weight()
    q, pos = torch.randn(1, 4, 3, 32), torch.arange(3)[None]

    def fn(q, pos):
        cos, sin = (t.unsqueeze(1) for t in _tables(pos, 32))
        q = q @ w
        r = _rotate_half(q)
        return q * cos + r * sin, r * 2

    assert _run(fn, q, pos, opts=opts) == 0


def test_non_finite_values_rotate_as_eager(opts):
    w = torch.eye(32)
    q, pos = torch.randn(1, 2, 3, 32), torch.arange(3)[None]
    q[0, 0, 1, 3], q[0, 1, 2, 20], q[0, 1, 0, 5] = float("inf"), float("nan"), float("-inf")

    def fn(q, pos):
        cos, sin = (t.unsqueeze(1) for t in _tables(pos, 32))
        q = q @ w
        return (_rope(q, cos, sin),)

    assert _run(fn, q, pos, opts=opts) == 1


@pytest.mark.parametrize("halves", ["equal", "one-bit-apart"])
@pytest.mark.parametrize("b", [1, 2])
def test_folded_tables_fuse_only_with_equal_halves(halves, b, opts):
    """A forward without a KV cache: the positions are constants, so cos and sin fold to
    constant tables and the region sees initializers, not ``Concat(c, c)``. The fusion reads
    their values from the weights (the fused model itself holds none) and feeds the first
    half only when both halves are equal bit for bit; a table one ulp apart stays decomposed
    and still matches eager. Batch 2 reads a [1, 1, L, D] table broadcast over the batch:
    not the kernel's [B, L, D/2], so not fused."""
    w = _proj_weight()
    q, k = torch.randn(b, 4, 5, 32), torch.randn(b, 2, 5, 32)

    def fn(q, k):
        cos, sin = _tables(torch.arange(3, 8)[None], 32)
        if halves == "one-bit-apart":
            cos = cos.clone()
            cos[..., -1] = torch.nextafter(cos[..., -1], torch.tensor(2.0))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q @ w, k @ w
        return _rope(q, cos, sin), _rope(k, cos, sin)

    assert _run(fn, q, k, opts=opts) == (2 if halves == "equal" and b == 1 else 0)


def test_a_buffer_table_fuses_and_is_not_fed(opts):
    """cos/sin as the model's own buffers (64 KiB each, so large enough to be fed in place):
    fused, the full tables are no longer in the model, so they must not be fed or written
    back either (``host.prepare.declared_weights``); the session refused the feed before."""
    length, d = 128, 128

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cos, sin = _tables(torch.arange(length)[None], d)
            self.register_buffer("cos", cos.unsqueeze(1).contiguous())  # [1, 1, L, D]
            self.register_buffer("sin", sin.unsqueeze(1).contiguous())

        def forward(self, q, p):
            return (_rope(q @ p, self.cos, self.sin),)

    m = Rope().eval()
    q, p = torch.randn(1, 2, length, d), torch.randn(d, d) / 12
    assert _run(m, q, p, opts=opts) == 1
