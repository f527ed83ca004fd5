"""Decode steps that check only the guards telling compiled graphs apart, inside one
``generate()`` call.

Why: before every decode step Dynamo checks the frame's guards (614 guard managers on Qwen3
4 x 512: module attributes, config flags, the cache object, every parameter). Right after a
region has streamed the weights through the caches that check costs about 0.65 ms per token
(``benchmarks.probes.guards``), more than a package step spends outside its region. Yet inside
one ``generate()`` call nothing those guards watch changes from one decode step to the next:
HF's loop passes the same cache object, the same flags and tensors of the same shapes. So the
first decode steps run every guard; once a step has run the same graph as the step before it
under every guard, with nothing compiled, the following steps of that call run under torch's
``skip_guard_eval_unsafe`` stance: Dynamo then checks only the guards that tell the frame's
compiled graphs apart (the input tensors' dtypes, shapes and strides, not the parameters'; and
guards that have failed before), so prefill and decode graphs are still told apart.

When it applies, all of these hold, else every guard runs:

- the call is inside ``compile_for_generate``'s ``generate()`` (not nested in another);
- the model's cache keeps no per-token Python int (sliding-window layers change regime
  mid-call, which only a full check sees);
- the model's forward compiled without graph breaks (one frame: a guard that misses can only
  miss at its entry, before anything ran), and every graph of the forward's code object under
  an equal backend was compiled by this model's forward (:class:`Owner`; HF's forward wrapper
  is one code object shared by every model class, and under the stance another model's graph
  of the same shapes would pass);
- the step's arguments have the signature of the step before it (:func:`signature`), and that
  step ran every guard and compiled nothing;
- torch's stance is the default one, no compiled frame is running, and no Python thread other
  than the caller, fxpass's own workers and threads passed to :func:`ignore_thread` is alive:
  torch's stance is process-wide, so another thread's compiled calls would check fewer guards
  too. In Jupyter or a threaded server this does not apply.

fxpass's weight guard (``fxpass.jit.guarded``) runs on every step too, except on the trusted
steps of a *quiet* call (``fxpass.hf.quiet``): one that runs none of the caller's code between
two steps (callbacks, hooks, modes, a subclass's or a patched method), so the weights the step
before checked are the weights now; that saves reading every frozen weight's pointer and
version per token (about 80 us on Qwen3 4 x 512).

In a quiet call the steps after that skip Dynamo's frame too, once two steps with the same
signature have taught a plan: they call the step's compiled graph directly
(``fxpass.hf.replay``, which says when).

A trusted step whose guards miss anyway (torch refuses to compile under the stance) runs again
under every guard, and the rest of that call checks every guard.

What is not re-checked inside one call: a model attribute that a logits processor, a stopping
criterion or a streamer changes during the call (a weight they write is: such a call is not
quiet; ``fxpass.hf.quiet`` says what else it cannot see). ``compile_for_generate(...,
step_guards="all")`` checks every guard on every step.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from fxpass.hf.replay import Plan, watched
from fxpass.jit.held import HELD

#: ``step_guards`` values of ``compile_for_generate``
MODES = ("auto", "all")
#: forward calls run under the differentiating guards only ("trusted"), every guard ("full") or
#: as their compiled graph alone ("replayed", ``fxpass.hf.replay``), and trusted ones whose
#: guards missed ("missed", run again in full), in this process; tests assert on it
STEPS: Counter[str] = Counter()
#: threads whose names start so are fxpass's own (the backend's region compiles, the tiered
#: executor's second-tier builds, package preloading): they never run a torch.compile'd frame
OWN_THREADS = "fxpass-"
#: library threads known never to run one: tqdm's monitor (started by any progress bar, HF's
#: checkpoint writers among them) only wakes to refresh bars
KNOWN_THREADS = frozenset({"tqdm_monitor"})


def signature(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What must be equal between two forward calls for the second to run the first's graph:
    each tensor's dtype, shape, strides and device, each plain value itself, dicts, lists and
    tuples by their items (HF passes a fresh dict of masks per step), each other object by
    identity (the cache: the same object every step of one call)."""
    return tuple(_key(v) for v in args) + tuple((k, _key(v)) for k, v in sorted(kwargs.items()))


def _key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.shape, v.stride(), v.device, v.requires_grad)
    if v is None or isinstance(v, bool | int | float | str):
        return (type(v), v)
    if type(v) is dict:
        return (dict, tuple((k, _key(x)) for k, x in v.items()))
    if type(v) in (list, tuple):
        return (type(v), tuple(_key(x) for x in v))
    return (type(v), id(v))


#: threads the caller vouches for (:func:`ignore_thread`): ``threading`` threads by object
#: (an ident is reused once its thread ends), others by ident
_IGNORED_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_IGNORED_IDENTS: set[int] = set()


def ignore_thread(thread: threading.Thread | int) -> None:
    """Vouch that ``thread`` never calls a ``torch.compile``'d function nor writes a compiled
    model's weights, so its being alive does not keep decode steps on every guard (a server's
    I/O thread, a test runner's). A ``threading.Thread`` is vouched for while it lives; a bare
    ident (a thread started through ``_thread`` or native code, which ``threading`` does not
    list) for good, so a later thread given the same ident is vouched for too."""
    if isinstance(thread, int):
        _IGNORED_IDENTS.add(thread)
    else:
        _IGNORED_THREADS.add(thread)


def alone() -> bool:
    """Whether every Python thread but this one is an fxpass worker, tqdm's monitor or
    vouched for. Threads started below ``threading`` (``_thread``) count too: they are seen
    through ``sys._current_frames`` (a native thread only while it runs Python)."""
    frames = sys._current_frames()
    if len(frames) == 1:
        return True
    me = threading.get_ident()
    active = threading._active  # ident -> Thread, as threading.enumerate() reads it
    for i in frames:
        if i == me or i in _IGNORED_IDENTS:
            continue
        t = active.get(i)
        if t is None or not (t in _IGNORED_THREADS or t.name.startswith(OWN_THREADS)
                             or t.name in KNOWN_THREADS):
            return False
    return True


def compiles() -> tuple[int, int, int] | None:
    """Dynamo's counts of frames compiled, graphs compiled and graph breaks (its graph-break
    messages plus the resume functions it made: a data-dependent branch breaks the graph
    without a message) in this process (None: not readable, so trust nothing)."""
    c = _counters()
    if c is None:
        return None
    return (c["frames"]["total"], c["stats"]["unique_graphs"],
            sum(c["graph_break"].values()) + sum(c["resumes"].values()))


@functools.cache
def _counters() -> Any:
    try:
        from torch._dynamo.utils import counters

        return counters
    except ImportError:  # a private name; unknown means "do not skip"
        return None


def entries(code: Any) -> list[tuple[Any, Any]] | None:
    """(compiled code, backend) of each graph Dynamo holds for ``code`` (None: unreadable)."""
    ef = _eval_frame()
    try:
        return [(e.code, e.backend) for e in ef._debug_get_cache_entry_list(code)]
    except Exception:  # noqa: BLE001 - a private API; unknown means "do not skip"
        return None


def default_stance() -> bool:
    """Whether torch's compiler stance is the default one (no forced backend, no skipping
    already) and no compiled frame is running (torch refuses a stance change inside one):
    only then is switching it for one call and back a no-op for anything else."""
    ef = _eval_frame()
    if ef is None:
        return False
    st = ef._stance
    return (st.stance == "default" and st.backend is None and not st.skip_guard_eval_unsafe
            and _get_callback()() in (None, False))


@functools.cache
def _eval_frame() -> Any:
    """torch's eval_frame module when it has what this needs (private names), else None."""
    try:
        import torch._dynamo.eval_frame as ef

        ef._stance, ef._set_stance, ef.DynamoStance, ef._debug_get_cache_entry_list  # noqa: B018
        ef.innermost_backend  # noqa: B018
        _get_callback()
        return ef
    except (ImportError, AttributeError):
        return None


@functools.cache
def _get_callback() -> Callable[[], Any]:
    """torch's reader of the frame callback now set (set: a compiled frame is running)."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return get_eval_frame_callback


@functools.cache
def _trusted_stance() -> Any:
    return _eval_frame().DynamoStance("default", True, None)


def differentiating_guards(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                           hold: bool = False) -> Any:
    """``fn(*args, **kwargs)`` under torch's ``skip_guard_eval_unsafe`` stance (what
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` sets, without building a
    context manager per token); ``hold``: the weight guard is skipped too (a quiet call)."""
    ef = _eval_frame()
    prev = ef._set_stance(_trusted_stance())
    try:
        HELD.on = hold  # (taken by the forward's graph: ``fxpass.jit.held``)
        return fn(*args, **kwargs)
    finally:
        HELD.on = False
        ef._set_stance(prev)


def backend_of(compiled: Callable[..., Any]) -> Any:
    """The backend object ``torch.compile`` gave ``compiled``: what Dynamo stores with each
    graph it compiles through it (None: not readable from this torch's wrapper)."""
    try:
        cells = dict(zip(compiled.__code__.co_freevars, compiled.__closure__ or (), strict=True))
        return _eval_frame().innermost_backend(cells["callback"].cell_contents)
    except Exception:  # noqa: BLE001 - torch's private wrapper layout; learn it instead
        return None


class Owner:
    """One compiled forward, shared by every thread: its code object, the graphs of that code
    object it compiled (their compiled code objects, held so their ids stay theirs), its
    backend object and those of earlier compiles of the same model, and whether that record
    can no longer be vouched for (a graph break, an unreadable list).

    Dynamo looks a frame up only among the graphs of an equal backend (the same device and
    options), most recently used first; under the stance the first whose differentiating
    guards pass runs. With every such graph this forward's own, that is the graph the step
    before chose under every guard. A graph is this forward's when it was compiled with this
    forward's own backend object (``torch.compile`` makes one per call; another model compiled
    with equal options has an equal but distinct one), or with the backend of an earlier
    ``compile_for_generate`` of the same model (``previous``)."""

    def __init__(self, fn: Callable[..., Any], compiled: Callable[..., Any] | None = None,
                 previous: Owner | None = None):
        self.code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        self.kept: dict[int, Any] = dict(previous.kept) if previous else {}
        #: read off ``compiled`` (torch.compile's wrapper of ``fn``); None (another torch's
        #: wrapper layout) keeps every step on every guard
        self.backend: Any = backend_of(compiled) if compiled is not None else None
        self.earlier: list[Any] = ([previous.backend, *previous.earlier]
                                   if previous and previous.backend is not None else [])
        self.unsure = bool(previous and previous.unsure)
        self._checked: tuple[tuple[int, int, int] | None, bool] = (None, False)

    def sound(self, counts: tuple[int, int, int]) -> bool:
        """Whether every graph of an equal backend on the code object is this forward's.
        ``counts``: :func:`compiles` now; the answer is kept until they change (graphs are
        added only by compiles, and the counts only grow)."""
        if self.unsure or self.code is None or self.backend is None:
            return False
        if self._checked[0] != counts:
            found = entries(self.code)
            self._checked = (counts, found is not None and all(
                id(code) in self.kept for code, backend in found if backend == self.backend))
        return self._checked[1]

    def record(self, broke: bool) -> None:
        """After a call under every guard that compiled something (``broke``: Dynamo counted
        a graph break meanwhile): hold the graphs compiled with this forward's backends."""
        now = entries(self.code) if self.code is not None else None
        if now is None or broke:
            self.unsure = True
            return
        mine = (self.backend, *self.earlier)
        self.kept.update((id(code), code) for code, backend in now
                         if any(backend is b for b in mine if b is not None))


class StepGuards:
    """Per thread and ``generate()`` call: the signature of the last step that ran every
    guard and compiled nothing (None: the next step runs every guard)."""

    def __init__(self, mode: str, owner: Owner):
        if mode not in MODES:
            raise ValueError(f"step_guards must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.owner = owner
        self.last: tuple | None = None
        self.off = False  # a trusted step missed: every guard for the rest of the call
        self.hold = False  # a quiet call (``fxpass.hf.quiet``): trusted steps skip weights
        #: a quiet call's replayed steps (``fxpass.hf.replay``; only quiet calls learn them):
        #: per step signature, its plan (None: its steps gave none); and the last watched step
        #: (its signature, graph call and output) to learn one from
        self.plans: dict[tuple, Plan | None] = {}
        self.seen: tuple | None = None

    def start(self, hold: bool = False) -> None:
        """A new ``generate()`` call: its first steps run every guard. ``hold``: the call is
        quiet (``fxpass.hf.quiet``), so its trusted steps skip the weight guard too."""
        self.last, self.off, self.hold = None, False, hold
        self.plans, self.seen = {}, None

    def forget(self) -> None:
        """Drop the replay plans and the watched step: the tensors they hold (a cache's
        buffers) are freed with the call, and a retried call learns its own."""
        self.plans, self.seen = {}, None

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
             eligible: bool) -> Any:
        """Run ``fn(*args, **kwargs)``, under the differentiating guards when everything in
        the module docstring holds; ``eligible``: the caller's part (inside one generate(),
        the compiled forward, no per-token counters)."""
        if self.mode != "auto":
            STEPS["full"] += 1
            return fn(*args, **kwargs)
        if not eligible or self.off:  # every guard; still counts the graphs it compiles
            return self._full(fn, args, kwargs, None, compiles())
        sig = signature(args, kwargs)
        before = compiles()
        # everything a trusted step needs (the owner's check also rules out a graph break:
        # Python outside the one graph, which a replay would skip)
        trusted = (sig == self.last and before is not None and self.owner.sound(before)
                   and default_stance() and alone())
        plan = self.plans.get(sig) if trusted else None
        if plan is not None and plan.fits():
            STEPS["replayed"] += 1
            return plan(kwargs, self.hold)
        if trusted:
            try:
                if self._watches(sig):
                    out, seen = watched(differentiating_guards, (fn, args, kwargs, self.hold),
                                        {})
                    self._learn(sig, seen, out, kwargs)
                else:
                    out = differentiating_guards(fn, args, kwargs, self.hold)
            except RuntimeError as e:
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                # missed at the frame's entry (no graph breaks), before anything ran
                STEPS["missed"] += 1
                self.last, self.off = None, True
                return self._full(fn, args, kwargs, sig, compiles())
            STEPS["trusted"] += 1  # (torch compiles nothing under the stance: it raises)
            return out
        return self._full(fn, args, kwargs, sig, before)

    def _full(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
              sig: tuple | None, before: tuple[int, int, int] | None) -> Any:
        """A step under every guard; records the graphs it compiled as the owner's, and
        remembers its signature when it compiled nothing."""
        owner = self.owner
        watch = self._watches(sig) and before is not None and owner.sound(before)
        out, seen = watched(fn, args, kwargs) if watch else (fn(*args, **kwargs), None)
        after = compiles()
        STEPS["full"] += 1
        if before is None or after is None:
            owner.unsure, self.last = True, None
            return out
        if after != before:
            owner.record(after[2] != before[2])
        self.last = sig if after == before and not self.off else None
        if watch:
            self._learn(self.last, seen, out, kwargs)
        return out

    def _watches(self, sig: tuple | None) -> bool:
        """Whether a step of ``sig`` is watched to learn a plan: a quiet call's, of a
        signature no plan (or no-plan verdict) is known for yet."""
        return self.hold and sig is not None and sig not in self.plans

    def _learn(self, sig: tuple | None, seen: Any, out: Any, kwargs: dict[str, Any]) -> None:
        """After a watched step (``sig``: its signature, None when it compiled something):
        learn a replay plan from it and the step before when both ran one graph with the same
        signature; steps of a signature that gave none are not watched again in this call."""
        if sig is None or seen is None:
            self.seen = None
            return
        if self.seen is not None and self.seen[0] == sig:
            self.plans[sig] = Plan.learn(self.seen[1], (seen, out), kwargs)
            self.seen = None
            return
        self.seen = (sig, (seen, out))
