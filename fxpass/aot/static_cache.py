"""The static-cache module ``export_for_generate`` traces, and its one fallback.

transformers' ``TorchExportableModuleWithStaticCache`` holds the cache as buffers the program
writes in place and leaves the positions to the model, which derives them from the cache's
length. Some families do that by reading the length into Python: OPT and BioGpt slice their
positions (a cumulative sum of the mask) at the cache's length, a data-dependent slice that
``torch.export`` refuses, so those models could not be exported at all. Their forward also
takes ``position_ids``; passed explicitly (the cache position, for every row), the positions
are the ones the model derives itself for an unpadded prompt, and nothing is read into
Python. :func:`programs` tries transformers' module first and, only when its trace fails on a
data-dependent read and the model takes ``position_ids``, traces both programs again with
them: the families that export as they are keep the program they had, and the package's
inputs (``input_ids``, ``cache_position``) are the same either way.

Explicit positions do not make every such model exportable. BioGpt also sizes its mask by the
length it read, and torch.export fixes that size at the traced position (0) without a word:
its decode program attended slot 0 alone, at every position. A program is traced at one
position and run at all of them, so :func:`same_elsewhere` runs torch.export's program and
the model side by side at the last position the cache holds, over a cache filled with random
rows, and refuses the export if their outputs or written caches differ.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
from collections.abc import Callable
from typing import Any

import torch

from fxpass.aot.runtime import ExportError, data_dependent

#: how far torch.export's program may differ from the model (same ops: float rounding)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def exportable(model: torch.nn.Module, batch_size: int, max_cache_len: int,
               positions: bool = False) -> torch.nn.Module:
    """transformers' static-cache export module around ``model``; ``positions``: one that
    passes ``position_ids`` (the cache position) to the model too."""
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    class WithPositions(TorchExportableModuleWithStaticCache):
        def forward(self, input_ids: torch.Tensor | None = None,
                    inputs_embeds: torch.Tensor | None = None,
                    cache_position: torch.Tensor | None = None) -> torch.Tensor:
            for layer in self.static_cache.layers:  # as transformers' own forward does
                layer.cumulative_length.copy_(cache_position[0])
            rows = (input_ids if input_ids is not None else inputs_embeds).shape[0]
            out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds,
                             attention_mask=None, past_key_values=self.static_cache,
                             position_ids=cache_position.unsqueeze(0).expand(rows, -1),
                             use_cache=True)
            return out.logits if hasattr(out, "logits") else out.last_hidden_state

    cls = WithPositions if positions else TorchExportableModuleWithStaticCache
    return cls(model, batch_size=batch_size, max_cache_len=max_cache_len)


def takes_positions(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward names ``position_ids`` among its parameters."""
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def programs(model: torch.nn.Module, batch_size: int, max_cache_len: int,
             trace: Callable[[torch.nn.Module], dict[str, Any]],
             say: Callable[[str], None]) -> dict[str, Any]:
    """``trace(module)`` (both programs) on transformers' module, else, for a trace that read
    a tensor's value into Python on a model that takes ``position_ids``, on one that passes
    them (module doc); any other failure, or a second one, is raised as it is."""
    said = io.StringIO()  # torch prints the failed trace's graph: shown unless retried
    try:
        with contextlib.redirect_stderr(said):
            return trace(exportable(model, batch_size, max_cache_len))
    except ExportError as e:
        if not (data_dependent(e) and takes_positions(model)):
            raise
        said = None
        say(f"{type(model).__name__} derives its positions from the cache's length in Python; "
            "tracing again with position_ids = cache_position")
    finally:
        if said is not None:
            sys.stderr.write(said.getvalue())
    return trace(exportable(model, batch_size, max_cache_len, positions=True))


def same_elsewhere(wrapper: torch.nn.Module, kwargs: dict[str, torch.Tensor],
                   max_cache_len: int) -> Callable[[Any], None]:
    """A check for ``lower``: torch.export's program of ``wrapper(**kwargs)`` (traced at
    positions ``0..L-1``) against ``wrapper`` itself at ``max_cache_len - L``, the cache filled
    with the same random rows for both; raises :class:`ExportError` when the logits or the
    written caches differ beyond float rounding (module doc). The cache is left as it was."""
    ids, pos = kwargs["input_ids"], kwargs["cache_position"]
    start = max_cache_len - pos.numel()

    def check(ep: Any) -> None:
        if start <= 0:  # the traced positions are the only ones there are
            return
        cache = [t for layer in wrapper.static_cache.layers
                 for t in (getattr(layer, k, None) for k in ("keys", "values", "cumulative_length"))
                 if isinstance(t, torch.Tensor)]
        kept = [t.clone() for t in cache]  # with one copy of the written caches below: 2x
        module = ep.module()
        # the program's own cache buffers, by the wrapper's names (today the same tensors)
        names = {id(t): n for n, t in wrapper.named_buffers()}
        theirs = dict(module.named_buffers())
        mine = [t for t in cache if t.is_floating_point()]
        rows = [theirs.get(names.get(id(t)), t) for t in mine]
        own = [(r, r.clone()) for r, t in zip(rows, mine, strict=True) if r is not t]

        def fill(tensors: list[torch.Tensor]) -> None:  # the same random rows for both runs
            g = torch.Generator().manual_seed(0)
            for t in tensors:
                t.copy_(torch.randn(t.shape, generator=g))

        vocab = getattr(wrapper.model.config.get_text_config(), "vocab_size", None) or 2
        at = {"input_ids": torch.randint(0, vocab, tuple(ids.shape),
                                         generator=torch.Generator().manual_seed(1)),
              "cache_position": pos + start}
        try:
            fill(mine)
            want = [wrapper(**at), *(t.clone() for t in mine)]
            fill(rows)
            got = [module(**at), *rows]
            _compare(want, got, wrapper, pos.numel(), start, max_cache_len)
        finally:
            for t, k in [*zip(cache, kept, strict=True), *own]:
                t.copy_(k)

    return check


def _compare(want: list[torch.Tensor], got: list[torch.Tensor], wrapper: torch.nn.Module,
             length: int, start: int, max_cache_len: int) -> None:
    """Raise :class:`ExportError` at the first of logits, then caches, that differs beyond
    float rounding (``TOLERANCE``, relative to the largest finite value, at least 1)."""
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        tol = TOLERANCE.get(w.dtype, 1e-4)
        w, g = w.float(), g.float()
        scale = max(float(w.abs().nan_to_num(0, 0, 0).max()), 1.0)
        if torch.allclose(g, w, rtol=tol, atol=tol * scale, equal_nan=True):
            continue
        err = float((g - w).abs().nan_to_num(0, 0, 0).max())
        raise ExportError(
            f"cannot export {type(wrapper.model).__name__}: torch.export's program, traced at "
            f"positions 0..{length - 1}, gives other {'logits' if i == 0 else 'cache writes'} "
            f"than the model at positions {start}..{max_cache_len - 1} (max |diff| {err:.3g}, "
            f"values up to {scale:.3g}): the model reads a value from its cache into Python, "
            "and torch.export fixed it at the traced position. Fix: run it compiled instead "
            "(compile_for_generate), which traces again where the value changes")
