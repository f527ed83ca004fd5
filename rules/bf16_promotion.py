"""bf16_promotion and bf16_cast_cancel: compute BF16 regions in F32 for targets without BF16.

Before -> after: an op that reads or writes bfloat16 (``mm(a_bf16, b_bf16)``, ``full(...,
dtype=bf16)``, ``_softmax`` of bf16, ...) -> the same op on F32 (inputs cast up, explicit
``dtype=bf16`` arguments turned into F32) followed by a cast back to BF16. Then
``bf16_cast_cancel`` removes each ``f32 -> bf16 -> f32`` round trip in which promotion inserted
either cast (between two promoted ops, or next to a model's own ``.to(...)``), so a whole BF16
region runs in F32 with casts only at its boundary: the region does not reproduce eager's
intermediate BF16 roundings (it is more accurate). The up cast may also be a decomposition's
F32 accumulation (``COMPUTE_F32``: SDPA reads BF16 and accumulates in F32), which is the
promotion of the fused op: Olmo2 and Cohere round q/k to BF16 right before attention, and
that CPU cast split their BF16 decode step into 3 regions. A round trip the model wrote
itself with nothing promoted in between is kept. Casts of constants fold away
(constant_folding). The model-visible dtype stays BF16: graph outputs are cast back.

Why: the BPU (hbdk4, hbDNN) has no BF16 type at all; without this, every BF16 op stays on
the CPU. F32 inside the region is at least as accurate as eager BF16.

Does not fire when: the op is itself a cast (the cancel rule owns those), reinterprets bits
(``view.dtype``), or has no BF16 input, output or dtype argument; or it is a table lookup
(``embedding``). A lookup copies rows, which is exact in any dtype, so it reads the BF16 table
as it is and its consumers cast the rows they get: promoting it would cast the whole table,
and constant folding would then keep a float32 copy of it (for a 32000 x 1024 vocabulary,
125 MiB beside a 62.5 MiB table) to read one row per token. No target runs ``embedding`` on
the device. Off by default; targets without BF16 (the BPU) enable it.
"""

from __future__ import annotations

import operator

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx.node import map_arg

from fxpass import rule
from fxpass.pattern import P, Var, pattern_rule
from fxpass.rules._util import CAST, COMPUTE_F32, aten, prims, writes

BF16, F32 = torch.bfloat16, torch.float32
UP = "fxpass_bf16_cast"  # meta flag on the casts bf16_promotion inserts (up and back down)
SHARED_UP = "fxpass_bf16_up"  # the one F32 cast of a BF16 value, right after it
_SKIP = {CAST, prims.convert_element_type.default, aten.to.dtype, aten.view.dtype, operator.getitem}
#: lookups whose BF16 table is read as it is (exact: rows are copied, not computed)
LOOKUPS = {aten.embedding.default}


def _has_bf16(v) -> bool:
    if isinstance(v, (tuple, list)):
        return any(_has_bf16(x) for x in v)
    return isinstance(v, torch.Tensor) and v.dtype == BF16


def _graph_has_bf16(gm) -> bool:
    return any(
        _has_bf16(n.meta.get("val")) or n.kwargs.get("dtype") == BF16 for n in gm.graph.nodes
    )


@rule(name="bf16_promotion", default=False, applies=_graph_has_bf16)
def bf16_promotion(node, rw):
    """Compute ops that read/write BF16 (incl. dtype=bf16 arguments) in F32, cast at the edges."""
    if node.target in _SKIP or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if writes(node.target):
        return rw.skip("in-place op: computing it on an F32 copy would lose the write")
    if node.target in LOOKUPS:
        if _has_bf16(node.meta["val"]):
            return rw.skip("a table lookup is exact in BF16: its readers cast the rows, "
                           "not the table")
        return False
    val = node.meta["val"]
    ins = [i for i in node.all_input_nodes if _has_bf16(i.meta.get("val"))]
    dt_arg = node.kwargs.get("dtype") == BF16
    if not (ins or dt_arg or _has_bf16(val)):
        return False
    if isinstance(val, (tuple, list)) and any(u.target is not operator.getitem for u in node.users):
        return rw.skip("tuple output used by something other than getitem")
    args, kwargs = node.args, dict(node.kwargs)
    if dt_arg:
        kwargs["dtype"] = F32
    if ins and any(i.meta["val"].dtype == BF16 for i in ins):
        args, kwargs = _round_scalars(node.target, args, kwargs)
    shared = {i: _shared_up(i) for i in ins}
    with rw.fake_mode:
        as_f32 = {i: c.meta["val"] if c is not None else _f32_like(i.meta["val"])
                  for i, c in shared.items()}
    try:
        new_val = rw.infer(node.target, args, kwargs, override=as_f32)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        # an op with no float32 kernel (Mixtral's _grouped_mm takes BF16 only): leave it BF16
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        return rw.skip(f"no float32 form of {node.target}: {why}")
    if _has_bf16(new_val):
        return rw.skip("still produces BF16 from F32 inputs (a positional dtype argument?)")
    up = {i: c if c is not None else _up(rw, i, as_f32[i]) for i, c in shared.items()}
    args, kwargs = map_arg((args, kwargs), lambda x: up.get(x, x))
    new = rw.call(node.target, *args, val=new_val, **kwargs)
    if isinstance(val, (tuple, list)):
        for u in list(node.users):
            with rw.at(u):
                item = rw.call(operator.getitem, new, u.args[1])
                rw.replace(u, _back(rw, item, val[u.args[1]]))
        rw.erase(node)
        return True
    rw.replace(node, _back(rw, new, val))
    return True


def _round_scalars(target, args, kwargs):
    """Eager BF16 ops first round a Python-scalar operand (schema type ``Scalar``) to BF16;
    computing in F32 must use that rounded value, or ``x > 0.3`` flips at the boundary."""
    schema = target._schema.arguments
    args = list(args)
    for i, a in enumerate(schema):
        if not isinstance(a.type, torch.NumberType):
            continue
        if i < len(args) and isinstance(args[i], float):
            args[i] = torch.tensor(args[i], dtype=BF16).item()
        elif a.name in kwargs and isinstance(kwargs[a.name], float):
            kwargs = {**kwargs, a.name: torch.tensor(kwargs[a.name], dtype=BF16).item()}
    return tuple(args), kwargs


def _f32_like(v: torch.Tensor) -> torch.Tensor:
    """The fake value of ``_to_copy(v, dtype=float32)`` (call under the fake mode). A dense tensor
    keeps its strides under ``preserve_format``, so its value is made directly: the cast
    dispatched through the fake mode took 1.7 ms against 0.2 ms (a scratch timing), a third of
    this rule's time on a BF16 Qwen3. Anything else (overlapping or gapped strides) takes the
    real path."""
    if is_non_overlapping_and_dense_or_false(v):
        return torch.empty_strided(v.shape, v.stride(), dtype=F32, device=v.device)
    return v.to(F32)


def _shared_up(i):
    """The F32 cast of ``i`` this rule already made for another reader, if any."""
    return next((u for u in i.users if u.meta.get(SHARED_UP)), None)


def _up(rw, i, val):
    """Cast BF16 value ``i`` to F32 right after it, once for all the readers this rule
    promotes (placed there, it comes before every one of them). One cast per value, not one
    per reader: the fake cast is most of the rule's cost, and the copies were duplicates."""
    with rw.at(i.next):
        cast = rw.call(CAST, i, dtype=F32, val=val)
    cast.meta[UP] = True  # bf16_cast_cancel only undoes round trips that this rule made
    cast.meta[SHARED_UP] = True
    return cast


def _back(rw, new, old_val):
    """Cast back to the dtype eager produced (BF16) so the rest of the graph is unchanged."""
    nv = new.meta["val"]
    if isinstance(old_val, torch.Tensor) and nv.dtype != old_val.dtype:
        same = nv.shape == old_val.shape and nv.stride() == old_val.stride()
        # _to_copy keeps the layout: the cast of ``new`` looks exactly like eager's value
        back = rw.call(CAST, new, dtype=old_val.dtype, **({"val": old_val} if same else {}))
        back.meta[UP] = True
        return back
    return new


#: cast(cast(x_f32, bf16), f32); the inner cast may have other users (it is only read)
ROUND_TRIP = P(CAST, P(CAST, Var("x", dtype=F32), dtype=BF16, name="down", shared=True), dtype=F32)


@pattern_rule(ROUND_TRIP, name="bf16_cast_cancel", default=False, applies=_graph_has_bf16)
def bf16_cast_cancel(rw, m):
    """cast(cast(x_f32, bf16), f32) -> x_f32 when bf16_promotion added either cast, or the up
    cast is a decomposition's F32 accumulation (SDPA's): the round trip exists only because
    a BF16 op was computed in F32."""
    if m.root.meta.get(UP) or m.down.meta.get(UP) or m.root.meta.get(COMPUTE_F32):
        return m.x
    return None  # both casts are the model's own: its bf16 rounding is kept
