"""Weight-only int8 / int4 quantization of a host region, with onnxruntime's own quantizer.

Why: a decode step multiplies one row by every weight, so it is bound by the bytes it reads:
fp32 runners (ours, GenAI's, ExecuTorch's) all sit at the same wall. Weights stored as 4 or
8 bits per value, in blocks with one scale each, read 8x or 4x fewer bytes; onnxruntime's
``MatMulNBits`` kernels dequantize a block in registers (or, at accuracy level 4, multiply
int8-quantized activations by it). This is how decoders are deployed on CPUs (GenAI's
``-p int4``, llama.cpp's Q4/Q8, ExecuTorch's 8da4w). No calibration data is needed.

What: ``onnxruntime.quantization.matmul_nbits_quantizer`` does the work: its RTN ("DEFAULT")
or HQQ algorithm, packing and the ``MatMulNBits`` node; nothing here quantizes by hand. We
choose *which* MatMuls: every one over a constant 2-D weight of :data:`MIN_ELEMENTS` or more
(the projections and the LM head); the rest stays float with its reason in the report. An
embedding (a region's Gather over a constant table: the ``ort`` device takes the token lookup
into its region) follows GenAI's int4 builds: tied to the LM head, its table is int4 too
(``GatherBlockQuantized``, with w4 RTN: the only form onnxruntime's quantizer writes), else it
stays float, since a Gather reads one row per token and its bytes cost nothing per step.

The board's calibrated Q/DQ path (``quantize.py``) is a different thing: int8 weights *and*
activations, faithful to the board. This one is for the host.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

from fxpass.backends.onnx import tied_tables
from fxpass.backends.onnx.quantize import QuantizationError

#: ``quantize`` values for weight-only quantization, and their bit widths
BITS = {"w8": 8, "w4": 4}
#: onnxruntime's weight-only algorithms this device offers: round-to-nearest (its "DEFAULT"
#: quantizer, C++; 2, 4 and 8 bits) and HQQ (half-quadratic, 4 bits, in torch). Not offered:
#: GPTQ (onnxruntime's bundled neural-compressor port) needs calibration data, and AWQ needs
#: NVIDIA's modelopt, which is not a dependency.
ALGORITHMS = ("rtn", "hqq")
#: measured (``python -m benchmarks.probes.w4_quality``, SmolLM2-135M, onnxruntime 1.31): HQQ's
#: float zero points have no fast MatMulNBits CPU kernel
HQQ_SLOW = (
    "algorithm='hqq': onnxruntime's CPU MatMulNBits has no fast kernel for HQQ's float zero "
    "points: SmolLM2-135M decoded at 142-155 ms/token against 4.6-6.3 with 'rtn' (23-34x), in "
    "2.3-2.5x the bytes. Use it to measure what better int4 rounding buys; deploy 'rtn' "
    "(docs/quantization.md, 'Quality')")
#: MatMulNBits' accuracy levels: 0 unset (the kernel's own choice), 1 fp32, 2 fp16, 3 bf16,
#: 4 int8 activations (the fast CPU path, GenAI's default for int4 on CPU)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
#: Weights smaller than this stay float: read in microseconds, not worth a kernel switch
MIN_ELEMENTS = 4096
#: the typed options' defaults (GenAI's int4 builder's: blocks of 32, symmetric, level 4)
DEFAULTS = {"block_size": 32, "symmetric": True, "accuracy_level": 4, "algorithm": "rtn"}


@dataclass(frozen=True)
class WeightOnly:
    """How a region's weights are quantized; ``name`` ("w4", "w8") is what the report shows."""

    bits: int
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    algorithm: str = "rtn"

    @property
    def name(self) -> str:
        return f"w{self.bits}"

    def key(self) -> dict[str, Any]:
        return asdict(self)


def resolve(quantize: Any, block_size: int | None = None, symmetric: bool | None = None,
            accuracy_level: int | None = None, algorithm: str | None = None,
            ) -> WeightOnly | None:
    """The device options -> a config, or None when ``quantize`` is not weight-only. The
    weight-only fields set without ``quantize="w4"``/``"w8"`` are an error: they would do
    nothing, silently."""
    fields = {"block_size": block_size, "symmetric": symmetric,
              "accuracy_level": accuracy_level, "algorithm": algorithm}
    given = sorted(k for k, v in fields.items() if v is not None)
    if not (isinstance(quantize, str) and quantize in BITS):
        if given:
            raise QuantizationError(
                f"{', '.join(given)} only apply to weight-only quantization: add "
                f"quantize='w4' or 'w8' (got quantize={quantize!r}), or drop them")
        return None
    v = {k: DEFAULTS[k] if x is None else x for k, x in fields.items()}
    bs = v["block_size"]
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
        raise QuantizationError(
            f"block_size must be a power of two of at least 16 (MatMulNBits' rule), got {bs!r}; "
            "32 (GenAI's default) or 128 (onnxruntime's) are usual")
    if not isinstance(v["symmetric"], bool):
        raise QuantizationError(f"symmetric must be True or False, got {v['symmetric']!r}")
    if v["accuracy_level"] not in ACCURACY_LEVELS or isinstance(v["accuracy_level"], bool):
        raise QuantizationError(
            f"accuracy_level must be one of {ACCURACY_LEVELS} (4: int8 activations, the fast "
            f"CPU path; 1: fp32), got {v['accuracy_level']!r}")
    if v["algorithm"] not in ALGORITHMS:
        raise QuantizationError(
            f"algorithm must be one of {ALGORITHMS} (rtn: round to nearest; hqq: half-quadratic, "
            f"4 bits only), got {v['algorithm']!r}")
    bits = BITS[quantize]
    if v["algorithm"] == "hqq" and bits != 4:
        raise QuantizationError("algorithm='hqq' quantizes 4 bits only in onnxruntime: use "
                                "quantize='w4', or algorithm='rtn' for w8")
    return WeightOnly(bits, bs, v["symmetric"], v["accuracy_level"], v["algorithm"])


def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def plan(model: onnx.ModelProto) -> tuple[list[str], dict[str, int]]:
    """(the MatMul nodes to quantize, the count of those over a constant weight kept float,
    by reason). MatMuls of two activations (attention scores) are not weights: not counted."""
    inits = _initializers(model.graph)
    take, kept = [], {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        dims = list(inits[node.input[1]].dims)
        why = None
        if len(dims) != 2:
            why = "not a 2-D weight"
        elif dims[0] * dims[1] < MIN_ELEMENTS:
            why = f"fewer than {MIN_ELEMENTS} weights"
        elif inits[node.input[1]].data_type != onnx.TensorProto.FLOAT:
            why = "not a float32 weight"
        if why is None:
            take.append(node.name)
        else:
            kept[why] = kept.get(why, 0) + 1
    return take, kept


def tied_lookups(model: onnx.ModelProto) -> list[str]:
    """The Gather nodes over a constant 2-D float table whose transpose is some MatMul's weight
    (an embedding tied to the LM head): GenAI stores such a table in int4 blocks."""
    inits = _initializers(model.graph)
    heads = {}
    for node in model.graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is not None and len(w.dims) == 2:
            heads.setdefault((w.dims[1], w.dims[0]), []).append(w)
    out = []
    for node in model.graph.node:
        t = inits.get(node.input[0]) if node.op_type == "Gather" else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if t is None or axis != 0 or len(t.dims) != 2 or t.data_type != onnx.TensorProto.FLOAT:
            continue
        if t.dims[0] * t.dims[1] < MIN_ELEMENTS or not heads.get(tuple(t.dims)):
            continue
        table = onnx.numpy_helper.to_array(t)
        if any(np.array_equal(table.T, onnx.numpy_helper.to_array(w))
               for w in heads[tuple(t.dims)]):
            out.append(node.name)
    return out


def pack_siblings(model: onnx.ModelProto, take: list[str]) -> tuple[list[str], int]:
    """Merge the MatMuls of ``take`` that read the same input (a layer's q, k and v
    projections; its gate and up) into one over their weights side by side, and a ``Split``.

    Why: a one-row step is a few microseconds of work per kernel, and each ``MatMulNBits``
    call also quantizes its input row and dispatches to the thread pool: three calls over one
    input cost that three times (GenAI's builder packs q/k/v for the same reason). Blocks run
    along K within one output column, so each column quantizes exactly as it would alone.
    Returns the MatMuls to quantize after the merge, and how many merges were made."""
    inits = _initializers(model.graph)
    nodes = {n.name: n for n in model.graph.node}
    groups: dict[str, list[onnx.NodeProto]] = {}
    for name in take:
        groups.setdefault(nodes[name].input[0], []).append(nodes[name])
    merged, kept = 0, [n for n in take if len(groups[nodes[n].input[0]]) < 2]
    for a, group in groups.items():
        if len(group) < 2:
            continue
        ws = [inits[n.input[1]] for n in group]
        arrays = [onnx.numpy_helper.to_array(w) for w in ws]
        packed = onnx.numpy_helper.from_array(np.concatenate(arrays, axis=1),
                                              f"{ws[0].name}_packed{len(ws)}")
        split = onnx.numpy_helper.from_array(np.array([w.shape[1] for w in arrays], np.int64),
                                             f"{packed.name}_split")
        model.graph.initializer.extend([packed, split])
        out = f"{group[0].output[0]}_packed"
        mm = onnx.helper.make_node("MatMul", [a, packed.name], [out],
                                   name=f"{group[0].name}_packed")
        sp = onnx.helper.make_node("Split", [out, split.name], [n.output[0] for n in group],
                                   name=f"{group[0].name}_split", axis=-1)
        at = list(model.graph.node).index(group[0])
        for n in group:
            model.graph.node.remove(n)
        model.graph.node.insert(at, sp)
        model.graph.node.insert(at, mm)
        kept.append(mm.name)
        merged += 1
    _drop_unused(model)
    return kept, merged


def _drop_unused(model: onnx.ModelProto) -> None:
    """Remove the initializers no node reads (If branches read outer names too)."""
    used, graphs = set(), [model.graph]
    while graphs:
        g = graphs.pop()
        for n in g.node:
            used.update(n.input)
            for at in n.attribute:
                graphs.extend([at.g] if at.HasField("g") else [])
                graphs.extend(at.graphs)
    for t in [t for t in model.graph.initializer if t.name not in used]:
        model.graph.initializer.remove(t)


def quantize_model(model: onnx.ModelProto, cfg: WeightOnly) -> tuple[onnx.ModelProto, dict]:
    """``model`` (weights inside) with its large constant MatMuls as ``MatMulNBits``, and a
    summary: how many were quantized, and how many kept float and why."""
    mnb = _quantizer()
    for i, node in enumerate(model.graph.node):  # the quantizer excludes nodes by name
        if not node.name:
            node.name = f"n{i}_{node.op_type}"
    take, kept = plan(model)
    weights = len(take)
    lookups = tied_lookups(model)
    if lookups and (cfg.bits != 4 or cfg.algorithm != "rtn"):
        kept[f"a tied embedding: int4 RTN only ({cfg.name} {cfg.algorithm})"] = len(lookups)
        lookups = []
    take, merged = pack_siblings(model, take)
    if cfg.algorithm == "hqq":
        warnings.warn(HQQ_SLOW, stacklevel=2)
        algo = mnb.HQQWeightOnlyQuantConfig(block_size=cfg.block_size, bits=cfg.bits)
    else:
        algo = mnb.DefaultWeightOnlyQuantConfig(
            block_size=cfg.block_size, is_symmetric=cfg.symmetric,
            accuracy_level=cfg.accuracy_level or None, bits=cfg.bits,
            op_types_to_quantize=("MatMul", "Gather") if lookups else ("MatMul",))
    names = set(take) | set(lookups)
    exclude = [n.name for n in model.graph.node
               if n.op_type in ("MatMul", "Gather") and n.name not in names]
    q = mnb.MatMulNBitsQuantizer(model, nodes_to_exclude=exclude, algo_config=algo)
    with warnings.catch_warnings():  # (its INFO logs: off in _quantizer)
        warnings.simplefilter("ignore", UserWarning)  # HQQ: torch.from_numpy of a read-only array
        q.process()
    out = q.model.model
    if cfg.algorithm == "hqq" and cfg.accuracy_level:  # HQQ's config takes no level
        for node in out.graph.node:
            if node.op_type == "MatMulNBits":
                node.attribute.append(onnx.helper.make_attribute("accuracy_level",
                                                                 cfg.accuracy_level))
    done = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    tables = sum(n.op_type == "GatherBlockQuantized" for n in out.graph.node)
    if done != len(take) or tables != len(lookups):
        raise QuantizationError(
            f"onnxruntime's quantizer turned {done} of {len(take)} MatMuls into MatMulNBits "
            f"and {tables} of {len(lookups)} tied embeddings into GatherBlockQuantized; "
            f"the rest would silently stay float. Set quantize=None for this model, or report "
            "it with the region's ONNX model")
    _check_ids(out)
    shared = tied_tables.share_tied_tables(out)
    if shared:
        _drop_unused(out)  # the tables' own blocks
    out.ir_version = min(out.ir_version, model.ir_version)
    summary = {"config": cfg.name, "matmul_nbits": weights, "kernels": done, "kept_float": kept,
               "gather_block_quantized": tables, "shared_tables": shared,
               **cfg.key()}
    return out, summary


def _check_ids(model: onnx.ModelProto) -> None:
    """Give every ``GatherBlockQuantized`` a bounds check on its ids.

    Why: onnxruntime's ``GatherBlockQuantized`` reads an id past the table without an error
    (found by a test: a negative id, which the lowering moves past the end so that a plain
    ``Gather`` raises, came back as some row), where eager raises ``IndexError``. A plain
    ``Gather`` of the same ids from a ``[rows, 1]`` table of zeros does raise, and its zeros,
    added to the lookup, change no value: the region fails, and eager raises its own error."""
    inits = _initializers(model.graph)
    for node in [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]:
        rows = int(inits[node.input[0]].dims[0])
        zeros = onnx.numpy_helper.from_array(np.zeros((rows, 1), np.float32),
                                             f"{node.name}_bounds")
        model.graph.initializer.append(zeros)
        out, raw, checked = node.output[0], f"{node.output[0]}_raw", f"{node.output[0]}_bounds"
        node.output[0] = raw
        at = list(model.graph.node).index(node) + 1
        model.graph.node.insert(at, onnx.helper.make_node(
            "Add", [raw, checked], [out], name=f"{node.name}_checked"))
        model.graph.node.insert(at, onnx.helper.make_node(
            "Gather", [zeros.name, node.input[1]], [checked], name=f"{node.name}_bounds",
            axis=0))


def _quantizer() -> Any:
    """onnxruntime's weight-only quantizer module, imported without its side effect: it calls
    ``logging.basicConfig(level=INFO)`` at import, which would print every INFO record of the
    user's process (ours, torch's) from then on, and it logs each node it quantizes at INFO.
    The root logger is put back as it was and the module's own logger set to warnings."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization import matmul_nbits_quantizer as mnb

    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
    root.setLevel(level)
    own = logging.getLogger(mnb.__name__)
    own.setLevel(logging.WARNING)
    if not any(isinstance(f, _VersionNotes) for f in own.filters):
        own.addFilter(_VersionNotes())
    return mnb


class _VersionNotes:
    """Drops the quantizer's warnings that it raises the model's opset to 21 and its IR
    version to 10 for int4 data (it says so each time it quantizes a token table): that is
    what the table needs and what this module keeps, not something the user can act on."""

    NOTES = ("The IR version of the input model is", "The opset of the input model is under 21")

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(self.NOTES)


def split_weights(model: onnx.ModelProto, min_bytes: int = 1024) -> dict[str, Any]:
    """Move the data of ``model``'s initializers of ``min_bytes`` or more out of it, into a
    ``Weights``-shaped mapping (name -> (ONNX dtype, dims, array)) a package writes once
    (:func:`fxpass.backends.onnx.lowering.point_external`). The arrays are the raw bytes."""
    from fxpass.backends.onnx.lowering.driver import Weights

    out = Weights()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) < min_bytes:
            continue
        raw = np.frombuffer(t.raw_data, dtype=np.uint8).copy()
        out[t.name] = (t.data_type, list(t.dims), lambda raw=raw: raw)
    return out


def from_options(o: Any) -> WeightOnly | None:
    """:func:`resolve` over a device's typed options (``quantize`` and the four fields)."""
    return resolve(getattr(o, "quantize", None), getattr(o, "block_size", None),
                   getattr(o, "symmetric", None), getattr(o, "accuracy_level", None),
                   getattr(o, "algorithm", None))
