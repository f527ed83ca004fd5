"""constant_index: ``x[..., [i, j, ...]]`` with constant positions -> slices (and a cat).

Before -> after: ``index(x, [None] * d + [c])`` with ``c`` a constant 1-D integer tensor ->
one ``slice(x, d, a, b)`` per run of consecutive positions, joined by ``cat`` when there are
several runs.

Why: ``aten.index`` (advanced indexing) is on no accelerator's operator list, but Python code
indexes with literal lists: Falcon splits its fused QKV with ``qkv[:, :, :, [-2]]`` in every
layer, which split each layer's region in three. Slices and cat are on every list.

Exact: the same elements in the same order. Does not fire when: the positions are not a
constant, or more than one dim is indexed, or a boolean mask; a position is out of range
(eager raises, so the graph keeps the op that raises); the positions break into more than
``MAX_RUNS`` runs (a gather is then the honest op); shapes are symbolic.
"""

from __future__ import annotations

import torch

from fxpass import rule
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


@rule(aten.index.Tensor, name="constant_index")
def constant_index(node, rw) -> bool:
    """index with constant positions on one dim -> slices joined by cat."""
    x, indices = node.args
    used = [i for i, t in enumerate(indices) if t is not None]
    if len(used) != 1:
        return rw.skip("more than one indexed dim")
    d = used[0]
    c = literal(rw, indices[d])
    if c is None:
        return rw.skip("positions computed at run time (a gather)")
    if c.dim() != 1 or c.dtype not in (torch.int64, torch.int32) or c.numel() == 0:
        return rw.skip("positions are not a non-empty 1-D integer tensor")
    if not rw.static(x):
        return False
    n = rw.val(x).shape[d]
    pos = c.tolist()
    if any(p < -n or p >= n for p in pos):
        return rw.skip("a position out of range (eager raises; kept so it still does)")
    runs = _runs([p % n for p in pos])
    if len(runs) > MAX_RUNS:
        return rw.skip(f"more than {MAX_RUNS} runs of consecutive positions")
    parts = [rw.call(aten.slice.Tensor, x, d, a, b) for a, b in runs]
    out = parts[0] if len(parts) == 1 else rw.call(aten.cat.default, parts, d)
    if len(parts) == 1:  # a slice is a view; index returns a new tensor
        out = fresh(rw, node, out)
    rw.replace(node, out)
    return True
