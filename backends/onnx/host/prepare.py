"""Prepare a region's ONNX model for the host executor: onnxscript's onnxruntime fusions.

The lowering emits one standard op per aten op, which is what hbdk4 wants. On the host the
same model runs faster through onnxruntime's fused CPU kernels. onnxscript's
``optimize_for_ort`` knows those fusions (RMSNorm -> ``SimplifiedLayerNormalization``, the
residual add folded into it as ``SkipSimplifiedLayerNormalization``, GELU, attention, rotary)
and its authors keep them correct, so we call it rather than write our own. The lowering
spells its ops the way those patterns expect (``ReduceMean`` with explicit
``noop_with_empty_axes`` and ``axes=[-1]``), which is what makes them fire.

We call the fusion passes themselves, not the whole ``optimize_for_ort`` pipeline. That
pipeline first runs onnxscript's general optimizer three times (shape inference, constant
folding and its default rewrite rules, whose multi-output patterns scan the whole graph for
every candidate node) and then attention/rotary fusions that never match our graphs (cos/sin
are computed on the CPU, attention is decomposed by our SDPA rule). On the Qwen3 4 x 1024
region it took 2.3 s on a quiet machine (25 s on a loaded one, most of the cold compile), for
the same fusions the passes below find in 0.08 s (17 RMSNorm + 8 skip-RMSNorm, same counts).
Our lowering already folds constants and records shapes, which is all those passes need.

Which fusions fired is returned, shown in the compile report and checked in a test. A failure
here is not swallowed: the region falls back to eager with the error in the warning (or raises
under ``strict=True``), and ``host_fusions=False`` switches the step off. The board path
never goes through this module.
"""

from __future__ import annotations

import math
import threading

import onnx
import torch

from fxpass.backends.onnx.lowering.driver import Weights, write_weights

# onnxscript's fusion rules are module-level objects whose matchers keep the current match on
# the instance, so two threads fusing at once corrupt each other's bindings ("check() missing
# 1 required positional argument"). Regions compile in a thread pool; the passes take
# milliseconds on a weightless model, so they run one at a time.
_FUSING = threading.Lock()


def _passes(weights: Weights | None = None) -> list[tuple[str, object]]:
    """(name, fusion pass) in the order ``optimize_for_ort`` applies them; names are its
    count keys, so reports read the same as before. ``weights``: the data of the weightless
    model's initializers, for the passes that must read a constant (the rotary tables)."""
    import functools

    from onnxscript.rewriter.ort_fusions.bias_gelu import fuse_bias_gelu
    from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu
    from onnxscript.rewriter.ort_fusions.gelu import fuse_gelu
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import (
        fuse_skip_layer_normalization,
        fuse_skip_rms_normalization,
    )

    from fxpass.backends.onnx.host.attention import fuse_attention
    from fxpass.backends.onnx.host.chunk_attention import fuse_chunk_attention
    from fxpass.backends.onnx.host.decode_attention import fuse_decode_attention
    from fxpass.backends.onnx.host.output_view import output_views
    from fxpass.backends.onnx.host.rotary import fuse_rotary
    from fxpass.backends.onnx.host.row_write import fuse_row_writes
    from fxpass.backends.onnx.host.unit_axes import fuse_unit_axes

    return [
        # first: attention reads its output as q and k
        ("rotary_embedding", functools.partial(fuse_rotary, weights=weights)),
        ("attention", fuse_attention),
        # one token over a static cache: the attention's If and row writes -> one kernel
        ("decode_attention", fuse_decode_attention),
        ("chunk_attention", fuse_chunk_attention),  # a prompt chunk's: the same, L rows
        ("row_write", fuse_row_writes),  # after attention, which matches the Where's users
        ("erf_gelu", fuse_erfgelu),
        ("rms_normalization", fuse_rms_normalization),
        ("skip_layer_normalization", fuse_skip_layer_normalization),
        ("skip_rms_normalization", fuse_skip_rms_normalization),
        ("gelu", fuse_gelu),
        ("bias_gelu", fuse_bias_gelu),
        # after the fusions that match transposes and views (attention, rotary)
        ("unit_axes", fuse_unit_axes),
        ("output_view", output_views),  # last: a fusion may leave an output's Reshape
    ]


def fuse_for_ort(
    proto: onnx.ModelProto, weights: Weights | None = None
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The region model with onnxruntime's fused operators, and the count of each fusion.
    ``weights`` (from ``lower_weightless``) lets a fusion read a folded constant's data."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    model = ir.from_proto(proto)
    with _FUSING:
        counts = {name: fuse(model) for name, fuse in _passes(weights)}
    if any(counts.values()):
        # what optimize_for_ort's final cleanup does: inline helper functions a fusion left,
        # drop the nodes and constants it replaced (else onnxruntime warns per initializer)
        for cleanup in (
            common.InlinePass(),
            common.IdentityEliminationPass(),
            common.RemoveUnusedNodesPass(),
            common.RemoveUnusedFunctionsPass(),
            common.RemoveUnusedOpsetsPass(),
        ):
            cleanup(model)
    if counts.get("decode_attention"):
        from fxpass.backends.onnx.host.decode_attention import declare_rows

        declare_rows(model)  # last: names the outputs as the session will see them
    fused = ir.to_proto(model)
    # onnxruntime reads at most the IR version it was built for; keep the lowering's.
    fused.ir_version = min(fused.ir_version, proto.ir_version)
    return fused, {k: v for k, v in counts.items() if v}


def declared_weights(proto: onnx.ModelProto, weights: Weights) -> Weights:
    """``weights`` without those the fused ``proto`` no longer declares as initializers.

    Why: a fusion can leave a weight unused (a folded rotary table replaced by its half), and
    the cleanup then drops its initializer. Everything after the fusions works from
    ``weights``: written back, it would come back as an unused initializer (bytes in the
    model and the cache file); fed in place (``shared_weights``), it would be a feed the
    model has no input for, and the session would refuse it. A new mapping, not an edit:
    the weights file may still be being written from the old one (``host.build.build_ort``)."""
    names: set[str] = set()
    graphs = [proto.graph]
    while graphs:
        g = graphs.pop()
        names.update(i.name for i in g.initializer)
        for node in g.node:
            for a in node.attribute:
                graphs.extend([a.g] if a.HasField("g") else [])
                graphs.extend(a.graphs)
    kept = Weights()
    kept.update((n, w) for n, w in weights.items() if n in names)
    kept.casts = {n: c for n, c in weights.casts.items() if n in names}
    return kept


# ------------------------------------------------------------------ weights read in place
#: Smaller weights are written into the model: sharing them saves nothing worth a feed.
MIN_SHARED_BYTES = 64 * 1024
#: Up to this many rows (tokens) per Gemm/MatMul a region reads its weights in place instead
#: of prepacking them. 0: every region prepacks (tiered above one row, ``tier_pays``), a
#: decode step's one row included: with onnxruntime's prepacked GEMV a Qwen3 4 x 1024 1-token
#: forward was 1.12x faster and a Qwen3 4 x 512 decode region 1.26x (``benchmarks.probes.tiering``,
#: ``benchmarks.probes.decode_region``), at the price of a packed copy of the weights per region.
#: The option ``prepack_one_row=False`` makes it 1: one-row regions (a decode step) read the
#: weights in place and hold no copy.
PREPACK_MAX_ROWS = 0
_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64, torch.int64, torch.int32,
                 torch.int8, torch.uint8, torch.bool)
#: weight dtypes a first tier reads in place and casts in its graph (``in_place_model``);
#: BF16 has no numpy dtype, so the executor feeds it as an OrtValue (``host.ort._feed``)
_FEEDABLE = {torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float16: onnx.TensorProto.FLOAT16}


def readable_in_place(t: torch.Tensor) -> bool:
    """onnxruntime reads a tensor it is handed (a feed or an ``add_initializer``) as a dense
    row-major CPU array at its data pointer."""
    return t.device.type == "cpu" and t.is_contiguous()


def _worth_feeding(t: torch.Tensor) -> bool:
    """A weight read in place rather than written: readable, of a numpy dtype, and large
    enough that a copy would cost more than the feed."""
    return (readable_in_place(t) and t.dtype in _NUMPY_DTYPES
            and t.numel() * t.element_size() >= MIN_SHARED_BYTES)


def shared_weights(
    model: onnx.ModelProto, weights: Weights, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Turn the weights onnxruntime can read in place into graph inputs, fed from the
    model's own tensors on every run; take them out of ``weights`` (the lowering's to-write
    list) and return name -> tensor. Call it only where prepacking does not pay
    (:func:`prepack_helps` is False): a prepacked weight is copied by onnxruntime anyway.

    Why: writing a weight into the model copies it (into the protobuf, into the cache, then
    into the session). A graph input that is a numpy view of the tensor is read where it
    lies. (``add_external_initializers`` copies the data in onnxruntime 1.31;
    ``add_initializer`` reads in place but its weight stays an initializer, so onnxruntime
    would prepack a copy: the form for regions that prepack, :func:`in_place_initializers`.)
    The model's frozen
    weights as they are qualify (``tensors``: a region's buffers that hold a frozen
    placeholder): contiguous CPU tensors of a numpy dtype. So does a plain dtype cast of one
    (``weights.casts``: a BF16 weight read as float32), as a copy made by :func:`cast_weight`:
    onnxruntime needs float32 anyway, and making it costs less than writing it to the model
    file and reading it back. Transposed views stay written (``Gemm(transB=1)`` keeps Linear
    weights untransposed, so the host path has none)."""
    shared = {}
    casts = weights.casts
    for name in list(weights):
        t, made = tensors.get(name), False
        if t is None and name in casts and casts[name][0] in tensors:
            src, dtype = casts[name]
            t, made = cast_weight(tensors[src], dtype), True
        if t is not None and _worth_feeding(t):
            shared[name] = t if made else t.detach()
            del weights[name]
    g = model.graph
    inits = [i for i in g.initializer if i.name in shared]
    for init in inits:
        g.initializer.remove(init)
        g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type,
                                                          list(init.dims)))
    return shared


def in_place_initializers(
    model: onnx.ModelProto, weights: Weights, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The weights of a model that prepacks which onnxruntime can take from the region's own
    tensors (``add_initializer``, ``host.ort.OrtExecutor``) rather than from its weights file:
    frozen float32 weights as they are (not casts; onnxruntime prepacks float32 only) that
    :func:`shared_weights` would feed, of the shape the model declares. Unlike
    :func:`shared_weights` the model is not changed: they stay initializers, so onnxruntime
    still prepacks them; they also stay in ``weights``, so the cache entry's file still holds
    them."""
    declared = {i.name: i for i in model.graph.initializer}
    out = {}
    for name in weights:
        t, init = tensors.get(name), declared.get(name)
        if (t is not None and init is not None and t.dtype == torch.float32
                and init.data_type == onnx.TensorProto.FLOAT
                and tuple(t.shape) == tuple(init.dims) and _worth_feeding(t)):
            out[name] = t.detach()
    return out


#: A region that prepacks opens on a first-tier session that reads its weights in place when
#: the weights onnxruntime prepacks come to at least this much (``host.ort.TieredExecutor``).
#: Prepacking costs ~1 ms per MB when a session opens, and the build writes them to the cache
#: once more; below this the caller waits less for the build than a second session costs it,
#: and nothing runs in the background. Measured (``python -m benchmarks.second_pass``, ELECTRA
#: 4 x 512 at 6 shapes, ~50 MB of GEMM weights): the first tier and its background builds made
#: the second pass 4.6-6.1x the steady one; built at once, each variant's first call is the
#: prepack slower and the second pass runs at steady speed.
TIER_MIN_BYTES = 64 * 2**20


def tier_pays(model: onnx.ModelProto, weights: Weights, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a region that prepacks should open on a first tier (``in_place_model``): the
    frozen weights onnxruntime would prepack (GEMM/MatMul right operands, as they are or the
    sources of casts) come to :data:`TIER_MIN_BYTES`. A table lookup's weight is read in
    place by every session alike: it costs the build nothing."""
    inits = {i.name for i in model.graph.initializer}
    packed = {nd.input[1] for nd in model.graph.node
              if nd.op_type in ("Gemm", "MatMul") and len(nd.input) > 1 and nd.input[1] in inits}
    names = {n for n in packed if n in tensors}
    names |= {weights.casts[n][0] for n in packed if n in weights.casts
              and weights.casts[n][0] in tensors}
    return sum(tensors[n].numel() * tensors[n].element_size() for n in names) >= TIER_MIN_BYTES


def _cast_in_graph(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether a first tier reads ``t`` in place and casts it to ``dtype`` on every call."""
    return (t is not None and t.device.type == "cpu" and t.is_contiguous()
            and t.dtype in _FEEDABLE and dtype == torch.float32
            and t.numel() * t.element_size() >= MIN_SHARED_BYTES)


def casts_in_place(weights: Weights, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a first tier (:func:`in_place_model`) would cast some weight on every call."""
    return any(_cast_in_graph(tensors.get(src), dtype) for src, dtype in weights.casts.values())


def in_place_model(
    proto: onnx.ModelProto, weights: Weights, tensors: dict[str, torch.Tensor]
) -> tuple[bytes, dict[str, torch.Tensor], dict[str, str]] | None:
    """The first tier of a region that prepacks: a copy of its (fused, weightless) model whose
    frozen weights are graph inputs read in place (:func:`shared_weights`), the small rest
    written in. A cast weight (a BF16 weight computed in float32) is read in place as it is and
    cast by a ``Cast`` node on every call: the first tier runs only until the second is built,
    and a float32 copy would add twice the BF16 bytes beside onnxruntime's prepacked copy.
    Returns the model, each input's tensor and the region attribute it is. ``proto`` and
    ``weights`` are left as they were (the second tier writes them). None if too little is
    read in place (:func:`tier_pays`)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    rest = Weights()
    rest.update(weights)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    shared, attrs, casts = {}, {}, []
    for name, (src, dtype) in weights.casts.items():
        t = tensors.get(src)
        if name not in inits or not _cast_in_graph(t, dtype):
            continue
        g.initializer.remove(inits[name])
        del rest[name]
        inp = f"{name}__in_place"
        g.input.append(onnx.helper.make_tensor_value_info(inp, _FEEDABLE[t.dtype], list(t.shape)))
        casts.append(onnx.helper.make_node("Cast", [inp], [name], to=onnx.TensorProto.FLOAT))
        shared[inp], attrs[inp] = t.detach(), src
    rest.casts = {}  # what is left of them stays written
    if casts:  # each right before its first user, so each float32 copy dies after its use
        pending = {c.output[0]: c for c in casts}
        nodes = []
        for nd in g.node:
            nodes.extend(pending.pop(i) for i in nd.input if i in pending)
            nodes.append(nd)
        nodes[:0] = pending.values()  # (no user: cannot happen; kept valid anyway)
        del g.node[:]
        g.node.extend(nodes)
    plain = shared_weights(model, rest, tensors)
    shared.update(plain)
    attrs.update({n: n for n in plain})
    if sum(t.numel() * t.element_size() for t in shared.values()) < TIER_MIN_BYTES:
        return None
    return write_weights(model, rest).SerializeToString(), shared, attrs


def cast_weight(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 (or other) copy of a weight that a host region reads in place of a cast:
    made here from the weight, both when compiling and when a cached entry loads, so the
    cache never stores it (for a BF16 model, twice the weights' bytes written and read)."""
    with torch.no_grad():
        return t.detach().to(dtype).contiguous()


#: ops whose weights onnxruntime prepacks, besides Gemm/MatMul: their saved prepacked form is
#: not exercised here, so a model with any of them is saved without it (and repacks on load)
_OTHER_PREPACKERS = frozenset({
    "Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "LSTM", "GRU", "RNN",
    "MatMulInteger", "QLinearMatMul", "DynamicQuantizeMatMul", "MatMulNBits", "FusedConv",
})


def saves_prepacked(model: onnx.ModelProto) -> bool:
    """Whether onnxruntime may save ``model``'s prepacked weights with its optimized model.

    Why not always: onnxruntime 1.31 wrote an optimized Wav2Vec2 region (two ``If`` subgraphs,
    three Convs) with prepacked weights that segfaulted when loaded (found by the architecture
    tests once the compiling process loaded its stored entry; without the prepacked weights it
    loads and matches eager). Saved prepacked weights are used only where they are tested: no
    subgraphs, and no prepacking op but Gemm and MatMul (every Linear layer)."""
    graph_attrs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    return not any(
        n.op_type in _OTHER_PREPACKERS or any(a.type in graph_attrs for a in n.attribute)
        for n in model.graph.node
    )


def prepack_helps(model: onnx.ModelProto, max_rows: int | None = None) -> bool:
    """Whether some Gemm/MatMul multiplies more than ``max_rows`` rows (default
    :data:`PREPACK_MAX_ROWS`) by an initializer (or its shape is unknown): then onnxruntime
    should prepack its weights."""
    max_rows = PREPACK_MAX_ROWS if max_rows is None else max_rows
    g = model.graph
    inits = {i.name for i in g.initializer}
    shapes = {vi.name: vi.type.tensor_type.shape for vi in [*g.input, *g.value_info, *g.output]}
    for nd in g.node:
        if nd.op_type not in ("Gemm", "MatMul") or len(nd.input) < 2 or nd.input[1] not in inits:
            continue
        shape = shapes.get(nd.input[0])
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in shape.dim] if shape else []
        if not dims or 0 in dims or math.prod(dims[:-1]) > max_rows:
            return True
    return False
