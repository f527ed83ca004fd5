"""The host executor's sessions: ``OrtExecutor`` runs a region's ONNX model in onnxruntime
(zero-copy in: torch CPU tensors are handed over as numpy views; zero-copy out: numpy results
become tensors without a copy), and ``TieredExecutor`` answers from an in-place-weights
session while the prepacked one builds in the background."""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from fxpass.backends.onnx.host.binding import Binding
from fxpass.device import CallDeclined
from fxpass.jit.runtime import as_numpy as _np
from fxpass.jit.runtime import as_tensor as _tensor
from fxpass.jit.runtime import malloc_trim as _malloc_trim

#: onnxruntime's pool threads stop spinning when a run ends (``session.force_spinning_stop``):
#: between two region calls the CPU runs torch ops and the other regions, and a pool left
#: spinning holds a core of this 2-core host: a mixture-of-experts forward (5 regions per graph)
#: took 188 against 18.8 ms with this (eager 17.4), a decode step 10.0 against 8.5 ms
#: (``python -m benchmarks.probes.spinning``, the only code that sets it False).
STOP_SPINNING = True

#: onnxruntime graph optimizers left off: its CPU SkipLayerNormalization kernel is slower than
#: the residual Add and LayerNormalization it fuses (BERT 4 x 256, 4 x 128 tokens: 10.5 -> 8.5
#: ms per region call without it); onnxscript's RMSNorm form (``host.prepare``) is untouched.
DISABLED_OPTIMIZERS = ["SkipLayerNormFusion"]

#: onnxruntime's memory pattern, off: with it a session's second run allocates the block its
#: first run planned, fresh pages to fault in, so each shape variant's second call ran ~8%
#: slower than its later ones; without it the second run reuses the arena and later runs are
#: unchanged (``python -m benchmarks.probes.second_run``, the only code that sets it True).
MEMORY_PATTERN = False

#: onnxruntime's optimization level for a region opened from its lowered model. ``ALL`` adds
#: the layout passes (NCHWc convolutions: a ResNet region at 2 x 128 x 128 ran in 1.94 instead
#: of 2.48 ms); its model is specific to this CPU, so the plan cache keys host entries by
#: ``cache.host_cpu_fingerprint``, and a package keeps the unoptimized model.
OPT_LEVEL = "ORT_ENABLE_ALL"

#: a fused model's extra output (``host/decode_attention.py``): False when its kernels cannot
#: answer this call exactly; the executor then declines the call (``RegionDeclined``)
OK_OUTPUT = "fxpass_ok"
#: a model output named ``IN_PLACE + input`` is that input updated (a KV cache with the new
#: row): once the graph around the region allows it (``grant``), the output is bound to the
#: input's own memory and the kernel writes the row there instead of copying the cache
IN_PLACE = "fxpass_inplace/"
#: model metadata: ``{IN_PLACE + input: [output, axis]}``, the output holding the row a kernel
#: writes into that input along ``axis`` at the position the program writes it itself
#: (``host.decode_attention.declare_rows``)
ROWS_KEY = "fxpass_inplace_rows"
#: torch -> numpy dtypes an input or output can be bound with by pointer
_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
              torch.int64: np.int64, torch.int32: np.int32, torch.int8: np.int8,
              torch.uint8: np.uint8, torch.bool: np.bool_}


class RegionDeclined(CallDeclined):
    """The region's fused model cannot answer this call exactly (its ``fxpass_ok`` is False,
    or its kernel refused the position it was given before running): the region answers this
    call eagerly (or raises, in a package) and tries the fused model again on the next."""


def ort_log_level() -> int:
    """onnxruntime's session log level: ``FXPASS_ORT_LOG_LEVEL`` (0 verbose, 1 info, 2 warning,
    3 error, 4 fatal), default 3: a clean compile prints nothing; set 2 to see the graph
    optimizer's notes."""
    import os

    raw = os.environ.get("FXPASS_ORT_LOG_LEVEL", "3")
    if raw.strip() not in {"0", "1", "2", "3", "4"}:
        raise ValueError(f"FXPASS_ORT_LOG_LEVEL={raw!r}: use 0 (verbose) to 4 (fatal); the "
                         "default, 3, shows errors only")
    return int(raw)


class OrtExecutor:
    kind = "onnxruntime"

    def __init__(
        self,
        model: bytes | str,
        input_names: list[str],
        threads: int | None = None,
        optimized_path: str | None = None,
        preoptimized: bool = False,
        shared: dict[str, torch.Tensor] | None = None,
        prepack: bool = True,
        optimized_weights: str | None = None,
        arena: bool = True,
        initializers: dict[str, torch.Tensor] | None = None,
    ):
        """``shared``: weights that are graph inputs of ``model`` (``host.prepare.shared_weights``)
        and the tensors that hold them, fed on every run as numpy views: onnxruntime reads
        them in place, and this executor keeps them alive. ``prepack=False`` stops
        onnxruntime from keeping a repacked copy of every GEMM weight. ``arena=False``: no
        memory arena (a first tier, ``TieredExecutor``, holds no buffers between runs).

        ``initializers``: initializers of ``model`` (declared with their dtype and shape,
        their data in a file onnxruntime never reads for them) taken from these tensors'
        memory instead (``add_initializer``), which this executor keeps alive. Onnxruntime
        prepacks from them, so a prepacked session holds its packed copy and nothing else:
        read from the file, each weight's pages sat beside its packed copy while it was
        packed (Qwen3 4 x 1024, 128 tokens: compile peak 1.32x -> 1.13x the weights,
        ``benchmarks.probes.compile_memory``).

        ``optimized_weights``: with ``optimized_path``, the file name (beside it) that takes the
        optimized model's weights as external data, prepacked GEMM weights included. A later
        process then loads the optimized model without repacking anything, mapping its weights
        from that file. (Only for models whose saved prepacked weights load,
        ``host.prepare.saves_prepacked``; the others are cached unoptimized,
        ``host.build.compile_ort``.)"""
        import onnxruntime as ort

        so = ort.SessionOptions()
        # errors still raise; warnings are the graph optimizer's notes on initializers it
        # folded away ("Removing initializer ..."), four per Qwen3 region, on every compile
        so.log_severity_level = ort_log_level()
        if threads:
            so.intra_op_num_threads = threads
        if STOP_SPINNING:
            so.add_session_config_entry("session.force_spinning_stop", "1")
        self.shared = dict(shared or {})
        self._static = {name: _feed(t, ort) for name, t in self.shared.items()}  # views
        if not prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        self._initializers = []  # (tensor, OrtValue over it): alive as long as the session
        for name, t in (initializers or {}).items():
            value = ort.OrtValue.ortvalue_from_numpy(t.numpy())
            so.add_initializer(name, value)
            self._initializers.append((t, value))
        so.enable_mem_pattern = MEMORY_PATTERN
        if not arena:  # a short-lived first tier: free its buffers after each run
            so.enable_cpu_mem_arena = False
        if preoptimized:  # already optimized offline (cached): skip the optimizer
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        else:
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVEL)
            if optimized_path:
                so.optimized_model_filepath = optimized_path
            if optimized_path and optimized_weights:
                for k, v in (
                    ("session.optimized_model_external_initializers_file_name", optimized_weights),
                    ("session.optimized_model_external_initializers_min_size_in_bytes", "4096"),
                    ("session.save_external_prepacked_constant_initializers", "1"),
                ):
                    so.add_session_config_entry(k, v)
        self.session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"],
                                            disabled_optimizers=DISABLED_OPTIMIZERS)
        # onnxruntime's Python session keeps the model bytes (weights included) for its whole
        # life, only to rebuild itself on a provider fallback (its own TODO); with the CPU
        # provider alone that never happens. Dropping them saves a copy of the weights.
        self.session._model_bytes = None
        self.input_names = input_names
        names = [o.name for o in self.session.get_outputs()]
        #: the outputs a call returns (the in-place ones are the inputs themselves)
        self.output_names = [n for n in names if not n.startswith(IN_PLACE)]
        #: where the model's ``OK_OUTPUT`` is among them (None: it has none)
        self._ok = self.output_names.index(OK_OUTPUT) if OK_OUTPUT in self.output_names else None
        #: in-place output -> the input index it updates (``IN_PLACE``), and those granted
        self._in_place = {n: input_names.index(n[len(IN_PLACE):]) for n in names
                          if n.startswith(IN_PLACE) and n[len(IN_PLACE):] in input_names}
        self._granted: dict[str, int] = {}
        self._granted_at: dict[int, list[str]] = {}
        self._allowed: set[int] | None = None  # what every caller granted (None: none asked)
        rows = json.loads(self.session.get_modelmeta().custom_metadata_map.get(ROWS_KEY, "{}"))
        #: place in what a call returns -> place in output_names (``OK_OUTPUT`` is popped)
        self._returned = [k for k, n in enumerate(self.output_names) if n != OK_OUTPUT]
        returned = [self.output_names[k] for k in self._returned]
        #: input -> (its row's place among the returned outputs, axis) (``in_place_rows``)
        self._rows = {self._in_place[n]: (returned.index(out), axis)
                      for n, (out, axis) in rows.items()
                      if n in self._in_place and out in returned}
        self._written: set[int] | None = None  # the rows every caller lets this leave out
        # onnxruntime leaves a bound buffer untouched for an output that is a graph input
        feeds = {i.name for i in self.session.get_inputs()} | {
            i.name for i in self.session.get_overridable_initializers()}
        self._bindable = not feeds & set(self.output_names)
        self._skip: dict[int, int] = {}  # ... of the inputs granted (``grant``)
        self._local = threading.local()  # a binding per thread (``_bound``)
        self._generation = 0

    def in_place_inputs(self) -> set[int]:
        """The inputs this model can update in place, if the caller allows it (``grant``)."""
        return set(self._in_place.values())

    def in_place_rows(self) -> dict[int, tuple[int, int]]:
        """input -> (output, axis): the output (its place in what a call returns) that holds
        the row the kernel writes into that input when granted, along ``axis``, at the
        position where the program writes that row back itself (``declare_rows``)."""
        return dict(self._rows)

    def grant(self, inputs: set[int], written: set[int] = frozenset()) -> None:
        """Allow writing into these inputs (``aot.writes.grant_in_place`` proved that the
        program writes them itself right after the call). ``written``: outputs (places in
        what a call returns; rows of ``in_place_rows``) the caller takes as None when the
        kernel wrote them, skipping its own write. An executor called from several places
        keeps what every one of them allowed."""
        allowed = set(inputs) if self._allowed is None else self._allowed & set(inputs)
        self._allowed = allowed
        self._written = set(written) if self._written is None else self._written & set(written)
        self._granted = {n: i for n, i in self._in_place.items() if i in allowed}
        at: dict[int, list[str]] = {}  # built whole, then published: calls may be running
        for n, i in self._granted.items():
            at.setdefault(i, []).append(n)
        self._granted_at = at  # input place -> the in-place outputs bound to its memory
        #: output (place in output_names) -> the input its kernel wrote it into
        self._skip = {self._returned[j]: i for i, (j, _) in self._rows.items()
                      if i in allowed and j in self._written}
        self._generation += 1  # every thread's binding is made again

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        try:
            outs = self._bound(tensors) if self._granted else None
            if outs is None:
                feeds = {name: _np(t) for name, t in zip(self.input_names, tensors, strict=True)}
                if self._static:
                    feeds.update(self._static)
                outs = [_tensor(o) for o in self.session.run(self.output_names, feeds)]
        except Exception as e:
            # the fused decode attention's position past the cache, refused by the kernel
            # before it wrote anything (``host.decode_attention.position``): onnxruntime
            # names the position or the length it implies
            if self._ok is not None and "GroupQueryAttention" in str(e) and (
                    "seqlens_k" in str(e) or "total_sequence_length" in str(e)):
                from fxpass.backends.onnx.host.decode_attention import DECLINED

                raise RegionDeclined(DECLINED) from e
            raise
        if self._ok is not None and not outs.pop(self._ok):
            from fxpass.backends.onnx.host.decode_attention import DECLINED

            raise RegionDeclined(DECLINED)
        return tuple(outs)

    def _bound(self, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None] | None:
        """One run through this thread's IOBinding: every input bound by pointer (rebound only
        when its address, shape or dtype changed), the granted outputs bound to their inputs'
        memory. None, without running, for an input of a dtype numpy cannot bind (BF16):
        ``session.run`` takes it. A strided input is bound as a contiguous copy: the kernel's
        in-place write then lands in the copy, and the program's own write-back still updates
        the input.

        A row the kernel wrote into a granted input, which the caller agreed to take as None
        (``grant``'s ``written``), is returned as None: the kernel wrote it, the caller skips
        its own write. (The first call with new input shapes returns it, as below.)

        The other outputs are written into new tensors bound before the run, so a call returns
        them as they are (no copy). Their shapes are learned from the first run with these
        input shapes and dtypes, which lets onnxruntime allocate them and copies them out; a
        change of an input's shape or dtype learns them again. Why: taking onnxruntime's own
        buffers (``get_outputs``) and copying each out cost about 0.1 ms of an int4 decode step
        of Qwen3 4 x 512 (nine outputs: eight cache rows and the logits); an allocation and a
        bind per output cost half as much and copy nothing. Onnxruntime checks a bound
        buffer's shape against the one it computes and raises on a mismatch (an output whose
        shape follows input values): the call raises (a kernel may have written an input in
        place, so it is not run twice; the region's caller falls back) and that binding lets
        onnxruntime allocate from then on."""
        st = self._local
        b = getattr(st, "binding", None)
        if b is None or st.generation != self._generation:
            b = st.binding = Binding(self.session)
            st.last, st.shapes, st.outs = {}, {}, None  # (st.kept: set when outs are learned)
            st.generation = self._generation
            for name, value in self._static.items():  # numpy views, or BF16 OrtValues
                if isinstance(value, np.ndarray):
                    b.py.bind_cpu_input(name, value)
                else:
                    b.py.bind_ortvalue_input(name, value)
            for name in self.output_names:  # first: get_outputs() lists them in this order
                b.py.bind_output(name, "cpu")
        last, shapes = st.last, st.shapes
        keep = []  # contiguous copies of non-contiguous inputs, alive through the run
        copied = set()  # ... their places: a row written into a copy is returned after all
        for k, (name, t) in enumerate(zip(self.input_names, tensors, strict=True)):
            if not t.is_contiguous():
                t = t.contiguous()
                keep.append(t)
                copied.add(k)
            key = (t.data_ptr(), t.shape, t.dtype)
            if last.get(name) == key:
                continue
            if t.dtype not in _NP_DTYPES:
                return None
            shape = list(t.shape)
            if shapes.get(name) != key[1:]:
                shapes[name] = key[1:]
                if st.outs:  # other output shapes, maybe: learn them again
                    st.outs = None  # (False stays: that binding never binds its outputs)
            b.bind_input(name, b.cpu, _NP_DTYPES[t.dtype], shape, t.data_ptr())
            last[name] = None if keep and keep[-1] is t else key  # a copy: rebind next time
            for out in self._granted_at.get(k, ()):
                b.bind_output(out, b.cpu, _NP_DTYPES[t.dtype], shape, t.data_ptr())
        if st.outs:
            # a row bound to a tensor returned by an earlier call (its input was copied
            # then): onnxruntime allocates it again, or this run would write into that tensor
            for name in st.lent:
                b.py.bind_output(name, "cpu")
            outs = list(st.template)  # the flag's buffer; None for rows written in place
            fresh = self._fresh(st, copied) if copied else st.fresh
            for k, name, shape, dtype, np_dtype in fresh:
                o = outs[k] = torch.empty(shape, dtype=dtype)
                b.bind_output(name, b.cpu, np_dtype, shape, o.data_ptr())
            st.lent = [name for k, name, *_ in fresh if k in self._skip] if copied else []
            try:
                b.run()
            except Exception as e:
                if "pre-allocated" in str(e):  # a shape that follows values: never bind again
                    st.outs = False
                raise
            return outs
        for name in self.output_names:  # onnxruntime allocates (an output it allocated for
            b.py.bind_output(name, "cpu")  # the last run would be taken as bound otherwise)
        b.run()
        values = b.py.get_outputs()[:len(self.output_names)]  # bound first, in model order
        outs = [torch.from_numpy(v.numpy()).clone() for v in values]
        if st.outs is None:
            st.outs = [(o.shape, o.dtype) for o in outs] if self._bindable and all(
                o.dtype in _NP_DTYPES and o.numel() for o in outs) else False
            st.kept = {}
            if st.outs and self._ok is not None:  # read and dropped by every call: bound once
                ok = st.kept[self._ok] = torch.empty(outs[self._ok].shape, dtype=torch.bool)
                b.bind_output(OK_OUTPUT, b.cpu, np.bool_, list(ok.shape), ok.data_ptr())
            if st.outs:
                st.template = [st.kept.get(k) for k in range(len(st.outs))]
                st.fresh = self._fresh(st, set())
                st.lent = []
        return outs

    def _fresh(self, st: Any, copied: set[int]) -> list[tuple[int, str, list[int], Any, Any]]:
        """The outputs a bound call writes into new tensors: (place, name, shape, dtype, numpy
        dtype). Not the check's flag (one buffer), nor a row the kernel wrote into its granted
        input, unless that input was bound as a contiguous copy (``copied``)."""
        skip = self._skip
        return [(k, name, list(shape), dtype, _NP_DTYPES[dtype]) for k, (name, (shape, dtype))
                in enumerate(zip(self.output_names, st.outs, strict=True))
                if k not in st.kept and not (k in skip and skip[k] not in copied)]


class TieredExecutor:
    """A region's host executor in two tiers: a session that opens in milliseconds runs the
    first calls while the faster one is built on a background thread, then that one runs.

    Why: onnxruntime prepacks every GEMM weight when a session opens (a copy in its kernels' layout;
    0.3 s for the 283 MB of a Qwen3 4 x 1024 prefill region, warm or cold), and the prepacked GEMMs
    are what make a region with more than one row fast (1.78x at 8 rows, 1.41x at 32, 1.10x at 128:
    ``python -m benchmarks.probes.tiering``). A session that reads the weights in place
    (``host.prepare.shared_weights``, prepacking off) opens at once and gives the same answers, so
    the caller waits for neither the prepacking nor the cache write; the first calls run a little
    slower, then the prepacked session takes over (JIT-style tiering).

    The build starts when the first call has returned (that call gets the cores, and its
    buffers are freed before the prepacking allocates; the compile's peak is the untiered
    path's, 1.13x the weights at 128 tokens, ``benchmarks.probes.compile_memory --untiered``),
    on one shared worker thread (one build at a time: a 2-core host also
    runs the model), which the interpreter joins at exit, so a short-lived process still
    stores its cache entry. If the build fails, the first tier keeps running (same results,
    slower) and a ``RuntimeWarning`` says why."""

    kind = "onnxruntime"

    def __init__(self, first: Any, build: Callable[[], Any], name: str = "region"):
        self._ex = first
        self._built: Any = None  # the second tier, once it runs
        self.name = name
        self._lock = threading.Lock()
        self._build: Callable[[], Any] | None = build
        self._future: Future | None = None
        self._grants: list[set[int]] = []  # every grant so far, for the second tier

    @property
    def current(self) -> Any:
        """The executor that runs the next call (the second tier once it is built)."""
        if self._future is not None and self._future.done():
            self._swap()
        return self._ex

    @property
    def first_tier(self) -> bool:
        """Whether the next call still runs on the first tier (its build queued or running,
        or failed: then for good)."""
        return self.current is not self._built

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.current(*tensors)
        if self._build is not None:
            self.start()
        return out

    def start(self) -> None:
        """Queue the second tier's build (done by the first call; idempotent)."""
        with self._lock:
            build, self._build = self._build, None
            if build is not None:
                self._future = _tier_pool().submit(_trimmed, build)

    def wait(self) -> Any:
        """Build the second tier now if not yet queued, block until it is built (or failed),
        and return the executor in use."""
        self.start()
        f = self._future
        if f is not None:
            f.exception()  # waits; the outcome is taken (and warned about) by _swap
            self._swap()
        return self._ex

    def _swap(self) -> None:
        with self._lock:
            f, self._future = self._future, None
        if f is None:
            return
        try:
            ex = f.result()
        except Exception as e:  # noqa: BLE001 - the first tier still gives the right answer
            msg = (f"fxpass_bpu region {self.name} keeps its in-place-weights session (slower "
                   f"above one row): building the prepacked one failed: {type(e).__name__}: {e}")
            try:
                warnings.warn(msg, RuntimeWarning, stacklevel=4)
            except Exception:  # noqa: BLE001 - warnings as errors must not fail a good call
                logging.getLogger("fxpass").warning(msg)
            return
        if ex is not None:
            for inputs, written in self._grants:
                _grant(ex, inputs, written)
            self._ex = self._built = ex

    def in_place_inputs(self) -> set[int]:
        """The inputs the tiers can update in place (``OrtExecutor.in_place_inputs``)."""
        return getattr(self._ex, "in_place_inputs", set)()

    def in_place_rows(self) -> dict[int, tuple[int, int]]:
        """The rows the tiers write in place (``OrtExecutor.in_place_rows``): one model."""
        return getattr(self._ex, "in_place_rows", dict)()

    def grant(self, inputs: set[int], written: set[int] = frozenset()) -> None:
        """``OrtExecutor.grant`` for the tier running now, and replayed on the one to come."""
        self._grants.append((set(inputs), set(written)))
        _grant(self._ex, inputs, written)


def _grant(ex: Any, inputs: set[int], written: set[int]) -> None:
    """``ex.grant``: with ``written`` for an executor that declares rows (``in_place_rows``)."""
    if hasattr(ex, "in_place_rows"):
        ex.grant(set(inputs), set(written))
    elif hasattr(ex, "grant"):
        ex.grant(set(inputs))


def _trimmed(build: Callable[[], Any]) -> Any:
    """``build()`` after handing the heap's free memory back to the OS. Why: the build runs on
    another thread, so glibc gives its allocations another malloc arena, and what the first
    call freed in the caller's arena would stay resident beside them (scratch runs of
    ``benchmarks.probes.compile_memory --tokens 128``: peak 1.35x -> 1.32x the weights in fp32,
    3.14x -> 2.76x in bf16)."""
    _malloc_trim()
    return build()


_TIER_POOL: ThreadPoolExecutor | None = None


_TIER_LOCK = threading.Lock()


def _tier_pool() -> ThreadPoolExecutor:
    global _TIER_POOL
    with _TIER_LOCK:
        if _TIER_POOL is None:
            _TIER_POOL = ThreadPoolExecutor(1, thread_name_prefix="fxpass-tier")
        return _TIER_POOL


def settle() -> None:
    """Wait until every second-tier session queued so far is built (and its cache entry
    written). Benchmarks call it before timing steady state; nothing else needs to."""
    with _TIER_LOCK:
        pool = _TIER_POOL
    if pool is not None:
        pool.submit(lambda: None).result()  # one worker: runs after everything queued


def _feed(t: torch.Tensor, ort: Any) -> Any:
    """A weight fed in place: a numpy view, or for BF16 (no numpy dtype) an OrtValue over the
    tensor's own memory (its bits as int16, typed BFLOAT16; onnxruntime copies nothing)."""
    if t.dtype == torch.bfloat16:
        import onnx

        if not t.is_contiguous():  # an OrtValue reads the pointer as row-major
            raise ValueError("a BF16 weight fed in place must be contiguous")
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            t.view(torch.int16).numpy(), onnx.TensorProto.BFLOAT16)
    return t.numpy()
