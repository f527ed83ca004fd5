"""The host's chunk-attention fusion (``backends/onnx/host/chunk_attention.py``): a prompt
chunk's attention over a static cache runs as one ``GroupQueryAttention``. Every answer is
compared with eager on the same inputs (float32: rtol 1e-5, atol 1e-5), caches included; a
call the fused kernel cannot answer exactly is declined and answered eagerly (or raises under
``strict``), never answered wrong."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fxpass.jit.runtime import RegionFallbackWarning
from tests.backends.test_decode_attention import _compile, against_eager

H, HK, S, L = 4, 2, 16, 4


def _step(d: int):
    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(n * d, 16, generator=g) / 4 for n in (H, HK, HK))

    def step(k_cache, v_cache, x, p, mask):  # L tokens: write their keys and values, attend
        q = F.linear(x, wq).view(1, L, H, d).transpose(1, 2)
        k = F.linear(x, wk).view(1, L, HK, d).transpose(1, 2)
        v = F.linear(x, wv).view(1, L, HK, d).transpose(1, 2)
        k_cache.index_copy_(2, p, k)
        v_cache.index_copy_(2, p, v)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                              enable_gqa=True)

    return step


def _inputs(d: int, start: int, seed: int = 1, positions=None):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(1, HK, S, d, generator=g) for _ in range(2)]
    for c in caches:
        c[:, :, start + L:] = 0  # a generation's cache: nothing written past the chunk yet
    p = torch.arange(start, start + L) if positions is None else torch.tensor(positions)
    return caches, torch.randn(1, L, 16, generator=g), p


def _causal(start, additive=False, masked=float("-inf"), window=None):
    slots, rows = torch.arange(S), torch.arange(start, start + L).view(L, 1)
    keep = slots <= rows
    if window is not None:
        keep &= slots > rows - window
    if not additive:
        return keep.view(1, 1, L, S)
    bias = -0.1 * (rows - slots).abs().float()  # an ALiBi-like moderate bias where attended
    return torch.where(keep, bias, masked).view(1, 1, L, S)


def _check(compiled, step, d, start, mask, fused=1, positions=None):
    against_eager(compiled, step, _inputs(d, start, positions=positions), mask,
                  "chunk_attention", fused)


def test_the_kernel_takes_chunks_here():
    from fxpass.backends.onnx.host.chunk_attention import chunks_available

    assert chunks_available()  # else nothing below would exercise the fusion


@pytest.mark.parametrize("mask", ["causal", "window", "additive", "finfo-min"])
def test_fuses_and_matches_eager_at_every_start(mask, opts):
    step = _step(8)
    compiled = _compile(step, opts)
    masked = torch.finfo(torch.float32).min if mask == "finfo-min" else float("-inf")
    for start in (0, 5, S - L):
        m = _causal(start, additive=mask in ("additive", "finfo-min"), masked=masked,
                    window=3 if mask == "window" else None)
        _check(compiled, step, 8, start, m)


def test_the_fused_region_has_no_branch_left(opts):
    """What the fusion is for: no ``If`` (and no decomposed attention) in the session's
    model, as the cache stores it."""
    import onnx

    step = _step(8)
    _check(_compile(step, opts), step, 8, 3, _causal(3))
    (path,) = Path(opts["cache_dir"]).rglob("*.host.onnx")
    ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 1 and "If" not in ops, ops


@pytest.mark.parametrize("case", ["future-slot", "own-slot-masked", "nan", "huge"])
def test_masks_it_cannot_answer_exactly_are_declined(case, opts):
    mask = _causal(5, additive=True).clone()
    row, slot, value = {"future-slot": (1, 9, 0.0), "own-slot-masked": (2, 7, float("-inf")),
                        "nan": (0, 2, float("nan")), "huge": (3, 1, 1e31)}[case]
    mask[..., row, slot] = value
    step = _step(8)
    with pytest.raises(RuntimeError, match="chunk_attention"):
        _compile(step, opts)(*_inputs(8, 5)[0], *_inputs(8, 5)[1:], mask)
    compiled = _compile(step, opts, strict=False)
    with pytest.warns(RegionFallbackWarning, match="chunk_attention"):
        _check(compiled, step, 8, 5, mask)


@pytest.mark.parametrize("positions", [[5, 4, 6, 7], [4, 5, 7, 8]])
def test_positions_that_are_not_consecutive_are_declined_and_written_as_eager_does(
        positions, opts, monkeypatch):
    """The kernel writes rows start..start+L-1; a chunk written elsewhere (its positions
    out of order, or with a gap) is declined before the kernel runs (it is given a length it
    refuses), then answered eagerly, caches included. A decline is about that call: the
    next ones are the region's again, and it warns once."""
    from fxpass.jit.runtime import RegionCall

    eager = []
    real = RegionCall._eager
    monkeypatch.setattr(RegionCall, "_eager", lambda self: eager.append(1) or real(self))
    step = _step(8)
    compiled = _compile(step, opts, strict=False)
    _check(compiled, step, 8, 4, _causal(4))  # fused
    with pytest.warns(RegionFallbackWarning, match="chunk_attention"):  # the mask is fine
        _check(compiled, step, 8, 4, _causal(4), positions=positions, fused=None)
    assert eager == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionFallbackWarning)
        _check(compiled, step, 8, 6, _causal(6), fused=None)  # the region's answer
        assert eager == [1]
        _check(compiled, step, 8, 4, _causal(4), positions=positions, fused=None)
    assert eager == [1, 1]  # declined again, not warned again


def test_head_sizes_the_kernel_refuses_keep_the_attention_kernel(opts):
    step = _step(4)  # the kernel takes head sizes in multiples of 8
    with warnings.catch_warnings():
        warnings.simplefilter("error", RegionFallbackWarning)
        _check(_compile(step, opts), step, 4, 5, _causal(5), fused=0)
