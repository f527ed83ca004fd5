"""The supported ``generate()`` path: a static KV cache of fixed length, two graphs in total.

A BPU needs static shapes. HF's default ``DynamicCache`` grows by one position per token
(``cat(past, new)``), so every token is a new shape: Dynamo recompiles for each one until its
recompile limit and then runs the rest eagerly, silently slower than not compiling at all.
With ``cache_implementation="static"`` the cache is a fixed buffer written in place; the
``kv_cache_update`` rule turns that write into device ops, and ``generate()`` runs as two
graphs (prefill and decode), one region each.

:func:`compile_for_generate` sets that up, with a fixed ``max_cache_len`` so calls with other
``max_new_tokens`` (up to the ceiling) reuse the same two graphs instead of recompiling.
:func:`growing_state` recognises the dynamic-cache pattern so the backend can warn once.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.fx import GraphModule

from fxpass.graph import FROZEN

aten = torch.ops.aten

FIX = (
    "use a static cache: fxpass.backends.bpu.compile_for_generate(model, max_cache_len=N), or "
    'model.generate(..., cache_implementation="static") with '
    'torch.compile(model.forward, backend="fxpass_bpu", dynamic=False)'
)


class GrowingCacheWarning(UserWarning):
    """A graph returns state that grows every call (a dynamic KV cache): one compile per token."""


_warned = False


def growing_state(gm: GraphModule) -> list[str]:
    """Graph outputs that are an input concatenated with new values (state growing per call)."""
    (out,) = gm.graph.find_nodes(op="output")
    found = []
    for n in out.all_input_nodes:
        if n.op != "call_function" or n.target is not aten.cat.default:
            continue
        parts = n.args[0]
        if any(p.op == "placeholder" and FROZEN not in p.meta for p in parts) and len(parts) > 1:
            found.append(n.name)
    return found


def warn_if_growing(gm: GraphModule) -> str | None:
    """Warn once per process when ``gm`` looks like a dynamic-cache decode step."""
    global _warned
    grown = growing_state(gm)
    if not grown:
        return None
    note = (
        f"this graph returns {len(grown)} tensor(s) that grow every call (a dynamic KV cache: "
        "cat(past, new)); each token is a new shape, so Dynamo recompiles per token and then "
        f"falls back to eager. Fix: {FIX}"
    )
    if not _warned:
        _warned = True
        warnings.warn(f"fxpass_bpu: {note}", GrowingCacheWarning, stacklevel=3)
    return note


def compile_for_generate(
    model: Any, *, max_cache_len: int, options: dict[str, Any] | None = None
) -> Any:
    """Configure ``model`` for static-cache generation and compile its forward with fxpass_bpu.

    ``max_cache_len`` fixes the cache buffer (prompt plus new tokens, at most): every
    ``generate()`` call that fits reuses the same decode graph. Returns ``model``.
    """
    if not isinstance(max_cache_len, int) or max_cache_len <= 0:
        raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
    cfg = getattr(model, "generation_config", None)
    if cfg is None:
        raise TypeError(
            f"{type(model).__name__} has no generation_config: compile_for_generate is for "
            "transformers models with generate(); compile other models with torch.compile"
        )
    cfg.cache_implementation = "static"
    cfg.max_cache_len = max_cache_len
    model.forward = torch.compile(
        model.forward, backend="fxpass_bpu", dynamic=False, options=options or {}
    )
    return model
