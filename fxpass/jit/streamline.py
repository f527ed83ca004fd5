"""A compiled graph's CPU side made as cheap per call as a package's: its cache writes fused
into one copy, and the ops that depend on one small integer input memoized per value.

Why: a ``torch.compile`` decode step runs the same CPU ops around its region as an exported
package does (the cache write positions and masks, functions of a position or of a layer's
length counter; two ``index_copy_`` per layer), each a few microseconds cold after the region
has streamed the weights through the caches. The package streamlines them (``aot.writes``,
``aot.memo``); this applies the same two passes to the JIT's graph.

What is a key: a tensor input of an integer dtype and at most :data:`MAX_KEY_ELEMENTS`
elements (a position, a cache's length counter, a decode step's token ids), static, not a
frozen weight (``aot.memo`` takes a key the graph writes, a counter bumped in place, only when
it is read before the write). What is a constant: the frozen weights and the graph's
attributes. The weight guard watches the weights: a changed weight rebuilds the graph, and
with it these memos, so a stored value never outlives the weights it was computed from.
Everything else a subgraph reads (state such as the KV cache, any other input) keeps it out
of the memo.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule

from fxpass.graph import is_static

#: an integer input with more elements than this (a prompt's ids) is not a memo key: each
#: distinct value would store its own tensors, and prompts rarely repeat
MAX_KEY_ELEMENTS = 4


def streamline(compiled: Any, inputs: list[tuple[Any, bool]]) -> dict[str, int]:
    """Fuse the cache writes of ``compiled`` (a graph module, or one behind ``TorchThreads``)
    and memoize its position ops, in place. ``inputs``: each placeholder's fake value and
    whether it is a frozen weight (a graph rebuilt from a stored plan carries neither). Returns
    what was done, for the report (absent when zero)."""
    from fxpass.aot.memo import memoize
    from fxpass.aot.writes import fuse_index_writes, grant_in_place, written_rows
    from fxpass.jit.runtime import TorchThreads

    gm = compiled.graph if isinstance(compiled, TorchThreads) else compiled
    if not isinstance(gm, GraphModule):
        return {}
    phs = gm.graph.find_nodes(op="placeholder")
    if len(phs) != len(inputs):
        return {}
    constants = {p.name for p, (_, frozen) in zip(phs, inputs, strict=True) if frozen}
    keys = [p.name for p, (val, frozen) in zip(phs, inputs, strict=True)
            if not frozen and _small_int(val)]
    done = {"in_place_inputs": grant_in_place(gm, _executor(gm))}
    done["written_rows"] = written_rows(gm)  # (before fusing: the writes then hide in one call)
    done["fused_writes"] = fuse_index_writes(gm)
    memos = memoize(gm, keys, constants) if keys else []
    done["memoized_ops"] = sum(
        1 for m in memos for n in m.fn.graph.nodes if n.op == "call_function")
    return {k: v for k, v in done.items() if v}


def _executor(gm: GraphModule) -> Any:
    """node -> the executor of the region it calls (a ``RegionCall`` submodule), or None."""
    from fxpass.jit.runtime import RegionCall

    def executor_of(n: Any) -> Any:
        if n.op != "call_module":
            return None
        mod = gm.get_submodule(n.target)
        return mod.executor if isinstance(mod, RegionCall) else None

    return executor_of


def _small_int(v: object) -> bool:
    return (isinstance(v, torch.Tensor) and is_static(v) and v.device.type == "cpu"
            and not v.dtype.is_floating_point and not v.dtype.is_complex
            and v.dtype != torch.bool and v.numel() <= MAX_KEY_ELEMENTS)

