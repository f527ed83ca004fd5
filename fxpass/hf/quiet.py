"""Whether a ``generate()`` call runs none of the caller's code between two decode steps: a
*quiet* call, whose trusted steps may skip fxpass's weight guard (``fxpass.jit.held``).

Why: the weight guard reads every frozen weight's pointer, version, shape and dtype on every
call, about 80 us of a Qwen3 4 x 512 decode step on cold caches. Inside one call, a trusted
step (``fxpass.hf.steps``) follows a step that checked those same weights; if only
transformers' and torch's own code ran since, nothing wrote them.

What counts as the caller's code, each checked at the start of the call:

- an argument that runs code (:data:`CALLERS_CODE`), or anything past the generation config
  by position;
- a forward hook or pre-hook on the model or process-wide, a torch function or dispatch mode,
  a Python trace or profile function (a debugger, a profiler, coverage);
- an input tensor of a subclass (its ``__torch_function__``);
- a function on the model instance other than fxpass's own (by identity: ``functools.wraps``
  copies fxpass's marker attributes onto a wrapper, as accelerate's hooks wrap ``forward``)
  and the class's own bound methods;
- a function of the model's class, of the cache passed in or of its layers (their whole MRO)
  whose code is not in transformers' or torch's files: a subclass or a patched method.

Not seen: code the caller patched into transformers' own modules (module-level functions),
signal handlers, ``gc`` callbacks and finalizers. Pass ``step_guards="all"`` where those can
write weights mid-call.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

#: ``generate()``'s parameters through which the caller's code runs between decode steps
CALLERS_CODE = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                "streamer", "assistant_model", "negative_prompt_ids", "custom_generate")
#: its parameters that may come by position without being looked at: inputs and the config
#: (``synced_gpus``, the next one, is taken as the caller's too: simpler, and never lost)
PLAIN_POSITIONAL = 2
#: torch's process-wide module hooks (dicts), read by name: any entry runs per forward call
GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks")


def quiet_call(model: Any, args: tuple, kwargs: dict[str, Any],
               ours: Callable[[Any], bool]) -> bool:
    """Whether ``model.generate(*args, **kwargs)`` is quiet (module doc); ``ours``: whether a
    function on the instance is one fxpass set there."""
    if any(a is not None for a in args[PLAIN_POSITIONAL:]):
        return False
    if any(kwargs.get(k) is not None for k in CALLERS_CODE):
        return False
    if any(isinstance(v, torch.Tensor) and type(v) is not torch.Tensor
           for v in (*args, *kwargs.values())):
        return False
    if not _no_hooks(model):
        return False
    own = type(model)
    if any(callable(v) and not ours(v) and not _bound_own(v, model, own, k)
           for k, v in vars(model).items()):
        return False
    classes = {type(o) for o in (model, *_cache_parts(kwargs.get("past_key_values")))}
    return all(_library_class(c) for c in classes)


def _no_hooks(model: Any) -> bool:
    """No forward hook on ``model`` or process-wide, no torch mode, no trace or profile."""
    if getattr(model, "_forward_pre_hooks", True) or getattr(model, "_forward_hooks", True):
        return False
    mod = torch.nn.modules.module
    if any(getattr(mod, h, True) for h in GLOBAL_HOOKS):
        return False
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return False
    try:
        return torch._C._len_torch_function_stack() == 0 and (
            torch._C._len_torch_dispatch_stack() == 0)
    except AttributeError:  # private names: unknown means "not quiet"
        return False


def _bound_own(v: Any, model: Any, own: type, name: str) -> bool:
    """``v`` is the model class's own method ``name`` bound to ``model``."""
    return getattr(v, "__self__", None) is model and getattr(v, "__func__", None) is getattr(
        own, name, None)


def _cache_parts(cache: Any) -> list[Any]:
    """The cache passed in, its layers and sub-caches (an encoder-decoder cache holds two)."""
    if cache is None:
        return []
    parts = [cache]
    for sub in ("self_attention_cache", "cross_attention_cache"):
        parts += _cache_parts(getattr(cache, sub, None))
    layers = getattr(cache, "layers", None)
    return parts + (list(layers) if isinstance(layers, list | tuple) else [])


def _library_class(cls: type) -> bool:
    """Every function of ``cls`` and its bases (methods, static and class methods, property
    getters, a callable object's ``__call__``) has its code in transformers' or torch's files
    (``co_filename``: ``functools.wraps`` copies a name and a module, not the code)."""
    return all(_library_code(v) for klass in cls.__mro__ if klass is not object
               for v in vars(klass).values())


def _library_code(v: Any, depth: int = 0) -> bool:
    """Whether class attribute ``v`` runs no Python code outside transformers' and torch's
    files. A wrapper of the standard library's (``contextlib.contextmanager``'s) is judged by
    what it wraps."""
    code = _code(v)
    if code is None:
        return True
    lib, std = _library_dirs()
    if code.co_filename.startswith(lib):
        return True
    inner = getattr(getattr(v, "__func__", v), "__wrapped__", None)
    return (code.co_filename.startswith(std) and inner is not None and depth < 8
            and _library_code(inner, depth + 1))


def _code(v: Any) -> Any:
    """The code object a class attribute runs when called, if it is Python code."""
    if isinstance(v, staticmethod | classmethod):
        v = v.__func__
    elif isinstance(v, property):
        v = v.fget
    elif isinstance(v, functools.partial):
        v = v.func
    code = getattr(v, "__code__", None)
    if code is None and callable(v) and not isinstance(v, type):
        call = next((vars(k)["__call__"] for k in type(v).__mro__ if "__call__" in vars(k)),
                    None)
        code = getattr(call, "__code__", None)
    return code


@functools.cache
def _library_dirs() -> tuple[tuple[str, ...], str]:
    """(transformers' and torch's directories, the standard library's)."""
    import transformers

    return (tuple(os.path.dirname(m.__file__) + os.sep for m in (transformers, torch)),
            os.path.dirname(os.__file__) + os.sep)
