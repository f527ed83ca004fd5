"""``compile_for_encoder(model, buckets=...)``: an HF encoder served at any length through a
handful of static variants, padding each call up to its bucket.

Why: a static-shape device compiles one program per input shape. Served lengths vary (every
sentence is its own), so even with bounded variants (``shapes.py``) a busy encoder would
compile and evict without end. Padding each call up to the next of a few bucket lengths
keeps the variants to the buckets.

Padding must not change a value, so it is offered where it provably does not, for HF
encoders (BERT, RoBERTa, DistilBERT, and models of their shape):

- ``input_ids`` are padded with the model's pad token, ``attention_mask`` with 0 (created as
  all ones first when the caller gave none), ``token_type_ids`` with 0. A real token never
  attends to a padded one (its key is masked: HF adds the dtype's minimum to its score, whose
  softmax weight is exactly 0), and position ids are those of the real tokens (absolute, from
  0; RoBERTa's are computed from non-pad tokens).
- ``batch`` buckets add rows of pad tokens (mask 1: a fully masked row is slow on the host's
  attention kernel); rows never mix, and those rows are cut from every output.
- Outputs are sliced back: every tensor whose sequence (or batch) dimension is the padded
  size, attentions in both their last two dimensions.

A length past the largest bucket is compiled at its exact size, with one warning; a batch past
the largest ``batch`` bucket runs in chunks of that many rows (:func:`by_rows`).
The compiled forward uses ``dynamic=True``: one Dynamo graph, a static variant per bucket.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # a loaded bucket package runs EncoderRunner: options.py imports the lowering
    from fxpass.jit.options import Options

DIMS = {"seq": 1, "batch": 0}
_PADDED = ("input_ids", "attention_mask", "token_type_ids")


def check_buckets(buckets: dict[str, Sequence[int]]) -> dict[str, list[int]]:
    """``{"seq": [...], "batch": [...]}`` validated: known dimensions, positive and strictly
    increasing sizes; else a ValueError naming the entry and the fix."""
    if not isinstance(buckets, dict) or not buckets:
        raise ValueError(f"buckets must be a dict like {{'seq': [32, 64, 128]}}, got {buckets!r}")
    out = {}
    for dim, sizes in buckets.items():
        if dim not in DIMS:
            raise ValueError(
                f"bucket dimension {dim!r} is not an input dimension of an HF encoder; use "
                f"'seq' (tokens per row) or 'batch' (rows), e.g. {{'seq': [32, 64, 128]}}")
        sizes = list(sizes) if isinstance(sizes, (list, tuple)) else sizes
        if (not isinstance(sizes, list) or not sizes
                or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0
                           for s in sizes)):
            raise ValueError(f"buckets[{dim!r}] must be a non-empty list of positive ints, "
                             f"got {sizes!r}")
        if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"buckets[{dim!r}] = {sizes} is not increasing; list each size "
                             f"once, smallest first, e.g. {sorted(set(sizes))}")
        out[dim] = sizes
    return out


def _pad_id(model: torch.nn.Module) -> int:
    if "input_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__}.forward takes no input_ids: bucket padding is "
                         "for HF text encoders (BERT, RoBERTa, DistilBERT, ...)")
    return getattr(getattr(model, "config", None), "pad_token_id", None) or 0


#: dtype -> (rtol, atol) within which padded and unpadded eager outputs count as equal: the
#: same math at another shape (other kernels, other summation orders), nothing more
_PAD_TOL = {torch.float32: (1e-3, 1e-4), torch.float64: (1e-6, 1e-8)}


def check_padding(model: torch.nn.Module, spec: dict[str, list[int]], pad_id: int,
                  who: str) -> None:
    """Refuse a model whose outputs at real tokens change when its inputs are padded as the
    buckets pad them: run eagerly once as given and once padded (then cut back), on a probe
    of two rows (one with masked tokens) shorter than a bucket.

    Why: padding is exact only for encoders whose real tokens cannot see pad tokens (module
    doc). ConvBERT's convolution over the sequence and Funnel's pooling do see them: buckets
    gave their real tokens 0.026 and 1.1 off eager, with no error. Outputs at tokens the
    caller masked are not compared (:func:`_at_real_tokens`). A model the probe cannot run
    is compiled unchecked, with a warning."""
    cfg = getattr(model, "config", None)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0) or 100
    seq = spec.get("seq", [16])
    n = _padded(seq, middle=True) or seq[0]  # several tokens padded
    rows = _padded(spec.get("batch", []), middle=False) or 2  # a row padded, if any is
    g = torch.Generator().manual_seed(0)
    kw = {"input_ids": torch.randint(min(3, vocab - 1), vocab, (rows, n), generator=g),
          "attention_mask": torch.ones(rows, n, dtype=torch.long)}
    kw["attention_mask"][-1, n - max(1, n // 4):] = 0 if n > 1 else 1
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        kw["token_type_ids"] = torch.zeros(rows, n, dtype=torch.long)

    def padded(kw: dict[str, Any]) -> Any:
        kw, size, _ = pad_inputs(kw, spec, pad_id)
        return _slice(model(**kw), size)

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            want, got = model(**kw), by_rows(padded, kw, spec)
    except Exception as e:  # noqa: BLE001 - the probe's inputs, not the caller's: warn
        warnings.warn(f"{who}: could not check that padding leaves {type(model).__name__}'s "
                      f"outputs unchanged ({type(e).__name__}: {e}); buckets are exact only "
                      "for encoders whose real tokens never see a pad token", stacklevel=3)
        return
    finally:
        model.train(was)
    from torch.utils._pytree import tree_leaves

    real = kw["attention_mask"].bool()
    for a, b in zip(tree_leaves(got), tree_leaves(want), strict=False):
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
            continue
        if a.shape == b.shape:
            a, b = _at_real_tokens(a, real), _at_real_tokens(b, real)
        rtol, atol = _PAD_TOL.get(b.dtype, (3e-2, 3e-2))
        if a.shape != b.shape:
            why = (f"an output is {tuple(a.shape)} padded against eager's {tuple(b.shape)}: "
                   "its token dimension is one the buckets cannot cut back (XLNet's "
                   "time-major memories, say)")
        elif not torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol):
            why = (f"its real tokens are {(a.float() - b.float()).abs().max().item():.3g} off "
                   "eager: they see the pad tokens (a convolution or pooling over the "
                   "sequence, say)")
        else:
            continue
        raise ValueError(
            f"{who}: padding changes {type(model).__name__}'s outputs (padding {n} tokens "
            f"to {_pick(seq, n)}): {why}, so buckets would give wrong answers. Fix: serve it "
            "without buckets: torch.compile(model, backend=\"fxpass_ort\") compiles one "
            "variant per shape (options max_shape_variants bounds them)")


def _padded(sizes: list[int], middle: bool) -> int | None:
    """The first size that ``sizes`` pad up to a bucket (``middle``: halfway into that
    bucket rather than just past the one below), or None when none is padded."""
    low = 0
    for high in sizes:
        m = (low + 1 + high) // 2 if middle else low + 1
        if m < high:
            return m
        low = high
    return None


def _at_real_tokens(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``x``'s values at the tokens the mask ``real`` (rows, tokens) keeps: per-token
    outputs at real tokens, attentions between real tokens, anything else whole. What a
    model puts at a token its caller masked is not an answer (DeBERTa-v2's there differ with
    the padded length; its real tokens do not)."""
    rows, n = real.shape
    if x.dim() >= 2 and tuple(x.shape[:2]) == (rows, n):
        return x[real]
    if x.dim() == 4 and x.shape[0] == rows and tuple(x.shape[-2:]) == (n, n):
        return x[(real[:, None, :, None] & real[:, None, None, :]).expand(x.shape)]
    return x


def _pick(sizes: list[int], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def _pad(t: torch.Tensor, dim: int, to: int, value: int) -> torch.Tensor:
    if t.shape[dim] == to:
        return t
    shape = list(t.shape)
    shape[dim] = to - t.shape[dim]
    return torch.cat([t, t.new_full(shape, value)], dim)


def _slice(x: Any, size: dict[int, tuple[int, int]]) -> Any:
    """Every tensor in ``x`` cut back from padded to real size in the padded dimensions
    (dim -> (padded, real)); for square trailing dims (attentions) both are cut."""
    if isinstance(x, torch.Tensor):
        for dim, (padded, real) in size.items():
            if dim == 1 and x.dim() >= 4 and x.shape[-1] == padded and x.shape[-2] == padded:
                x = x[..., :real, :real]  # attention probabilities (batch, heads, q, k)
            elif x.shape[dim:dim + 1] == (padded,) and (dim == 0 or x.dim() >= 3):
                # rows; or tokens of a (batch, tokens, ...) tensor: a pooled (batch, hidden)
                # output whose hidden size happens to equal the bucket is not cut
                x = x.narrow(dim, 0, real)
        return x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_slice(v, size) for v in x)
    if isinstance(x, list):
        return [_slice(v, size) for v in x]
    if hasattr(x, "keys") and hasattr(x, "__setitem__"):  # HF ModelOutput (an OrderedDict)
        for k in list(x.keys()):
            x[k] = _slice(x[k], size)
        return x
    return x


def _fill(key: str, dim: int, pad_id: int) -> int:
    """The value padding ``key`` along ``dim``: pad tokens; mask 0 for padded tokens of a real
    row. A padded *row* gets mask 1: its outputs are cut away, and a row whose every key is
    masked sends onnxruntime's Attention kernel down a slow path (BERT 4 x 256, batch 4 x 128
    with three such rows: 3 ms more per call, attention 2.6x slower)."""
    if key == "input_ids":
        return pad_id
    return 1 if key == "attention_mask" and dim == DIMS["batch"] else 0


def pad_inputs(
    kw: dict[str, Any], spec: dict[str, list[int]], pad_id: int
) -> tuple[dict[str, Any], dict[int, tuple[int, int]], dict[str, int]]:
    """``kw`` (``input_ids`` and its masks) padded up to the buckets (module doc): the padded
    inputs, dim -> (padded, real) for what was padded, and the sizes past every bucket."""
    kw = dict(kw)
    ids = kw["input_ids"]
    if kw.get("attention_mask") is None:
        kw["attention_mask"] = torch.ones_like(ids)
    size, over = {}, {}
    for name, dim in DIMS.items():
        if name not in spec:
            continue
        real = ids.shape[dim]
        to = _pick(spec[name], real)
        if to is None:
            over[name] = real
        elif to != real:
            size[dim] = (to, real)
            for key in _PADDED:
                t = kw.get(key)
                if isinstance(t, torch.Tensor):
                    kw[key] = _pad(t, dim, to, _fill(key, dim, pad_id))
    for key in _PADDED:  # one layout per bucket: an expanded mask would be a new graph
        if isinstance(kw.get(key), torch.Tensor):
            kw[key] = kw[key].contiguous()
    return kw, size, over


def by_rows(call: Callable[[dict[str, Any]], Any], kw: dict[str, Any],
            spec: dict[str, list[int]]) -> Any:
    """``call(kw)``; a batch past the largest ``batch`` bucket runs in chunks of that many rows
    (the last one padded to its bucket), the outputs joined along the rows.

    Why: rows never mix in an encoder, so a chunked batch gives each row what the whole batch
    would, through the variants already compiled. (A longer *sequence* cannot be split.) With
    ``"batch": [1]`` every row runs alone: no padded rows are computed, at one call per row."""
    top = spec.get("batch", [0])[-1]
    rows = kw["input_ids"].shape[0]
    if not top or rows <= top:
        return call(kw)
    parts = [call({k: v[i:i + top] if _rowwise(v, rows) else v for k, v in kw.items()})
             for i in range(0, rows, top)]
    return _join(parts, rows, top)


def _rowwise(v: Any, rows: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows


def _join(parts: list[Any], rows: int, top: int) -> Any:
    """Chunk outputs joined along dim 0 (tensors, tuples, lists, HF ModelOutputs)."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(
                f"a batch of {rows} rows runs in chunks of the largest batch bucket ({top}), "
                "but the model returned a value with no row dimension (a loss?), which chunks "
                f"cannot be joined into; add a batch bucket >= {rows}, or drop the labels")
        return torch.cat(parts, 0)
    if isinstance(first, tuple) and not hasattr(first, "_fields"):
        return tuple(_join(list(p), rows, top) for p in zip(*parts, strict=True))
    if isinstance(first, list):
        return [_join(list(p), rows, top) for p in zip(*parts, strict=True)]
    if hasattr(first, "keys") and hasattr(first, "__setitem__"):  # HF ModelOutput
        for k in list(first.keys()):
            first[k] = _join([p[k] for p in parts], rows, top)
        return first
    return first


def compile_for_encoder(
    model: torch.nn.Module,
    *,
    buckets: dict[str, Sequence[int]],
    options: dict[str, Any] | None = None,
    device: Any = None,
) -> torch.nn.Module:
    """Compile ``model.forward`` with ``backend=f"fxpass_{device}"`` behind bucket padding
    (module doc); returns ``model`` (its ``forward`` replaced), which keeps its signature."""
    from fxpass.jit.options import from_options

    opts = from_options(options, device)
    spec = check_buckets(buckets)
    pad_id = _pad_id(model)
    check_padding(model, spec, pad_id, "compile_for_encoder")
    forward = model.forward
    compiled = torch.compile(forward, backend=f"fxpass_{opts.device}", dynamic=True,
                             options={k: v for k, v in (options or {}).items() if k != "device"})
    warned: set[str] = set()
    sig = inspect.signature(forward)  # once: building it costs ~20 µs a call
    var_kw = [p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]

    @functools.wraps(forward)
    def padded_forward(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs)
        kw = dict(bound.arguments)
        for name in var_kw:  # ``**kwargs`` (output_hidden_states, ...) passed on as given
            kw.update(kw.pop(name, {}))
        if not isinstance(kw.get("input_ids"), torch.Tensor) or kw["input_ids"].dim() != 2:
            return compiled(*args, **kwargs)  # inputs_embeds or odd input: as compiled

        def bucketed(kw: dict[str, Any]) -> Any:
            kw, size, over = pad_inputs(kw, spec, pad_id)
            for name, real in over.items():
                if name not in warned:
                    warned.add(name)
                    warnings.warn(
                        f"fxpass_{opts.device}: {name} {real} is past the largest bucket "
                        f"({spec[name][-1]}); it gets its own exact-size variant (add a larger "
                        f"bucket to buckets[{name!r}] to share one)", stacklevel=4)
            return _slice(compiled(**kw), size)

        return by_rows(bucketed, kw, spec)

    model.forward = padded_forward
    return model


class BucketProgram:
    """What :func:`export_for_encoder` returns: one program per (batch, seq) bucket."""

    def __init__(self, programs: dict[str, Any], options: Options, meta: dict[str, Any]):
        self.programs, self.options, self.meta = programs, options, meta

    def save(self, path: str, *, progress: Any = None) -> str:
        from fxpass.aot.package import save

        return save(self.programs, self.options, path, extra={"encoder": self.meta},
                    progress=progress)


def export_for_encoder(
    model: torch.nn.Module,
    *,
    buckets: dict[str, Sequence[int]],
    options: dict[str, Any] | None = None,
    calibration: Sequence[dict[str, torch.Tensor]] | None = None,
    progress: Any = None,
    device: Any = None,
) -> BucketProgram:
    """Export an HF encoder once per bucket (every ``batch`` x ``seq`` pair; batch 1 when no
    batch buckets are given) into one package whose programs share ``weights.bin``, so each
    weight is stored once. ``load(path)`` pads each call to its bucket and slices back, as
    :func:`compile_for_encoder` does; a size past every bucket is refused (a package never
    compiles). Quantized regions need ``calibration``: encoder inputs (dicts of
    ``input_ids``, ``attention_mask``, ...) of any size; each is padded to its bucket and runs
    that bucket's program, so give inputs of every bucket's size."""
    from fxpass.aot import quantized
    from fxpass.aot.export import Program, export_options, lower
    from fxpass.aot.stages import reporter, warn_if_no_region

    spec = check_buckets(buckets)
    if "seq" not in spec:
        raise ValueError("export_for_encoder needs buckets['seq'] (the lengths to export)")
    pad_id = _pad_id(model)
    check_padding(model, spec, pad_id, "export_for_encoder")
    opts = export_options(options, device)
    calib = quantized.check_calibration(opts, calibration, "export_for_encoder()")
    say = reporter(progress)
    types = "token_type_ids" in inspect.signature(model.forward).parameters
    batches = spec.get("batch", [1])
    was = model.training
    model.eval()
    programs = {}
    try:
        for b in batches:
            for n in spec["seq"]:
                say(f"bucket batch {b} x seq {n}")
                kw = {"input_ids": torch.full((b, n), pad_id, dtype=torch.long),
                      "attention_mask": torch.ones(b, n, dtype=torch.long)}
                if types:
                    kw["token_type_ids"] = torch.zeros(b, n, dtype=torch.long)
                programs[f"b{b}_s{n}"] = lower(model, (), kw, opts, say)
                warn_if_no_region(f"bucket batch {b} x seq {n}", programs[f"b{b}_s{n}"].report,
                                   opts)
    finally:
        model.train(was)
    meta = {"buckets": {"batch": batches, "seq": spec["seq"]}, "pad_token_id": pad_id,
            "token_type_ids": types}
    if calib is not None:  # each input through the bucket it pads into, as a loaded package
        runner = EncoderRunner(quantized.HeldPackage(
            "export_for_encoder", {"encoder": meta},
            {k: Program(low, opts) for k, low in programs.items()}))
        quantized.calibrate(list(programs.values()), lambda kw: runner(**kw), calib, say)
    return BucketProgram(programs, opts, meta)


class EncoderRunner:
    """A loaded bucket package: call it like the encoder (``input_ids``, ``attention_mask``,
    ``token_type_ids``); each call runs the program of its bucket."""

    def __init__(self, package: Any):
        self.package = package
        meta = package.manifest["encoder"]
        self.spec = {k: list(v) for k, v in meta["buckets"].items()}
        self.pad_id, self.types = int(meta["pad_token_id"]), bool(meta["token_type_ids"])

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None) -> Any:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"{self.package.path}: input_ids must be a 2-D tensor (batch, "
                             "tokens)")
        kw = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.types:
            kw["token_type_ids"] = (token_type_ids if token_type_ids is not None
                                    else torch.zeros_like(input_ids))
        return by_rows(self._bucketed, kw, self.spec)

    def _bucketed(self, kw: dict[str, Any]) -> Any:
        kw, size, over = pad_inputs(kw, self.spec, self.pad_id)
        if over:
            name, real = next(iter(over.items()))
            raise ValueError(
                f"{self.package.path}: {name} {real} is past the largest exported bucket "
                f"({self.spec[name][-1]}); split the input, or export again with a larger "
                f"bucket in buckets[{name!r}]")
        b, n = kw["input_ids"].shape
        program = self.package.programs[f"b{b}_s{n}"]
        return _slice(program(**kw), size)
