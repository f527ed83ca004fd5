"""Decode-step inputs inside ``compile_for_generate``'s ``generate()``: HF's dict, stepped by
one position instead of rebuilt.

Why: before every decode step HF's ``prepare_inputs_for_generation`` rebuilds the step's inputs
from scratch: it slices and clones the ids, looks the model's dtype and device up over its
parameters, and builds the 4-D attention mask through the mask functions: a few hundred Python
calls, run right after the region has streamed the weights through the caches. The package's
runner pays none of it; stepping them is 0.97x HF's ms/token on a compiled Qwen3 4 x 512
(``python -m benchmarks.probes.step_inputs``, paired).

A decode step over a static cache with full causal attention needs only three new values:
the last token's id, its position (when HF passes positions), and a mask that lets the query
see every cached position the 2-D attention mask keeps (``mask[b, 0, 0, j] =
attention_mask[b, j]`` for the ``n`` positions written, all of them without a 2-D mask, False
for the cache slots after them). :class:`StepInputs` builds exactly that and reuses every
other value of the step before (the cache object, the flags).

When it applies, all of these hold, else HF's function runs:

- the call is inside ``compile_for_generate``'s ``generate()`` (not nested in another), after
  a decode step HF prepared itself in the same call;
- the model uses HF's generic ``prepare_inputs_for_generation`` and mask function (none of its
  own, on its class or set on the instance), SDPA's boolean masks, and its config says every
  layer attends to every earlier position (no sliding window, no chunked attention), as read at
  the start of each ``generate()`` call (:func:`can_step`);
- HF's mask was a boolean ``[B, 1, 1, max_cache_len]`` tensor, alone or as the only entry
  (``full_attention``) of a dict, equal to the closed form above: sliding-window, chunked and
  additive (eager-attention) masks never step;
- the ids grew by exactly one token since that step, the cache is the same object, the
  attention mask is 2-D with one column per id, and every other argument is the same object.

The first stepped decode of every ``generate()`` call is checked against HF's own answer:
same keys, equal ids, positions and masks (dtype, shape, strides, values), the same other
values. A difference turns stepping off for this model on this thread (:attr:`StepInputs.off`
says why) and HF's answer is used, so a transformers whose mask functions change gives its
own inputs, never ours.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

#: the only mask key a stepped input may carry (HF's name for full causal attention)
FULL = "full_attention"
#: the arguments that change or are checked apart each step: the 2-D mask and the positions
#: (read), the cache (the same object); every other argument must be the same object each step
PER_STEP_ARGS = ("attention_mask", "past_key_values", "position_ids")
#: the values of HF's dict a step builds; every other value is an argument passed through
BUILT_KEYS = ("input_ids", "position_ids", "attention_mask")
#: the attribute of a stepping ``prepare_inputs_for_generation`` that holds HF's own
UNSTEPPED = "_fxpass_unstepped"


#: decode inputs stepped, checked against HF's, and found different, in this process
#: (diagnostics for tests and probes; threads update it without a lock)
COUNTS: Counter[str] = Counter()


class StepInputs(threading.local):
    """Per thread: the last decode inputs HF prepared in this ``generate()`` call.
    ``check_all``: compare every stepped input with HF's, not only a call's first (tests)."""

    def __init__(self, check_all: bool = False) -> None:
        self.check_all = check_all
        self.last: dict[str, Any] | None = None  # the inputs of the step before
        self.ids = 0  # how many ids that step saw
        self.cache: Any = None  # its cache object
        self.passed: dict[str, Any] = {}  # its other arguments, by identity
        self.checked = False  # a stepped input of this call has matched HF's
        self.active = False  # inside compile_for_generate's outermost generate()
        #: why stepping is off for this model on this thread (a check found HF's answer
        #: different), or None
        self.off: str | None = None

    def start(self) -> None:
        """A new ``generate()`` call: nothing to step from yet, and one check to make."""
        self.last, self.cache, self.passed, self.checked = None, None, {}, False

    def prepare(self, hf: Callable[..., dict], input_ids: torch.Tensor, kwargs: dict) -> dict:
        """The inputs for ``hf(input_ids, **kwargs)``: stepped when that is exact, else HF's."""
        stepped = self._step(input_ids, kwargs) if self.last is not None else None
        if stepped is not None and self.checked and not self.check_all:
            self.last, self.ids = stepped, input_ids.shape[1]  # the same cache and arguments
            COUNTS["stepped"] += 1
            return stepped
        out = hf(input_ids, **kwargs)
        if stepped is not None:  # the first stepped input of this call: is it HF's?
            why = differs(stepped, out)
            if why is not None:
                self.off = f"stepped decode inputs differ from HF's ({why})"
                COUNTS["off"] += 1
                self.last = None
                return out
            COUNTS["checked"] += 1
            self.checked = True
        if _steppable(out, input_ids, kwargs):
            self._keep(out, input_ids, kwargs)
        else:
            self.last = None
        return out

    def _keep(self, out: dict, input_ids: torch.Tensor, kwargs: dict) -> None:
        self.last, self.ids = out, input_ids.shape[1]
        self.cache = kwargs.get("past_key_values")
        self.passed = {k: v for k, v in kwargs.items() if k not in PER_STEP_ARGS}

    def _step(self, input_ids: torch.Tensor, kwargs: dict) -> dict | None:
        """The next step's inputs from the last, or None when anything it assumes has moved."""
        n = input_ids.shape[1]
        mask2d = kwargs.get("attention_mask")
        if (n != self.ids + 1 or kwargs.get("past_key_values") is not self.cache
                or not _full_width(mask2d, input_ids)
                or kwargs.keys() - set(PER_STEP_ARGS) != self.passed.keys()
                or any(kwargs[k] is not v for k, v in self.passed.items())
                or not _positions_fit(self.last, kwargs, n)):
            return None
        positions = kwargs.get("position_ids")
        last = self.last["attention_mask"]
        old = last[FULL] if isinstance(last, dict) else last
        if n > old.shape[-1]:  # past the cache: HF's error
            return None
        out = dict(self.last)
        mask = _closed(old, mask2d, n)
        out["input_ids"] = _last(input_ids)
        if positions is not None:
            out["position_ids"] = _last(positions)
        out["attention_mask"] = {FULL: mask} if isinstance(last, dict) else mask
        return out


def _steppable(out: dict, input_ids: torch.Tensor, kwargs: dict) -> bool:
    """Whether HF's decode inputs ``out`` have the form :meth:`StepInputs._step` rebuilds."""
    if kwargs.get("next_sequence_length") != 1 or kwargs.get("is_first_iteration"):
        return False
    if kwargs.get("inputs_embeds") is not None:  # (HF's dict then has no ids to step)
        return False
    # every other value must be an argument passed through: a value HF computed would go stale
    if any(key not in BUILT_KEYS and (key not in kwargs or value is not kwargs[key])
           for key, value in out.items()):
        return False
    positions = kwargs.get("position_ids")
    if not _positions_fit(out, kwargs, input_ids.shape[1]) or (
            positions is not None and not _same(out["position_ids"], _last(positions))):
        return False
    mask2d, mask = kwargs.get("attention_mask"), out.get("attention_mask")
    if isinstance(mask, dict):
        if mask.keys() != {FULL}:
            return False
        mask = mask[FULL]
    if not (_full_width(mask2d, input_ids) and isinstance(mask, torch.Tensor)
            and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[:3] == (input_ids.shape[0], 1, 1)
            and mask.shape[3] >= input_ids.shape[1]):
        return False
    closed = _closed(mask, mask2d, input_ids.shape[1])
    return bool(torch.equal(closed, mask)) and _same(out.get("input_ids"), _last(input_ids))


def _positions_fit(out: dict, kwargs: dict, n: int) -> bool:
    """HF's dict ``out`` has positions exactly when the call passed them, one per id."""
    positions = kwargs.get("position_ids")
    return ("position_ids" in out) == (positions is not None) and (
        positions is None or positions.shape[-1] == n)


def _full_width(mask2d: Any, input_ids: torch.Tensor) -> bool:
    """``mask2d`` is None (every position kept) or a 2-D mask with one column per id."""
    return mask2d is None or (isinstance(mask2d, torch.Tensor) and mask2d.shape == input_ids.shape)


def _closed(like: torch.Tensor, mask2d: torch.Tensor | None, n: int) -> torch.Tensor:
    """The decode mask of a query at position ``n - 1``: the ``n`` written positions that
    ``mask2d`` keeps (all when None), none of the cache slots after them."""
    mask = torch.zeros_like(like)
    mask[:, 0, 0, :n] = True if mask2d is None else mask2d
    return mask


def _last(grown: torch.Tensor) -> torch.Tensor:
    """The last position of ids or positions, as HF slices it for a one-token step."""
    return grown[..., -1:].clone(memory_format=torch.contiguous_format)


def _same(a: Any, b: torch.Tensor) -> bool:
    """``a`` is a tensor equal to ``b`` in dtype, shape, strides and values."""
    return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device and bool(torch.equal(a, b)))


def differs(mine: dict, hf: dict) -> str | None:
    """Why the stepped inputs ``mine`` are not HF's ``hf``, or None when they are the same."""
    if list(mine) != list(hf):
        return f"keys {list(mine)} against {list(hf)}"
    for key, value in hf.items():
        ours = mine[key]
        if isinstance(value, dict) and isinstance(ours, dict):
            if value.keys() != ours.keys():
                return f"{key} keys {sorted(ours)} against {sorted(value)}"
            pairs = [(f"{key}[{k!r}]", ours[k], v) for k, v in value.items()]
        else:
            pairs = [(key, ours, value)]
        for name, a, b in pairs:
            if isinstance(b, torch.Tensor):
                if not _same(a, b):
                    return f"{name} is not equal"
            elif a is not b:
                return f"{name} is another object"
    return None


def stepping(hf: Callable[..., dict], steps: StepInputs) -> Callable[..., dict]:
    """``hf`` (a model's bound ``prepare_inputs_for_generation``) that steps its decode inputs
    through ``steps`` while ``steps.active``; HF's function otherwise."""

    @functools.wraps(hf)
    def prepare(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> dict:
        if args or not steps.active or steps.off is not None:
            return hf(input_ids, *args, **kwargs)
        return steps.prepare(hf, input_ids, kwargs)

    setattr(prepare, UNSTEPPED, hf)
    return prepare


def can_step(model: Any, own: Callable[[Any], bool] = lambda f: False) -> bool:
    """Whether ``model``'s decode inputs are HF's generic ones, the only ones
    :class:`StepInputs` knows: HF's ``prepare_inputs_for_generation`` and mask function, on
    the class and on the instance (``own(f)``: an instance function that is fxpass's own, its
    stepped inputs or its masks; by identity, since ``functools.wraps`` copies markers),
    SDPA's boolean masks, and every layer attending to every earlier position (a sliding
    window or chunked attention masks positions a step would keep). Read at every
    ``generate()`` call: a config changed since compile counts."""
    try:
        from transformers import masking_utils as mu
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return False
    try:
        return _generic(model, own, mu, GenerationMixin)
    except Exception:  # noqa: BLE001 - an unusual model or config: HF's own inputs
        return False


def _generic(model: Any, own: Callable[[Any], bool], mu: Any, mixin: type) -> bool:
    mine = vars(model).get("prepare_inputs_for_generation")
    masks = vars(model).get("create_masks_for_generate")
    if (getattr(type(model), "prepare_inputs_for_generation", None)
            is not mixin.prepare_inputs_for_generation
            or getattr(type(model), "create_masks_for_generate", None) is not None
            or (mine is not None and not own(mine))
            or (masks is not None and not own(masks))):
        return False
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if (getattr(config, "_attn_implementation", None) != "sdpa"
            or mu.ALL_MASK_ATTENTION_FUNCTIONS.get("sdpa") is not mu.sdpa_mask):
        return False  # (another implementation's masks, or SDPA's mask function replaced)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == FULL for t in types)
    return (getattr(config, "sliding_window", None) is None
            and getattr(config, "attention_chunk_size", None) is None)
