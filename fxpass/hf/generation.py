"""The supported ``generate()`` path: a static KV cache of fixed length, two graphs in total.

A BPU needs static shapes. HF's default ``DynamicCache`` grows by one position per token
(``cat(past, new)``), so every token is a new shape: Dynamo recompiles for each one until its
recompile limit and then runs the rest eagerly, silently slower than not compiling at all.
With ``cache_implementation="static"`` the cache is a fixed buffer written in place; the
``kv_cache_update`` rule turns that write into device ops, and ``generate()`` runs as two
graphs (prefill and decode), one region each.

:func:`compile_for_generate` sets that up, with a fixed ``max_cache_len`` so calls with other
``max_new_tokens`` (up to the ceiling) reuse the same two graphs instead of recompiling, and
one compiled prompt length that prompts of every other length reuse through HF's chunked
prefill (``prefill.PrefillChunks``) instead of compiling per length.
:func:`growing_state` recognises the dynamic-cache pattern so the backend can warn once.

Sliding-window layers (Gemma 2/3, Mistral and Qwen2 with a window, Exaone 4, ...) keep a Python
int counter in HF's static cache (``StaticSlidingWindowLayer.cumulative_length_int``). Under
``dynamic=False`` Dynamo specializes that int, so every token was a new graph: the same silent
recompile-then-eager path as the dynamic cache. :func:`compile_for_generate` traces with those
counters symbolic (``torch.compiler.config.dynamic_sources``, set only around the compiled
call): the counter stays a host-side integer input, the shapes stay static, and generation is
one graph per cache regime (prefill, decode while the window fills, decode once it is full).
:func:`warn_if_recompiling` names the cause and the fix when any frame recompiles on a Python
int that changes every call.
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule

from fxpass.graph import FROZEN
from fxpass.hf.inputs import StepInputs, can_step, stepping
from fxpass.hf.prefill import PrefillChunks, dense, runs_eagerly, spelled_out_masks
from fxpass.hf.quiet import quiet_call
from fxpass.hf.steps import MODES as STEP_GUARDS
from fxpass.hf.steps import Owner, StepGuards

aten = torch.ops.aten

FIX = (
    "use a static cache: fxpass.hf.generation.compile_for_generate(model, max_cache_len=N, "
    'device=...), or model.generate(..., cache_implementation="static") with '
    'torch.compile(model.forward, backend="fxpass_<device>", dynamic=False)'
)


#: the attribute of HF's sliding-window cache layers that counts tokens in a Python int
STEP_COUNTER = "cumulative_length_int"
#: Python ints in HF caches that change every token (sources, as Dynamo names them, end so)
STEP_COUNTERS = rf".*\.{STEP_COUNTER}$"


class GrowingCacheWarning(UserWarning):
    """A graph returns state that grows every call (a dynamic KV cache): one compile per token."""


class RecompileWarning(UserWarning):
    """Dynamo recompiled a frame because a Python int changed: one compile per value."""


_warned = False
_recompiles: dict[tuple[str, str], int] = {}  # (frame, source) -> recompiles it caused


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
        warnings.warn(f"fxpass: {note}", GrowingCacheWarning, stacklevel=3)
    return note


def compile_for_generate(
    model: Any, *, max_cache_len: int, options: dict[str, Any] | None = None,
    loop_threads: int | None = 1, prefill_chunk: int | None = None, device: Any = None,
    step_guards: str = "auto",
) -> Any:
    """Configure ``model`` for static-cache generation and compile its forward with
    ``backend=f"fxpass_{device}"`` (``device``: an installed device's name).

    ``max_cache_len`` fixes the cache buffer (prompt plus new tokens, at most): every
    ``generate()`` call that fits reuses the same decode graph. ``loop_threads``: torch's
    thread count for HF's loop between two steps of ``generate()`` (None: the caller's); see
    :func:`_loop_on_threads`. ``prefill_chunk``: the one prompt length that gets a compiled
    prefill graph; longer prompts run in chunks of it and what is left over runs eagerly
    (``prefill.PrefillChunks``). None: the first ``generate()``'s prompt length.
    ``step_guards``: "auto" runs the later steps of one ``generate()`` call under the guards
    that tell compiled graphs apart, where that is sound (``fxpass.hf.steps``); "all" checks
    every guard on every step. Returns ``model``.
    """
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or (
            max_cache_len <= 0):
        raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
    if loop_threads is not None and (isinstance(loop_threads, bool) or not isinstance(
            loop_threads, int) or loop_threads < 1):
        raise ValueError(f"loop_threads must be a positive int or None, got {loop_threads!r}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
            prefill_chunk, int) or not 0 < prefill_chunk <= max_cache_len):
        raise ValueError(
            f"prefill_chunk must be None or an int from 1 to max_cache_len ({max_cache_len}), "
            f"got {prefill_chunk!r}"
        )
    if step_guards not in STEP_GUARDS:
        raise ValueError(f"step_guards must be one of {STEP_GUARDS}, got {step_guards!r}")
    cfg = getattr(model, "generation_config", None)
    if cfg is None:
        raise TypeError(
            f"{type(model).__name__} has no generation_config: compile_for_generate is for "
            "transformers models with generate(); compile other models with torch.compile"
        )
    from fxpass.jit.options import from_options

    # here, not wrapped in Dynamo's error at the first generate(); torch.compile takes its own
    # key (guard_filter_fn) out of the options before the backend sees them
    opts = from_options({k: v for k, v in (options or {}).items() if k not in TORCH_OPTIONS},
                        device)
    cfg.cache_implementation = "static"
    cfg.max_cache_len = max_cache_len
    # called again (another max_cache_len or options): compile the model's own forward
    # again, not the compiled one (a compile inside a compile; torch also refused it)
    forward = getattr(model.forward, UNCOMPILED, None) or model.forward
    forward = getattr(forward, "_torchdynamo_orig_callable", forward)  # torch.compile'd by hand
    # a copy: torch.compile pops guard_filter_fn out of the dict it gets (found in review: a
    # second call with the same dict compiled without the filter)
    compiled = torch.compile(forward, backend=f"fxpass_{opts.device}", dynamic=False,
                             options={k: v for k, v in (options or {}).items() if k != "device"})
    # the graphs an earlier compile_for_generate of this model compiled stay its own
    owner = Owner(forward, compiled, getattr(model.forward, OWNER, None))
    state = _GenerateState(loop_threads, step_guards, owner)
    prefill = PrefillChunks(prefill_chunk)
    model.forward = _step_counters_symbolic(compiled, forward, state)
    setattr(model.forward, OWNER, owner)
    generate = getattr(model.generate, UNCOMPILED, None) or model.generate
    inputs = StepInputs()
    model.generate = _loop_on_threads(generate, state, prefill, inputs)
    _INSTALLED.update((model.forward, model.generate))
    _spell_out_masks(model, state)
    _unstep(model)  # an earlier compile's stepping, on its own StepInputs
    if can_step(model, _ours):
        model.prepare_inputs_for_generation = stepping(model.prepare_inputs_for_generation,
                                                       inputs)
        _INSTALLED.add(model.prepare_inputs_for_generation)
    return model


def _unstep(model: Any) -> None:
    """Undo the stepping of ``model``'s ``prepare_inputs_for_generation`` (``fxpass.hf.inputs``)
    an earlier ``compile_for_generate`` installed. It only ever wraps the class's method
    (``can_step`` refuses an instance function of the caller's), so removing it restores that;
    a caller's wrapper of it is the caller's and stays."""
    mine = vars(model).get("prepare_inputs_for_generation")
    if mine is not None and _ours(mine):
        del model.prepare_inputs_for_generation


def _ours(fn: Any) -> bool:
    """Whether ``fn`` (a function on a model instance) is one ``compile_for_generate`` set."""
    try:
        return fn in _INSTALLED
    except TypeError:  # unhashable: not one of fxpass's functions
        return False


#: the forward, generate, input and mask functions ``compile_for_generate`` set on instances;
#: by identity, since ``functools.wraps`` copies a marker attribute onto a caller's wrapper
#: (accelerate's hooks wrap ``forward`` so; found in review)
_INSTALLED: weakref.WeakSet = weakref.WeakSet()


def _spell_out_masks(model: Any, state: _GenerateState) -> None:
    """Give the compiled prompt chunks HF's mask always (``prefill.spelled_out_masks``): one
    prefill graph for every prompt length instead of two. HF looks the mask function up on
    the model (``getattr(self, "create_masks_for_generate", ...)``); a model class with its
    own (Gemma 3, Bloom, PaliGemma, ...) keeps it, and compiles a first-chunk graph."""
    mine = vars(model).get("create_masks_for_generate")
    if getattr(type(model), "create_masks_for_generate", None) is not None or (
            mine is not None and not _ours(mine)):
        return
    create = spelled_out_masks(lambda: state.prefill)
    if create is not None:
        _INSTALLED.add(create)
        model.create_masks_for_generate = create


#: keys of torch.compile's ``options`` that torch itself consumes (not the backend's)
TORCH_OPTIONS = ("guard_filter_fn",)

#: the attribute of a ``compile_for_generate`` forward that holds the model's own forward
UNCOMPILED = "_fxpass_uncompiled"
#: ... and the record of the graphs it compiled (``fxpass.hf.steps.Owner``)
OWNER = "_fxpass_step_owner"


class _GenerateState(threading.local):
    """Per Python thread: torch's thread count for HF's generation loop between two forward
    calls, and the cache the forward last saw (``_step_counters_symbolic``).

    Why: HF's loop works on the logits between steps (a float32 copy, argmax, the logits
    processors). Over a real vocabulary (151,936 words) those ops are parallel, and torch's
    OpenMP workers then spin for milliseconds on the cores the next step's onnxruntime region
    needs. Qwen3 4x512 with that vocabulary: 20.2 ms per token, 13.6 with torch on one thread
    (``benchmarks.probes.loop_threads``). ``caller`` is the caller's count while a ``generate()``
    call is running, else None: forward calls outside ``generate()`` change nothing."""

    def __init__(self, threads: int | None, step_guards: str = "auto",
                 owner: Owner | None = None):
        # a thread-local (each Python thread runs __init__ anew): a forward or generate() on
        # another thread is not inside this one's generate() (found in review: its count leaked)
        self.threads = threads
        self.steps = StepGuards(step_guards, owner or Owner(None))
        self.caller: int | None = None
        #: the cache object last seen by the forward on this thread, and whether it counts
        #: tokens in a Python int (``_step_counters_symbolic``)
        self.cache: Callable[[], Any] = _NONE
        self.counters = True  # until a cache is seen
        #: inside generate(): the prompt length that runs compiled (``PrefillChunks``); None
        #: outside, where the forward compiles every length as torch.compile would
        self.prefill: int | None = None
        self.depth = 0  # generate() calls running on this thread (an assistant's nests)
        self.entered = 0  # forward calls begun in the running generate()
        self.forwards = 0  # forward calls that returned in the running generate()


def _loop_on_threads(generate: Callable, loop: _GenerateState, prefill: PrefillChunks,
                     inputs: StepInputs) -> Callable:
    """``generate`` that runs HF's loop on ``loop.threads`` torch threads (between the model's
    forward calls, which get the caller's count back) and restores the caller's count when it
    returns or raises; that steps the decode inputs of its own calls (``inputs``,
    ``fxpass.hf.inputs``); that tells the forward which prompt length runs compiled
    (``prefill.PrefillChunks``); and that runs a call again without chunks when HF's chunked
    prefill fails before its last prefill call returned."""

    @functools.wraps(generate, updated=())
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if loop.depth:  # nested in a generate() (an assistant's): the outer one's settings
            active = inputs.active
            if active:  # but HF's own inputs: the stepped ones are the outer call's
                inputs.active = False
            try:
                return generate(*args, **kwargs)
            finally:
                if active:
                    inputs.active = True
        model = getattr(generate, "__self__", None)
        # read per call: a config or mask function changed since compile counts
        steps_inputs = model is not None and can_step(model, _ours)
        loop.prefill, calls = prefill.arrange(model, args, kwargs)
        loop.depth, loop.entered, loop.forwards = loop.depth + 1, 0, 0
        # (only where steps can be trusted at all: the check reads every class function)
        loop.steps.start(model is not None and loop.steps.mode == "auto"
                         and quiet_call(model, args, kwargs, _ours))
        inputs.start()
        inputs.active = steps_inputs
        if loop.threads is not None:
            loop.caller = torch.get_num_threads()
        try:
            try:
                out = generate(*args, **kwargs)
            except Exception as e:
                # only inside a forward call of our chunked prefill; before any (a bad
                # argument) or after the prefill, the error is the caller's (found in review)
                if not calls or loop.entered == loop.forwards or loop.forwards >= calls:
                    raise
                del kwargs["prefill_chunk_size"]
                loop.prefill = None
                loop.steps.forget()
                inputs.start()
                out = generate(*args, **kwargs)  # raising too: the caller's error after all
                prefill.give_up(model, e)
                return out
            prefill.proven |= calls > 0
            return out
        finally:
            if loop.caller is not None:
                torch.set_num_threads(loop.caller)
            loop.caller = loop.prefill = None
            loop.depth -= 1
            inputs.active = False
            inputs.start()  # drop the last step's tensors
            loop.steps.forget()  # ... and the replay plans' (the cache buffers among them)

    setattr(wrapper, UNCOMPILED, generate)
    return wrapper


def _step_counters_symbolic(
    compiled: Callable, original: Callable, state: _GenerateState
) -> Callable:
    """``compiled`` (of ``original``) with HF's per-token cache counters traced as symbolic
    ints.

    The config is read only while Dynamo traces, but any call may trace, so it is set around
    the calls that can need it rather than for the whole process: other compiles keep their
    own setting. Only a cache that counts tokens in a Python int (:func:`_counts_in_python`,
    decided once per cache object, so once per ``generate()``) needs it; for the others the
    config stays untouched: torch's config module is Python code. ``benchmarks.probes.wrapper_cost``
    put writing it every step at 0.19 ms per token on cold caches once (2026-12-03 11:47) and
    within noise in three re-runs; the shipped wrapper measured -0.04 to +0.07 ms against a
    plain compiled forward over the four. Named and documented as
    ``original``; not ``functools.wraps(compiled)``, which copied torch.compile's own
    attributes onto it, so compiling it again failed.
    """
    config = torch.compiler.config

    @functools.wraps(original, updated=())
    def forward(*args: Any, **kwargs: Any) -> Any:
        state.entered += 1
        fn, counters = compiled, False
        if state.prefill is not None and runs_eagerly(state.prefill, args, kwargs):
            fn = original  # a prompt's tail, or a short prompt
        else:
            if state.prefill is not None:
                kwargs = dense(kwargs)
            cache = kwargs.get("past_key_values")
            if cache is None:  # nothing to look at: the always-safe path
                counters = True
            else:
                if state.cache() is not cache:  # a new cache: look at it once
                    state.cache, state.counters = _ref(cache), _counts_in_python(cache)
                counters = state.counters
        if counters:
            old = config.dynamic_sources
            config.dynamic_sources = f"{old},{STEP_COUNTERS}" if old else STEP_COUNTERS
        caller = state.caller
        if caller is not None:  # inside generate(): the step gets the caller's threads
            torch.set_num_threads(caller)
        try:
            eligible = fn is compiled and not counters and state.depth == 1
            out = state.steps.call(fn, args, kwargs, eligible)
            state.forwards += 1
            return out
        finally:
            if counters:
                config.dynamic_sources = old
            if caller is not None:  # and HF's loop until the next step gets loop.threads
                torch.set_num_threads(state.threads)

    # (``__wrapped__`` is ``original``: HF reads the forward's signature through it to decide
    # which arguments generate() passes, logits_to_keep among them)
    setattr(forward, UNCOMPILED, original)
    return forward


def _NONE() -> None:
    """A dead reference: no cache seen yet on this thread."""
    return None


def _ref(cache: Any) -> Callable[[], Any]:
    """A weak reference to ``cache`` (a strong one would keep its buffers alive after
    ``generate()``); none for an object that takes none, which is then looked at per call."""
    try:
        return weakref.ref(cache)
    except TypeError:
        return _NONE


def _counts_in_python(cache: Any) -> bool:
    """Whether ``cache`` keeps a per-token Python int that :data:`STEP_COUNTERS` names (HF's
    sliding-window layers). Anything that is not a recognisable HF cache counts as yes: the
    config is then set as before, which is always safe."""
    try:
        return any(STEP_COUNTER in vars(layer) for layer in cache.layers)
    except Exception:  # noqa: BLE001 - an unknown cache: keep the safe path
        return True


#: "0/1: c.n == 3  # ..." in Dynamo's guard failure: frame 0, an int-valued source (no calls:
#: not len(...) or .size()), an int (not 0.5)
_INT_GUARD = re.compile(
    r"^\s*-?\s*(?P<frame>\d+)/\d+:\s*(?P<src>[^\s()]+) == (?P<val>-?\d+)(?=\s*(?:#|$))", re.M
)


#: "0/2: tensor 'input_ids' size mismatch at index 1. expected 8, actual 9"
_SIZE_GUARD = re.compile(
    r"^\s*-?\s*(?P<frame>\d+)/\d+:\s*tensor '(?P<src>[^']+)' size mismatch at index "
    r"(?P<dim>\d+)\. expected (?P<old>\d+), actual (?P<new>\d+)", re.M
)


def _recompile_reason() -> str | None:
    try:
        from torch._dynamo.utils import get_metrics_context

        ctx = get_metrics_context()
        # the context keeps its last reason after the compile ends: a rebuild at run time (a
        # weight variant) read it again (found in review: a false "grows every call")
        if not ctx.in_progress():
            return None
        reason = ctx._metrics.get("recompile_reason")
    except Exception:  # noqa: BLE001 - a private API; unknown is the safe answer
        return None
    return reason if isinstance(reason, str) else None


def grown_input() -> tuple[str, str, int, int] | None:
    """(frame id, source, dim, new size) of an input that made Dynamo recompile the frame
    being compiled now by growing one element along a dim, else None: a sequence fed whole
    every call (a model ``generate()`` runs without any KV cache)."""
    reason = _recompile_reason()
    m = _SIZE_GUARD.search(reason) if reason else None
    if not m or int(m.group("new")) != int(m.group("old")) + 1:
        return None
    return m.group("frame"), m.group("src"), int(m.group("dim")), int(m.group("new"))


def recompiled_int() -> tuple[str, str] | None:
    """(frame id, source) of a Python int whose new value made Dynamo recompile the frame
    being compiled now (``0/1: c.n == 3`` in the guard failure), else None.

    Reads Dynamo's metrics context (private, so any failure means "unknown"): a backend has
    no public view of why it is being called again.
    """
    reason = _recompile_reason()
    m = _INT_GUARD.search(reason) if reason else None
    return (m.group("frame"), m.group("src")) if m else None


def warn_if_recompiling() -> str | None:
    """Warn once per source when the same cause has made Dynamo recompile a second time: a
    Python int, or an input grown by one along a dim.

    One recompile is normal (prefill, then decode; a new prompt length); a second on the same
    source is a value that changes per call.
    """
    grown = grown_input()
    found = (grown[0], f"{grown[1]}[{grown[2]}]") if grown else recompiled_int()
    if found is None:
        return None
    _recompiles[found] = _recompiles.get(found, 0) + 1
    if _recompiles[found] < 2:
        return None
    note = _note(*grown) if grown else _note_int(found[1])
    if _recompiles[found] == 2:  # once per source
        warnings.warn(f"fxpass: {note}", RecompileWarning, stacklevel=3)
    return note


def _note_int(src: str) -> str:
    if re.match(STEP_COUNTERS, src):
        fix = ("compile with fxpass.hf.generation.compile_for_generate(model, max_cache_len=N, "
               "device=...)")
        what = "HF's sliding-window cache counts tokens in a Python int"
    else:
        tail = re.escape(src.rsplit(".", 1)[-1])
        fix = (f'mark it dynamic, e.g. torch.compiler.config.dynamic_sources = r".*\\.{tail}$" '
               "(a regex over Dynamo's source names), or hold it in a tensor")
        what = "a Python int the graph reads changed"
    return (
        f"Dynamo recompiled because {src} changed ({what}); with dynamic=False each new value "
        f"is a new graph, and after torch._dynamo.config.recompile_limit the rest runs "
        f"eagerly. Fix: {fix}"
    )


def _note(frame: str, src: str, dim: int, size: int) -> str:
    return (
        f"Dynamo recompiled because {src} grew by one along dim {dim} (now {size}): an input "
        "that grows every call, such as a sequence fed whole at every token by a model that "
        "keeps no KV cache (transformers ignores cache_implementation for models without "
        "cache support). Each length is a new graph, and after "
        "torch._dynamo.config.recompile_limit the rest runs eagerly. Fix: feed it at a fixed "
        "length (padded), use a model with a static KV cache for generate(), or leave this "
        "model uncompiled"
    )

