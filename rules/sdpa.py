"""sdpa_decomposition: every SDPA variant -> matmul, scale, mask, softmax, matmul.

Before -> after: ``_scaled_dot_product_flash_attention_for_cpu``, the flash / efficient / cudnn /
fused-overrideable / math variants and plain ``scaled_dot_product_attention`` -> ``bmm(q, k^T)``,
``* scale``, causal / boolean (``masked_fill -inf``) / additive (``+ mask``) masking,
``_safe_softmax`` (rewritten in turn by the safe_softmax rule), ``bmm(p, v)``. GQA (fewer KV
heads, ``enable_gqa``) repeats K/V heads with expand + reshape. A used ``logsumexp`` output is
computed (``logsumexp`` of the masked scores, 0 on fully masked rows as the CPU kernel does); a
used attention-weights output of the math variants is the softmax.

Why: fused attention is one opaque op with a tuple output; device compilers and partitioners
need the matmuls. Half/bfloat16 inputs are computed in float32 inside, as the fused kernels
accumulate, then cast back.

Does not fire when: ``dropout_p > 0`` (training-time randomness, left alone with a reason); an
output other than out / logsumexp / weights is used (RNG state, debug mask, cumulative lengths);
the logsumexp layout is padded (CUDA efficient kernel); shapes are symbolic.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from fxpass import rule
from fxpass.graph import bind_args, same_layout
from fxpass.rules._util import CAST, COMPUTE_F32, aten


def _op(name: str) -> Any:
    packet = getattr(aten, name, None)
    return getattr(packet, "default", None) if packet is not None else None


# variant -> (mask argument name, index of logsumexp output or None, index of weights or None)
VARIANTS = {
    op: spec
    for op, spec in (
        (_op("_scaled_dot_product_flash_attention_for_cpu"), ("attn_mask", 1, None)),
        (_op("scaled_dot_product_attention"), ("attn_mask", None, None)),
        (_op("_scaled_dot_product_attention_math"), ("attn_mask", None, 1)),
        (_op("_scaled_dot_product_attention_math_for_mps"), ("attn_mask", None, 1)),
        (_op("_scaled_dot_product_efficient_attention"), ("attn_bias", 1, None)),
        (_op("_scaled_dot_product_flash_attention"), (None, 1, None)),
        (_op("_scaled_dot_product_cudnn_attention"), ("attn_bias", 1, None)),
        (_op("_scaled_dot_product_fused_attention_overrideable"), ("attn_bias", 1, None)),
    )
    if op is not None
}


def attention(q, k, v, mask=None, *, causal=False, scale=None, lse=False, weights=False):
    """Reference math for every variant (traced with make_fx by the rule)."""
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    hq, hk = q.shape[-3], k.shape[-3]
    if hk != hq:  # grouped-query attention: repeat each KV head hq // hk times
        rep = hq // hk
        k = (
            k.unsqueeze(-3)
            .expand(*k.shape[:-2], rep, *k.shape[-2:])
            .reshape(*q.shape[:-2], *k.shape[-2:])
        )
        v = (
            v.unsqueeze(-3)
            .expand(*v.shape[:-2], rep, *v.shape[-2:])
            .reshape(*q.shape[:-2], *v.shape[-2:])
        )
    L, S = q.shape[-2], k.shape[-2]
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * s
    if causal:
        keep = torch.ones(L, S, dtype=torch.bool).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(mask.logical_not(), float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    p = aten._safe_softmax.default(scores, -1)
    out = torch.matmul(p, v).to(dtype)
    extra = []
    if lse:
        m = torch.logsumexp(scores, -1)
        extra.append(torch.where(m == float("-inf"), torch.zeros_like(m), m))
    if weights:
        extra.append(p.to(dtype))
    return (out, *extra) if extra else out


@rule(*VARIANTS, name="sdpa_decomposition")
def sdpa_decomposition(node, rw):
    """Decompose every SDPA variant into matmul/scale/mask/softmax/matmul (GQA, causal, masks)."""
    mask_name, lse_idx, w_idx = VARIANTS[node.target]
    a = bind_args(node)
    if a.get("dropout_p") or a.get("dropout_mask") is not None:
        return rw.skip("dropout_p > 0 or a dropout mask: training-time attention is left alone")
    if not rw.static(node, *node.all_input_nodes):
        return False
    val = node.meta["val"]
    tuple_out = isinstance(val, (tuple, list))
    uses = {}
    if tuple_out:
        for u in node.users:
            if u.target is not operator.getitem:
                return rw.skip(f"tuple output used by {u.target}")
            uses.setdefault(u.args[1], []).append(u)
        if any(i not in (0, lse_idx, w_idx) for i in uses):
            return rw.skip(f"outputs {sorted(uses)} used; only out/logsumexp/weights decompose")
        if lse_idx in uses and tuple(val[lse_idx].shape) != tuple(val[0].shape[:-1]):
            return rw.skip("logsumexp has a padded layout; left fused")
    mask = a.get(mask_name) if mask_name else None
    q, k, v = a["query"], a["key"], a["value"]
    want_lse, want_w = lse_idx in uses, w_idx in uses
    causal, scale = bool(a.get("is_causal")), a.get("scale")

    def fn(q, k, v, *m):
        return attention(
            q, k, v, m[0] if m else None, causal=causal, scale=scale, lse=want_lse, weights=want_w
        )

    args = (q, k, v) + ((mask,) if mask is not None else ())
    res = rw.inline(fn, *args, key=("sdpa", causal, scale, want_lse, want_w))
    for x in (q, k, v):  # the kernel's own F32 accumulation, not a rounding the model asked for
        for u in x.users:
            if u.target is CAST and u.meta.get("fxpass_from") == ("sdpa_decomposition", node.name):
                u.meta[COMPUTE_F32] = True
    res = res if isinstance(res, tuple) else (res,)
    out = _match_strides(rw, res[0], val[0] if tuple_out else val)
    if not tuple_out:
        rw.replace(node, out)
        return True
    got = {0: out}
    if want_lse:
        got[lse_idx] = res[1]
    if want_w:
        got[w_idx] = res[-1]
    for i, users in uses.items():
        for u in users:
            rw.replace(u, got[i])
    rw.erase(node)
    return True


def _match_strides(rw, new, old_val):
    """Keep the fused op's output layout: later ``view`` nodes were traced against it.

    The CPU flash kernel returns a (B, H, L, E) tensor laid out as (B, L, H, E). Permuting to
    the physical order, making it contiguous and permuting back reproduces any dense layout
    with data-movement ops only.
    """
    if same_layout(new.meta["val"], old_val):
        return new
    order = sorted(range(old_val.dim()), key=lambda d: (-old_val.stride(d), d))
    inverse = [order.index(d) for d in range(old_val.dim())]
    dense = rw.call(
        aten.clone.default,
        rw.call(aten.permute.default, new, order),
        memory_format=torch.contiguous_format,
    )
    out = rw.call(aten.permute.default, dense, inverse)
    if not same_layout(out.meta["val"], old_val):
        raise RuntimeError(f"cannot reproduce output strides {old_val.stride()}")
    return out
