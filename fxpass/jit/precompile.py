"""``fxpass.precompile(model, device=...)``: a compiled model whose next process skips the trace.

Why: under ``torch.compile`` every new process traces the model again (Dynamo, then
AOTAutograd) before the cache can answer, and on a 4x512 decoder that trace is most of the
first call even when every region is a cache hit: a fleet replica starting from a warm Redis
was barely faster than a cold compile. Here the first call of an input signature looks up a
*precompiled entry*: torch's ahead-of-time capture (``aot_compile``) of the model, saved with
Dynamo's bytecode and guards and AOTAutograd's wrappers around an aten graph
(:class:`~fxpass.jit.outputcode.CompiledGraph`). A hit is deserialized and called; its regions
come from the artifact cache (plans and compiled regions, local or remote) as usual. A miss
traces once, stores the entry (and publishes it), and runs.

Keys and trust. An entry's key covers what the trace depends on and a guard may not check:
the model's class, parameter and buffer names, shapes and dtypes (not values), its config, the
input signature, the options and device identity, and the versions of Python, torch,
transformers and fxpass. On load, every source range the trace inlined is compared with the
source this process has, and Dynamo's serialized guards are checked at each call; a stale or
foreign entry is refused with the reason and traced again. Guards on globals and object
identities cannot be serialized (torch drops them too): a model whose forward reads mutable
module globals must use ``torch.compile``. An entry is pickled code, so the remote tier shares
it only when ``FXPASS_REMOTE_CACHE_SECRET`` signs the store's entries; without a secret entries
stay local.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import pickle
import sys
import types
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpass.jit.backend import _warn_once
from fxpass.jit.options import Options, from_options
from fxpass.jit.outputcode import CURRENT

log = logging.getLogger("fxpass.jit")

SUFFIX = ".pt2fn"
MAX_ENTRY_BYTES = 256 << 20  # decompressed: more is not an entry this code wrote
#: input signatures one ``Precompiled`` keeps loaded (the oldest dropped; its entry stays)
MAX_SIGNATURES = 64
FORMAT = "fxpass-precompiled-1"
#: where each entry came from in this process: "local_hit", "remote_hit", "traced",
#: "refused" (a stored entry that failed a check), "unshared" (remote tier without a secret),
#: "fallback" (the model could not be precompiled: it runs under torch.compile)
STATS: Counter[str] = Counter()


def _forward(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """What is traced: a module-level function, so the entry holds no closure of the caller."""
    return model(*args, **kwargs)


def _covered(g: Any) -> bool:
    """Whether the key and the source check stand in for a guard that cannot be saved: one on
    a class's own attributes (``type(...)``: its methods, whose source is checked) or on a
    module's class (``....__class__``: every submodule's class is in the key)."""
    return "type(" in g.name or (g.guard_type == "CLASS_MATCH" and g.name.endswith(".__class__"))


class Unsaved(Exception):
    """A guard the entry would have to drop and nothing else covers: not precompiled."""


def _serializable_guards(dropped: list[str]) -> Callable[[list], list[bool]]:
    """Dynamo's guard filter for a saved trace. Guards on object identities cannot be saved
    (ids do not survive a process): those on globals (module state) and on a class's own
    attributes and a module's class (:func:`_covered`: the key and the source check stand in)
    are dropped, as torch's own precompile drops them. Any other such guard (an
    instance's ``forward`` replaced by a hook, say) would leave the entry unchecked where
    it matters: it is listed in ``dropped``, and the model is not precompiled."""
    from torch._dynamo.guards import CheckFunctionManager

    bad = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)

    def keep(entries: list) -> list[bool]:
        out = []
        for g in entries:
            unsaved = g.guard_type in bad or bool(bad & set(g.derived_guard_types))
            if unsaved and not g.is_global and not _covered(g):
                dropped.append(f"{g.guard_type} on {g.name}")
            out.append(not (g.is_global or unsaved))
        return out
    return keep


def _leaf(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):  # dtype and device as objects: hashable, cheap per call
        return ("T", tuple(x.shape), x.dtype, x.device, x.stride(), x.requires_grad)
    if x is None or isinstance(x, bool | int | float | str):
        return (type(x).__name__, x)
    return ("O", f"{type(x).__module__}.{type(x).__qualname__}")


def _versions() -> dict[str, str]:
    from fxpass.jit.verify import tool_versions

    out = dict(tool_versions(), python=sys.version.split()[0])
    tf = sys.modules.get("transformers")
    if tf is not None:
        out["transformers"] = getattr(tf, "__version__", "?")
    return out


def model_doc(model: torch.nn.Module, opts: Options) -> dict:
    """The part of an entry's key that does not depend on the inputs."""
    first: dict[int, str] = {}
    weights = []
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        alias = first.setdefault(id(t), name)  # tied weights trace differently from copies
        weights.append([name, list(t.shape), str(t.dtype), t.requires_grad, alias])
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return {
        "format": FORMAT,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "modules": [[n, f"{type(m).__module__}.{type(m).__qualname__}"]
                    for n, m in model.named_modules()],
        "weights": weights,
        "config": to_json(use_diff=False) if callable(to_json) else _plain_config(config),
        "device": opts.get_device().identity(opts.dev),
        "options": opts.region_keyed(),
        "versions": _versions(),
    }


def _plain_config(config: Any) -> Any:
    """A config without ``to_json_string`` as data (its ``repr`` may hold an address, which
    would make every process's key differ)."""
    if config is None:
        return None
    fields = getattr(config, "__dict__", None)
    if isinstance(fields, dict):
        return {k: v if isinstance(v, bool | int | float | str | type(None)) else
                f"{type(v).__module__}.{type(v).__qualname__}" for k, v in sorted(fields.items())}
    return f"{type(config).__module__}.{type(config).__qualname__}"


def signature(args: tuple, kwargs: dict) -> tuple:
    """The inputs' part of the key, hashable: each leaf's kind, shape and dtype, and the tree."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (tuple(_leaf(x) for x in leaves), str(spec), torch.is_grad_enabled())


def _key(doc: dict, sig: tuple, training: bool) -> str:
    raw = json.dumps({**doc, "inputs": sig, "training": training}, sort_keys=True,
                     default=repr).encode()
    return hashlib.sha256(raw).hexdigest()


def _stale_sources(sources: list[tuple[str, int, int, str]]) -> str | None:
    """The first traced source range that differs in this process, or None."""
    from torch._dynamo.package import _hash_sourcelines

    for module, first, last, checksum in sources:
        try:
            now = _hash_sourcelines(importlib.import_module(module), first, last)
        except Exception as e:  # noqa: BLE001 - any failure to read the source refuses
            return f"source of {module} unreadable ({type(e).__name__}: {e})"
        if now != checksum:
            return f"source of {module} lines {first}-{last} changed since the trace"
    return None


def _dump(fn: Any) -> bytes:
    """An ``AOTCompiledFunction`` as entry bytes: the function, the globals its bytecode names
    (modules by name, other objects pickled by reference) and its source ranges."""
    import dataclasses

    art = fn._artifacts
    srcs = [(s.module, s.firstlineno, s.lastlineno, s.checksum)
            for s in art.source_info.inlined_sources]
    # the module texts torch keeps with each range are for display only: megabytes, dropped
    art.source_info = dataclasses.replace(art.source_info, inlined_sources={
        dataclasses.replace(s, content="") for s in art.source_info.inlined_sources})
    g = fn.fn.__globals__
    refs: dict[str, tuple[str, Any]] = {}
    for name in art.runtime_env.external_refs:
        if name == art.backend_id or name not in g:
            continue
        v = g[name]
        refs[name] = ("module", v.__name__) if isinstance(v, types.ModuleType) else (
            "object", pickle.dumps(v))
    data = type(fn).serialize(fn).serialized_data
    plain = pickle.dumps({"format": FORMAT, "fn": data, "refs": refs, "sources": srcs})
    if len(plain) > MAX_ENTRY_BYTES:  # every loader would refuse it
        raise Unsaved(f"an entry of {len(plain) >> 20} MiB, past {MAX_ENTRY_BYTES >> 20} MiB")
    # pickles of graphs and guards repeat themselves: 1.47 MB -> 97 kB for Qwen3 4 x 512
    return zlib.compress(plain, 6)


def _load(raw: bytes) -> tuple[Any | None, str | None]:
    """(the ``AOTCompiledFunction``, None), or (None, why it is refused)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    try:
        z = zlib.decompressobj()
        plain = z.decompress(raw, MAX_ENTRY_BYTES)
        if z.unconsumed_tail:
            return None, f"entry larger than {MAX_ENTRY_BYTES >> 20} MiB once decompressed"
        entry = pickle.loads(plain)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None, "not a precompiled fxpass entry of this format"
        if why := _stale_sources(entry["sources"]):
            return None, why
        glb = {n: importlib.import_module(v) if kind == "module" else pickle.loads(v)
               for n, (kind, v) in entry["refs"].items()}
        return AOTCompiledFunction.deserialize(entry["fn"], f_globals=glb), None
    except Exception as e:  # noqa: BLE001 - anything wrong with an entry refuses it
        return None, f"unloadable entry ({type(e).__name__}: {e})"


class Precompiled:
    """``model`` compiled for a device through precompiled entries, one per input signature.

    Call it as the model. The first call of a signature loads its entry (local cache, then the
    remote tier) or traces and stores it; later calls go straight to the loaded function, whose
    guards still run. A model that cannot be captured whole (graph breaks) or saved runs under
    ``torch.compile(model, backend="fxpass_<device>")`` instead, with a warning."""

    def __init__(self, model: torch.nn.Module, device: str, options: dict | None = None):
        self.model = model
        self.device = device
        self.options = dict(options or {})
        self.opts = from_options(self.options, device)
        self.fns: dict[tuple, Any] = {}  # input signature -> loaded function
        self._doc: dict | None = None  # the key's model part (model_doc), made once
        #: entry key -> where it came from ("local hit", "remote hit", "traced", with reasons)
        self.sources: dict[str, str] = {}
        self._fallback: Callable | None = None

    def _cache(self) -> Any:
        from fxpass.jit.cache import ArtifactCache

        if not self.opts.cache:
            return None
        cache = ArtifactCache(self.opts.cache_dir, remote=self.opts.remote_cache)
        if cache.remote is not None and cache.remote.secret is None:
            STATS["unshared"] += 1
            _warn_once("secret", "fxpass.precompile: precompiled entries are code, so the remote "
                       "cache shares them only when FXPASS_REMOTE_CACHE_SECRET signs its entries; "
                       "without it they stay in the local cache (regions are still shared)")
            return cache.local_only()
        return cache

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fallback is not None:
            return self._fallback(*args, **kwargs)
        if torch.is_grad_enabled() and (
                any(p.requires_grad for p in self.model.parameters()) or any(
                    isinstance(x, torch.Tensor) and x.requires_grad
                    for x in pytree.tree_leaves((args, kwargs)))):
            return self._needs_grad(*args, **kwargs)
        sig = (signature(args, kwargs), self.model.training)
        fn = self.fns.get(sig)
        if fn is None:
            if self._doc is None:
                self._doc = model_doc(self.model, self.opts)
            key = _key(self._doc, *sig)
            fn = self._entry(key, args, kwargs)
        # the entry's guards, checked once per call (torch's __call__ would bind the
        # signature with inspect and check them again)
        elif not fn._artifacts.guard_manager.check(
                {"model": self.model, "args": args, "kwargs": kwargs}):
            key = _key(self._doc, *sig)
            fn = self._trace(key, args, kwargs, "its guards failed on these inputs")
        if fn is None:
            return self._fallback(*args, **kwargs)  # type: ignore[misc]
        self.fns[sig] = fn
        if len(self.fns) > MAX_SIGNATURES:  # a long-running server's shapes: bounded
            del self.fns[next(iter(self.fns))]
        token = CURRENT.set(self.opts)  # a graph's first call compiles with these options
        try:
            return fn.fn(self.model, args, kwargs)
        finally:
            CURRENT.reset(token)

    def _needs_grad(self, *args: Any, **kwargs: Any) -> Any:
        """As ``torch.compile(backend="fxpass_<device>")`` does: the graphs are inference
        graphs, so a call that records gradients runs eagerly (gradients stay correct)."""
        msg = ("fxpass.precompile compiles inference graphs only; this call records "
               "gradients, so it runs eagerly. Wrap inference in torch.no_grad()")
        if self.opts.strict:
            raise RuntimeError(msg + " (strict=True)")
        _warn_once(f"grad:{id(self)}", msg)
        return self.model(*args, **kwargs)

    def _entry(self, key: str, args: tuple, kwargs: dict) -> Any:
        cache = self._cache()
        why = None
        raw = cache.get(key, SUFFIX) if cache is not None else None
        if raw is not None:
            fn, why = _load(raw)
            if fn is not None:
                where = "remote hit" if cache.origin.get(key) == "remote" else "local hit"
                if fn.guard_check(self.model, args, kwargs):
                    STATS[where.replace(" ", "_")] += 1
                    self.sources[key] = where
                    return fn
                why = "its guards failed on these inputs"
                return self._trace(key, args, kwargs, why, cache)
            STATS["refused"] += 1
            cache.discard(key, SUFFIX)
            log.warning("fxpass.precompile: stored entry %s refused: %s", key[:12], why)
        elif cache is not None and key in cache.refused:
            why = cache.refused[key]
        return self._trace(key, args, kwargs, why, cache)

    def _trace(self, key: str, args: tuple, kwargs: dict, why: str | None,
               cache: Any = None) -> Any:
        from fxpass.jit import outputcode

        dropped: list[str] = []
        try:
            traced = torch.compile(
                _forward, fullgraph=True, dynamic=False,
                backend=outputcode.backend(),
                options={"guard_filter_fn": _serializable_guards(dropped)},
            ).aot_compile(((self.model, args, kwargs), {}))
            if dropped:
                raise Unsaved(f"a guard that cannot be saved: {dropped[0][:160]}")
            raw = _dump(traced)
        except Exception as e:  # noqa: BLE001 - not precompilable: torch.compile instead
            msg = (f"fxpass.precompile: {type(self.model).__name__} cannot be precompiled "
                   f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); it runs under "
                   f"torch.compile(model, backend='fxpass_{self.device}') instead")
            if self.opts.strict:
                raise RuntimeError(msg + " (strict=True)") from e
            warnings.warn(msg, stacklevel=3)
            STATS["fallback"] += 1
            self._fallback = torch.compile(self.model, backend=f"fxpass_{self.device}",
                                           dynamic=False, options=self.options)
            return None
        cache = cache if cache is not None else self._cache()
        if cache is not None:
            cache.put(key, SUFFIX, raw)
        STATS["traced"] += 1
        self.sources[key] = f"traced ({why})" if why else "traced"
        return traced


def precompile(model: torch.nn.Module, device: str = "bpu",
               options: dict | None = None) -> Precompiled:
    """``model`` compiled for ``device`` so that a new process, on this machine or one sharing
    its remote cache, starts without tracing it again (:class:`Precompiled`). ``options`` are
    ``torch.compile``'s ``options`` for ``backend="fxpass_<device>"``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fxpass.precompile takes an nn.Module, got {type(model).__name__}; "
                        "wrap a function in a module, or use torch.compile for functions")
    return Precompiled(model, device, options)
