"""constant_index: indexing with constant positions -> slices, strided slices, repeats, cat.

Before -> after: ``index(x, [None] * d + [c0, c1, ...])`` (also ``_unsafe_index``, and
``index_select(x, d, c)``) with constant integer positions on consecutive dims, each varying
along its own axis (an outer product: ``x[:, :, rows[:, None], cols]``), becomes one gather per
dim, each the cheapest of:

- a run ``[a, a+1, ..., b-1]`` -> ``slice(x, d, a, b)``;
- a stride ``[a, a+s, a+2s, ...]`` -> ``slice(x, d, a, ..., s)`` (nearest downsampling);
- a repeat ``[a, a, b, b, ...]`` (each of a run ``r`` times) -> ``unsqueeze``, ``expand`` and
  ``reshape`` (nearest upsampling by an integer factor);
- otherwise up to ``MAX_RUNS`` runs -> their slices joined by ``cat``.

Why: advanced indexing is on no accelerator's operator list, but it is how literals and
resampling reach the graph: Falcon splits its fused QKV with ``qkv[..., [-2]]`` in every layer,
and ``nn.Upsample(mode="nearest")`` (every FPN / U-Net / YOLO neck, MobileViT) decomposes to
``_unsafe_index`` with constant row and column positions; XLNet's relative-position shift is
``index_select`` with a folded ``arange``. Each split the region. Slices, cat,
expand and reshape are on every list.

Exact: the same elements in the same order. Does not fire when: a position is not a constant,
or a boolean mask; indexed dims are not consecutive (advanced indexing then moves them first);
an index varies along another index's axis (not an outer product); a position is out of range
(eager raises, so the graph keeps the op that raises; ``index_select`` takes no negative ones);
a dim's positions fit none of the forms above; shapes are symbolic; a 0-d ``index_select``.
"""

from __future__ import annotations

import math

import torch

from fxpass import rule
from fxpass.graph import bind_args
from fxpass.rules._util import aten, fresh, literal

MAX_RUNS = 8


def _runs(pos: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 0] -> [(3, 6), (0, 1)]: half-open ranges of consecutive positions."""
    out: list[tuple[int, int]] = []
    for p in pos:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _repeat(pos: list[int]) -> int:
    """r if ``pos`` is a run with each position repeated r >= 2 times in a row, else 0."""
    r = next((i for i, p in enumerate(pos) if p != pos[0]), len(pos))
    if r < 2 or len(pos) % r:
        return 0
    ok = all(p == pos[0] + j // r for j, p in enumerate(pos))
    return r if ok else 0


def _stride(pos: list[int]) -> int:
    """s if ``pos`` steps by a constant s >= 2, else 0."""
    if len(pos) < 2 or pos[1] - pos[0] < 2:
        return 0
    s = pos[1] - pos[0]
    return s if all(b - a == s for a, b in zip(pos, pos[1:], strict=False)) else 0


def _form(pos: list[int]) -> tuple[str, int] | None:
    """How to gather ``pos`` (all in range): ("run" | "stride" | "repeat" | "runs", n)."""
    runs = _runs(pos)
    if len(runs) == 1:
        return "run", 1
    if s := _stride(pos):
        return "stride", s
    if r := _repeat(pos):
        return "repeat", r
    return ("runs", len(runs)) if len(runs) <= MAX_RUNS else None


def _gather(rw, x, d: int, shape: list[int], pos: list[int], form: tuple[str, int]):
    """x's dim d at ``pos`` in the given form: (node, whether it is a new tensor)."""
    kind, k = form
    if kind == "run":
        return rw.call(aten.slice.Tensor, x, d, pos[0], pos[-1] + 1), False
    if kind == "stride":
        return rw.call(aten.slice.Tensor, x, d, pos[0], pos[-1] + 1, k), False
    if kind == "repeat":
        m = len(pos) // k
        src = rw.call(aten.slice.Tensor, x, d, pos[0], pos[0] + m)
        wide = list(shape)
        wide[d:d + 1] = [m, k]
        up = rw.call(aten.expand.default, rw.call(aten.unsqueeze.default, src, d + 1), wide)
        out = list(shape)
        out[d] = len(pos)
        return rw.call(aten.reshape.default, up, out), m > 1  # m == 1: a stride-0 view
    parts = [rw.call(aten.slice.Tensor, x, d, a, b) for a, b in _runs(pos)]
    return rw.call(aten.cat.default, parts, d), True


@rule(aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_select.default,
      name="constant_index")
def constant_index(node, rw) -> bool:
    """Constant positions on consecutive dims (an outer product) -> one gather per dim."""
    select = node.target is aten.index_select.default
    if select:  # index_select(x, d, i) is x[(:,) * d + (i,)], without negative positions
        args = bind_args(node)
        x, d, i = args["self"], args["dim"], args["index"]
        if rw.val(x).dim() == 0:
            return rw.skip("a 0-d input")
        indices = [None] * (d % rw.val(x).dim()) + [i]
    else:
        x, indices = node.args
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used:
        return rw.skip("no indexed dim")
    if used != list(range(used[0], used[0] + len(used))):
        return rw.skip("indexed dims are not consecutive (advanced indexing moves them first)")
    consts = [literal(rw, indices[i]) for i in used]
    if any(c is None for c in consts):
        return rw.skip("positions computed at run time (a gather)")
    if any(c.dtype not in (torch.int64, torch.int32) or c.numel() == 0 for c in consts):
        return rw.skip("positions are not non-empty integer tensors")
    if not rw.static(x):
        return False
    k = len(used)
    if any(c.dim() > k for c in consts):
        return rw.skip("an index of higher rank than the indexed dims")
    plan, shape = [], list(rw.val(x).shape)
    for axis, (d, c) in enumerate(zip(used, consts, strict=True)):
        full = [1] * (k - c.dim()) + list(c.shape)  # right-aligned to the broadcast rank
        if any(n != 1 for j, n in enumerate(full) if j != axis):
            return rw.skip("an index varies along another index's axis (not an outer product)")
        n = shape[d]
        pos = c.reshape(-1).tolist()
        if any(p < (0 if select else -n) or p >= n for p in pos):
            return rw.skip("a position out of range (eager raises; kept so it still does)")
        pos = [p % n for p in pos]
        form = _form(pos)
        if form is None:
            return rw.skip(f"dim {d}: positions fit no slice, stride, repeat or {MAX_RUNS} runs")
        plan.append((d, pos, form))
        shape[d] = len(pos)
    if list(rw.val(node).shape) != shape or math.prod(shape) != rw.val(node).numel():
        return rw.skip("the result's shape is not the per-dim gathers' (broadcast indices)")
    out, shape, copied = x, list(rw.val(x).shape), False
    for d, pos, form in plan:  # checked above: only now edit the graph
        out, new = _gather(rw, out, d, shape, pos, form)
        copied |= new
        shape[d] = len(pos)
    # a view of x, or a cat that kept x's channels-last format, is made a new tensor laid out
    # as the op's result (later views were traced against those strides)
    if not copied or rw.val(out).stride() != rw.val(node).stride():
        out = fresh(rw, node, out)
    rw.replace(node, out)
    return True
