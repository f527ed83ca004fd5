"""Host fusion: a prompt chunk's attention over a static cache -> ``GroupQueryAttention``.

A prefill step writes ``L`` new rows into each cache and attends over it. After the attention
fusion (``host/attention.py``) and the cache-write rule (``rules/kv_cache.py``) each layer
holds: the rows spread over the cache by a one-hot product (``MatMul`` of the ``[S, L]``
slot-equals-position matrix), a ``Where`` into a copy of each cache, a finiteness guard over
the query and the whole cache, an ``If`` and the ``Attention`` kernel over every slot. The
session optimizes each ``If``'s two subgraphs as graphs of their own when it opens, so a
30-layer model's prefill session opened far slower than its decode session, and a package
opens both before its first token. onnxruntime's contrib
``GroupQueryAttention`` takes the new rows and the cache as they are, writes the rows at
``start..start+L-1`` in its own output and reads slots ``0..start+L-1`` only, causally: what
ONNX Runtime GenAI runs for its prompts.

Matched (shapes static)::

    If(guard, Attention(q, k, v, mask), decomposed)      q: [B, H, L, D], L > 1, scale only
    k = Where(hit, Reshape(MatMul(spread(E), Reshape(k_rows))), k_cache)   (v: the same E)
    hit = Reshape(Cast(ReduceMax(Cast(E), axis -1)))   E: bool [S, L] (slot s holds row j)
    rows: [1, Hk, L, D];  caches: [1, Hk, S, D];  mask: [1, 1, L, S] additive or bool
    (one row of a batch: onnxruntime's CPU kernel refuses a chunk over a filled cache for
    more, "batch_size must be 1 when sequence_length > 1 and past context is given")

Rewritten::

    start = argmax(E[:, 0]);  total = start + L          (once per E)
    out = GroupQueryAttention(q, k_rows, v_rows, k_cache, v_cache, seqlens=total - 1, total,
                              attention_bias=mask[..., :total])   (transposed to [B, L, H*D])

Exactness. The two agree when (checked on every call, in the graph, into the model's
``fxpass_ok`` output, as ``host/decode_attention.py`` does for one token): every row ``j``
of ``E`` has exactly one slot, at ``start + j`` (consecutive positions, inside the cache);
and every mask row ``j`` masks the slots past ``start + j`` (False, -inf or below -1e30),
attends slot ``start + j`` with a moderate value, and holds nothing else but masked or
moderate values (no NaN, no +inf). A call that fails the check is given a position the
kernel refuses before it runs (``total`` past the cache and not the cache plus the chunk), so
the call raises and is declined: answered eagerly through ``torch.compile``, raised with the
reason by a package. The kernel writes its own outputs, never the cache inputs: the program
writes the rows after the call, as without the fusion. What differs from eager is what
``host/decode_attention.py`` lists (a NaN stored in a slot past the chunk is not read), and
a NaN in the new rows no longer spreads to the chunk's other rows (the one-hot product
spread it; eager's ``index_copy`` does not).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx_ir as ir

from fxpass.backends.onnx.host.decode_attention import (
    DOMAIN,
    _Builder,
    _outer_mask,
    detach_branch,
    fuse_guarded,
    guarded_attention,
    kernel_available,
    probe_kernel,
)
from fxpass.backends.onnx.host.onnx_match import const_array, producer_of, static_shape


class _Match:
    def __init__(self, branch: ir.Node, attn: ir.Node, onehot: ir.Value,
                 rows: tuple[ir.Value, ir.Value], caches: tuple[ir.Value, ir.Value],
                 mask: ir.Value, keep: bool | None):
        self.branch, self.attn, self.onehot = branch, attn, onehot
        self.rows, self.caches, self.mask, self.keep = rows, caches, mask, keep


def fuse_chunk_attention(model: ir.Model) -> int:
    """Replace each matched chunk attention in ``model`` (module doc); returns how many."""
    if not (kernel_available() and chunks_available()):
        return 0
    return fuse_guarded(model, _match, _ChunkBuilder)


@functools.cache
def chunks_available() -> bool:
    """Whether this onnxruntime's CPU ``GroupQueryAttention`` takes a chunk of two rows over
    a static cache already holding one (onnxruntime ``>= 1.20`` is allowed; not every version
    takes both), probed once against the answer worked out by hand."""
    d = 8
    past = np.zeros((1, 1, 4, d), np.float32)
    past[0, 0, 0] = 1.0  # slot 0 holds ones; the chunk writes 2.0 and 4.0 at slots 1 and 2
    rows = np.stack([np.full(d, 2.0), np.full(d, 4.0)])[None].astype(np.float32)
    out = probe_kernel({"q": np.zeros((1, 2, d), np.float32),
                        "k": np.zeros((1, 2, d), np.float32), "v": rows, "pk": past * 0,
                        "pv": past, "seq": np.array([2], np.int32),
                        "tot": np.array(3, np.int32)})
    # equal weights, causal: row 0 over slots 0..1 -> (1 + 2) / 2; row 1 over 0..2 -> 7 / 3
    return out is not None and bool(np.allclose(out[0, :, 0], [1.5, 7 / 3]))


def _through(v: ir.Value | None, *ops: str) -> ir.Value | None:
    """``v`` followed up through default-domain producers of ``ops`` (to the first other)."""
    while (p := producer_of(v, *ops)) is not None:
        v = p.inputs[0]
    return v


def _spread(where: ir.Node, batch: int, hk: int, length: int,
            dim: int) -> tuple[ir.Value, ir.Value] | None:
    """(E, rows) of ``Where(hit, Reshape(MatMul(spread(E), Reshape(rows))), cache)``, with
    ``hit`` = any(E, -1); None for any other form."""
    view = producer_of(where.inputs[1], "Reshape")
    mm = producer_of(view.inputs[0], "MatMul") if view is not None else None
    if mm is None:
        return None
    a, r = mm.inputs
    rows = _through(r, "Reshape")
    if static_shape(rows) != (batch, hk, length, dim) or static_shape(r) != (
            batch * hk, length, dim):
        return None
    # the one-hot side: E cast to float, expanded over batch and heads, viewed 3-D
    cast = producer_of(_through(a, "Reshape", "Expand"), "Cast")
    expanded = _through(a, "Reshape")
    onehot = cast.inputs[0] if cast is not None else None
    s = where.inputs[2].shape[2]
    if onehot is None or onehot.dtype != ir.DataType.BOOL or static_shape(onehot) != (
            s, length) or static_shape(a) != (batch * hk, s, length):
        return None
    es = static_shape(expanded)
    if es is None or es[-2:] != (s, length) or math.prod(es[:-2]) != batch * hk:
        return None
    # hit = Reshape(Cast(ReduceMax(Cast(E), axes=[-1])))
    red = producer_of(_through(where.inputs[0], "Reshape", "Cast"), "ReduceMax")
    if red is None or _through(red.inputs[0], "Cast") is not onehot:
        return None
    axes = const_array(red.inputs[1]) if len(red.inputs) > 1 else None
    if axes is None or [int(x) % 2 for x in np.ravel(axes)] != [1]:
        return None
    if static_shape(where.inputs[0]) != (1, 1, s, 1):
        return None
    return onehot, rows


def _match(branch: ir.Node) -> _Match | None:
    found = guarded_attention(branch)
    if found is None:
        return None
    attn, then = found
    q, k, v, *rest = attn.inputs
    if any(r is not None for r in rest[1:]) or not rest or rest[0] is None:
        return None  # no mask: eager attends every slot (the zeros past the chunk too)
    qs = static_shape(q)
    if qs is None or len(qs) != 4 or qs[2] < 2 or q.dtype != ir.DataType.FLOAT:
        return None
    b, h, length, d = qs
    if b != 1:  # onnxruntime's CPU kernel takes a chunk over a filled cache for one row only
        return None
    wk, wv = producer_of(k, "Where"), producer_of(v, "Where")
    if wk is None or wv is None or wk.inputs[0] is not wv.inputs[0] or d % 8:
        return None
    caches = (wk.inputs[2], wv.inputs[2])
    shape = static_shape(caches[0])
    if shape is None or shape != static_shape(caches[1]) or len(shape) != 4:
        return None
    _, hk, s, dk = shape
    if shape[0] != b or dk != d or hk == 0 or h % hk:
        return None
    found = [_spread(w, b, hk, length, d) for w in (wk, wv)]
    if None in found or found[0][0] is not found[1][0]:
        return None
    if any(x.dtype != ir.DataType.FLOAT for x in (*caches, found[0][1], found[1][1])):
        return None
    mask, keep = _outer_mask(rest[0], then)
    ms = static_shape(mask)
    if mask is None or ms is None or len(ms) != 4 or ms[-2:] != (length, s) or ms[1] != 1 or (
            ms[0] not in (1, b)):
        return None
    return _Match(branch, attn, found[0][0], (found[0][1], found[1][1]), caches, mask, keep)


class _ChunkBuilder(_Builder):
    prefix = "chunk_attention"

    def chunk_position(self, onehot: ir.Value, batch: int,
                       first: ir.Node) -> tuple[ir.Value, ...]:
        """(seqlens [B] int32, total scalar int32, rowpos [L, 1] int64) from E; the flag
        that its rows are one slot each, consecutive, goes into ``flags``. Where they are
        not, ``total`` is the cache's length plus the chunk plus one, which the kernel
        refuses before it runs (neither a static nor a growing cache of that length)."""
        if id(onehot) not in self.positions:
            s, length = onehot.shape
            e = self.node("Cast", [onehot], first, to=ir.DataType.INT32.value)
            zero = self.const("axis0", np.array([0], np.int64))
            one = self.node("Equal", [self.node("ReduceSum", [e, zero], first, keepdims=0),
                                      self.const("one32", np.array(1, np.int32))], first)
            pos = self.node("ArgMax", [e], first, axis=0, keepdims=0)            # [L] int64
            start = self.node("ReduceMin", [pos], first, keepdims=0)
            steps = self.const(f"steps{length}", np.arange(length, dtype=np.int64))
            seq = self.node("Equal", [pos, self.node("Add", [start, steps], first)], first)
            good = self.node("And", [one, seq], first)
            self.flags.append(self.node("Cast", [self.node("ReduceMin", [self.node(
                "Cast", [good], first, to=ir.DataType.INT32.value)], first, keepdims=0)],
                first, to=ir.DataType.BOOL.value))
            ok = self.flags[-1]
            start32 = self.node("Where", [ok, self.node("Cast", [start], first,
                                                        to=ir.DataType.INT32.value),
                                          self.const(f"past{s}", np.array(s + 1, np.int32))],
                                first)
            total = self.node("Add", [start32, self.const(f"l{length}", np.array(
                length, np.int32))], first)
            last = self.node("Sub", [total, self.const("one32", np.array(1, np.int32))], first)
            seqlens = self.node("Expand", [self.node("Reshape", [last, self.const(
                "one", np.array([1], np.int64))], first), self.const(
                f"b{batch}", np.array([batch], np.int64))], first)
            rowpos = self.node("Reshape", [self.node("Add", [start, steps], first),
                                           self.const(f"col{length}", np.array(
                                               [length, 1], np.int64))], first)
            self.positions[id(onehot)] = (seqlens, total, rowpos)
        return self.positions[id(onehot)]

    def rewrite(self, m: _Match) -> None:
        q = m.attn.inputs[0]
        b, h, length, d = q.shape
        hk = m.caches[0].shape[1]
        branch = m.branch
        seqlens, total, rowpos = self.chunk_position(m.onehot, b, branch)
        bias = self.bias(m, rowpos, total, branch)

        def flat(x: ir.Value, heads: int) -> ir.Value:
            t = self.node("Transpose", [x], branch, perm=[0, 2, 1, 3])
            return self.node("Reshape", [t, self.const(f"f{b}_{length}_{heads * d}", np.array(
                [b, length, heads * d], np.int64))], branch)

        scale = m.attn.attributes.get("scale")
        scale = float(scale.value) if scale is not None else 1.0 / math.sqrt(d)
        out = self.node("GroupQueryAttention", [
            flat(q, h), flat(m.rows[0], hk), flat(m.rows[1], hk), *m.caches, seqlens, total,
            None, None, None, bias], branch, domain=DOMAIN, outputs=3, num_heads=h,
            kv_num_heads=hk, scale=scale)
        heads = self.node("Reshape", [out, self.const(f"u{b}_{length}_{h}_{d}", np.array(
            [b, length, h, d], np.int64))], branch)
        result = self.node("Transpose", [heads], branch, perm=[0, 2, 1, 3])
        detach_branch(self.graph, branch, result)
