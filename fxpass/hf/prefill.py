"""Prompts of any length on one compiled prefill graph, through HF's chunked prefill.

Shapes are static, so each new prompt length was a new prefill graph: 3-4 s of compile per
length (Qwen3 4 x 512), and past Dynamo's recompile limit (eight graphs per function) every new
length ran its prefill eagerly, with only Dynamo's log line to say so. A chat sends a new
length with every message.

:class:`PrefillChunks` compiles one length, the *chunk* (the first ``generate()``'s prompt
length unless the caller chose it). Every prompt runs through HF's own chunked prefill
(``prefill_chunk_size``, passed per call; HF slices the ids, positions and masks per chunk):
chunks of the compiled length reuse its graph, and the tail shorter than a chunk (and a prompt
shorter than a chunk) runs the model's own forward eagerly, so nothing computed eagerly differs
from eager. The forward side is :func:`runs_eagerly` and :func:`dense`, called by
``generation._step_counters_symbolic``.

HF's chunked prefill is not right for every architecture (transformers 5.23 sizes Falcon's
early-initialized cache with the wrong head count). A ``generate()`` that fails inside a forward
call of its chunked prefill is run again without chunks; if that works, one warning, and that
model keeps compiling each prompt length as before. An error before any forward call (a bad
argument) or after the prefill, or one the unchunked run raises too, is the caller's: raised
as it is, chunks stay on.

HF leaves out the mask of a causal first chunk (empty cache, no padding: SDPA's ``is_causal``
does it) and passes one to every later chunk, so a prompt of two chunks or more compiled a
third graph. :func:`spelled_out_masks` gives the compiled chunks HF's own mask always.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch


class PrefillChunkWarning(UserWarning):
    """HF's chunked prefill failed on this model: each prompt length compiles its own graph."""


class PrefillChunks:
    """Which prompt length gets a compiled prefill graph, for one ``compile_for_generate``.

    A caller who sets HF's ``prefill_chunk_size`` (generation config or per call) keeps it,
    and that length is the compiled one; ``prefill_chunk_size=None`` in a call compiles that
    prompt's exact length."""

    def __init__(self, chunk: int | None):
        self.chunk = chunk
        self.auto = chunk is None  # chosen from the prompts, not by the caller
        #: why chunks are off for this model (HF's chunked prefill failed on it), or None
        self.off: str | None = None
        #: a generate() with our chunks has returned on this model
        self.proven = False

    def arrange(self, model: Any, args: tuple, kwargs: dict) -> tuple[int | None, int]:
        """For this ``generate()`` call: the prompt length that runs compiled (None: every
        length compiles, as before) and how many prefill calls the chunks take if this added
        ``prefill_chunk_size`` to ``kwargs`` (0 if it did not)."""
        cfg = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        if "prefill_chunk_size" in kwargs:
            return kwargs["prefill_chunk_size"], 0
        if getattr(cfg, "prefill_chunk_size", None) is not None:
            return cfg.prefill_chunk_size, 0
        if (self.off is not None
                or getattr(getattr(model, "config", None), "is_encoder_decoder", False)
                # HF chunks only into a cache, and returns only the last chunk's prefill
                # states: what the caller asked for would change (found in review)
                or _asked(kwargs, cfg, "use_cache", True) is False
                or _asked(kwargs, cfg, "output_hidden_states", False)
                or _asked(kwargs, cfg, "output_attentions", False)
                or kwargs.get("inputs_embeds") is not None  # HF chunks prompts of ids only
                # a cache to continue: HF prefills only the new ids, so the count below is off
                or kwargs.get("past_key_values") is not None
                # a failed first try would have streamed the prompt already
                or (kwargs.get("streamer") is not None and not self.proven)):
            return None, 0
        n = prompt_length(args[0] if args else kwargs.get("input_ids", kwargs.get("inputs")))
        if n is None:
            return None, 0
        if self.chunk is None or (self.auto and self.chunk < MIN_AUTO_CHUNK <= n):
            # the first prompt; once more if that was a warm-up of a few tokens, which as the
            # chunk would cut every later prompt into that many calls (found in review)
            self.chunk = n
        # always, also for a prompt of one chunk or less: HF then initializes the cache before
        # the first forward, so every prefill call finds the same cache state (a lazily
        # initialized one is traced differently: one more graph)
        kwargs["prefill_chunk_size"] = self.chunk
        return self.chunk, -(-n // self.chunk)

    def give_up(self, model: Any, err: Exception) -> None:
        """HF's chunked prefill failed on ``model`` where the same call without chunks
        worked: chunks off for it, one warning."""
        why = _root_cause(err)
        self.off = why
        warnings.warn(
            f"fxpass: transformers' chunked prefill failed on {type(model).__name__} "
            f"({why}); this generate() ran again without chunks, and from now on each new "
            "prompt length compiles its own prefill graph (seconds each; past Dynamo's "
            "recompile limit, eagerly). Tokens are unaffected",
            PrefillChunkWarning, stacklevel=3,
        )


#: an automatic chunk shorter than this is chosen again from the first prompt this long
MIN_AUTO_CHUNK = 16


def _asked(kwargs: dict, cfg: Any, name: str, default: Any) -> Any:
    """A ``generate()`` option as HF resolves it: the call's keyword, else the config's."""
    return kwargs[name] if name in kwargs else getattr(cfg, name, default)


#: Dynamo's wording for the model's own error met while tracing with fake tensors
_DYNAMO_GOT = re.compile(r"got (\w+(?:Error|Exception))\((['\"])(.*?)\2\)")


def _root_cause(err: Exception) -> str:
    """The model's own error in one line: Dynamo reports it inside its message
    (``... got RuntimeError('index_copy_(): ...')``), not as a cause."""
    m = _DYNAMO_GOT.search(str(err))
    text = f"{m.group(1)}: {m.group(3)}" if m else f"{type(err).__name__}: {err}"
    return text.splitlines()[0][:300]


def prompt_length(ids: Any, embeds: Any = None) -> int | None:
    """Tokens per sequence in a prompt of ids ``[B, S]`` or embeddings ``[B, S, H]``."""
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return ids.shape[-1]
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        return embeds.shape[1]
    return None


def runs_eagerly(compiled_length: int, args: tuple, kwargs: dict) -> bool:
    """Whether a forward call inside ``generate()`` is a prompt (or a prompt's tail) of
    another length than the compiled one (a one-token tail runs the decode graph)."""
    n = prompt_length(args[0] if args else kwargs.get("input_ids"), kwargs.get("inputs_embeds"))
    return n is not None and n != 1 and n != compiled_length


def dense(kwargs: dict) -> dict:
    """``kwargs`` with each tensor that was sliced along its last dim copied to row-major
    strides. Why: HF slices a chunk's positions out of the whole prompt's, so a ``[1, 32]``
    chunk has stride 40 for a 40-token prompt and 50 for a 50-token one (and a one-token tail,
    run by the decode graph, stride 33); Dynamo guards strides, so each prompt length was a
    new graph (found by a probe). Only that slicing is checked (it runs every step; HF builds
    its masks fresh); the same dict when nothing needs it."""
    def sliced(v: Any) -> bool:
        return (isinstance(v, torch.Tensor) and v.dim() >= 2
                and (v.stride(-1) != 1 or v.stride(-2) != v.shape[-1]))

    if not any(sliced(v) for v in kwargs.values()):
        return kwargs
    return {k: v.clone(memory_format=torch.contiguous_format) if sliced(v) else v
            for k, v in kwargs.items()}


def spelled_out_masks(compiled_length: Callable[[], int | None]) -> Callable | None:
    """HF's generic ``create_masks_for_generate`` that, for a prompt chunk of the compiled
    length (``compiled_length()``, None outside ``generate()``), asks HF's mask functions for
    the masks they would leave to SDPA's ``is_causal`` (``allow_is_causal_skip=False``).

    Why: HF skips the mask of a causal chunk on an empty cache and passes one to the chunks
    after it; the compiled graph of one does not take the other's inputs, so prompts of two
    chunks or more compiled a third graph (3-4 s on Qwen3 4 x 512). With the mask spelled
    out, every chunk runs one prefill graph. The mask is HF's own, so the answer is the same;
    calls that run eagerly (a tail, a short prompt) and decode steps keep HF's choice.
    None if this transformers has no generic mask function to wrap."""
    try:
        from transformers import masking_utils as mu
        from transformers.generation import utils as generation_utils
    except ImportError:
        return None
    # the name HF's generate() falls back to, in case something patched one of the two
    generic = getattr(generation_utils, "create_masks_for_generate", None)
    if generic is None:
        return None
    sig = inspect.signature(generic)

    @functools.wraps(generic)
    def create(*args: Any, **kwargs: Any) -> Any:
        out = generic(*args, **kwargs)
        n = compiled_length()
        if n is None or n == 1 or not (out is None or isinstance(out, dict)):
            return out
        # the query length first: a decode step (every token) ends here, unbound
        embeds = kwargs["inputs_embeds"] if "inputs_embeds" in kwargs else (
            args[1] if len(args) > 1 else None)
        if prompt_length(None, embeds) != n:
            return out
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        mask_kwargs = {k: v for k, v in bound.arguments.items()
                       if sig.parameters[k].kind is not inspect.Parameter.VAR_KEYWORD}
        config = mask_kwargs["config"] = mask_kwargs["config"].get_text_config()
        if isinstance(out, dict):
            out = dict(out)
            for key, mask in out.items():
                fn = _mask_function(mu, config, key) if mask is None else None
                if fn is not None:
                    out[key] = fn(**mask_kwargs, allow_is_causal_skip=False)
            return out
        fn = _mask_function(mu, config, None)
        return out if fn is None else fn(**mask_kwargs, allow_is_causal_skip=False)

    return create


def _mask_function(mu: Any, config: Any, key: str | None) -> Callable | None:
    """The HF mask function that made mask ``key`` of ``create_masks_for_generate`` (None:
    its single mask), if it is one of the three causal ones that may skip; None if unsure.
    Mirrors that function's dispatch, so a transformers that changes it gets None."""
    causal = (mu.create_causal_mask, mu.create_sliding_window_causal_mask,
              mu.create_chunked_causal_mask)
    if key is None:  # one mask for every layer
        if hasattr(config, "layer_types"):
            return None  # HF returned the raw mask: it has no function for some layer type
        if getattr(config, "sliding_window", None) is not None:
            found = {mu.create_sliding_window_causal_mask}
        elif getattr(config, "attention_chunk_size", None) is not None:
            found = {mu.create_chunked_causal_mask}
        else:
            found = {mu.create_causal_mask}
    else:
        mapping = getattr(mu, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
        found = set()
        for pattern in set(getattr(config, "layer_types", None) or ()):
            fn = mapping.get(pattern)
            if isinstance(fn, dict):  # a pattern that needs several masks ("hybrid")
                if key not in fn:
                    continue
                fn = fn[key]
            elif pattern != key:
                continue
            found.add(fn)
    (fn,) = found if len(found) == 1 else (None,)
    return fn if fn in causal else None
