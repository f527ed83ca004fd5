"""A tied embedding that reads the LM head's int4 blocks instead of a copy of its own.

Why: onnxruntime's weight-only quantizer quantizes a tied table (``GatherBlockQuantized``)
and the LM head (``MatMulNBits``) each on its own, so a tied model stored the same blocks
twice (SmolLM2-135M: 0.20x of its fp32 size, against GenAI's 0.17x, whose builder shares
them). Nothing is packed here: the quantizer wrote both. The lookup is pointed at the head's
uint8 blocks (through a ``Reshape``; a row padded to whole blocks is sliced back), scales and
zero points, and its own copy dropped, only when

- the two hold the same values: equal scales and zero points, and equal codes but for the
  rounding ties that the quantizer's two paths (C++ for a MatMul, numpy for a Gather) break
  apart, a code one step off; the lookup then reads the head's rounding. Weights that came
  from a 4-bit grid tie often: SmolLM2's (GGUF Q4_1) differ so in 133 of 28 million codes at
  block 128 (none at 32), which kept the table's own copy, 8 MB, before ties were allowed for
  symmetric blocks too (asymmetric, at block 32: 0.3% of the codes);
- and this onnxruntime gives the same lookups from the head's blocks as from the table's own,
  on a sample of rows (reading uint8 blocks, uint8 zero points and padded rows in a
  ``GatherBlockQuantized`` came in successive onnxruntime releases; an older one raises or
  differs, and the table keeps its copy).

The saving is on disk (the package, the artifact cache). In memory onnxruntime folds the
``Reshape`` into a table of its own when it optimizes the session.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

#: rows of a table checked through onnxruntime before its copy is dropped
SAMPLE_ROWS = 64
#: at most one looked-up value in this many may differ from the table's own (a rounding tie;
#: SmolLM2's grid-born weights: 1 code in 200,000 symmetric at block 128, 1 in 340
#: asymmetric at block 32; a layout that reads other codes differs almost everywhere)
TIES = 100


def share_tied_tables(model: onnx.ModelProto) -> int:
    """Point every tied ``GatherBlockQuantized`` of ``model`` at its LM head's blocks (module
    doc); returns how many were. Their own blocks are left unread, for the caller to drop."""
    gathers = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    if not gathers:
        return 0
    inits = {t.name: t for t in model.graph.initializer}
    heads = [n for n in model.graph.node if n.op_type == "MatMulNBits" and _attrs(n).get(
        "bits") == 4 and all(i in inits for i in n.input[1:] if i)]
    shared = 0
    for node in gathers:
        head = next((h for h in heads if _same_values(node, h, inits)
                     and _same_lookups(node, h, inits)), None)
        if head is not None:
            _read_head(model, node, head, inits[head.input[1]], int(inits[node.input[0]].dims[1]))
            shared += 1
    return shared


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _zero_points(node: onnx.NodeProto) -> str | None:
    return node.input[3] if len(node.input) > 3 and node.input[3] else None


def codes(packed: np.ndarray, cols: int) -> np.ndarray:
    """``MatMulNBits``' packed 4-bit blocks ``[N, blocks, bytes]`` (or its packed zero points
    ``[N, bytes]``) -> the codes ``[N, cols]``, low nibble first (onnxruntime's layout)."""
    flat = packed.reshape(packed.shape[0], -1)
    return np.stack([flat & 15, flat >> 4], axis=-1).reshape(flat.shape[0], -1)[:, :cols]


def _same_values(node: onnx.NodeProto, head: onnx.NodeProto,
                 inits: dict[str, onnx.TensorProto]) -> bool:
    """The lookup's own table and the head's blocks hold the same values (module doc)."""
    a, h = _attrs(node), _attrs(head)
    data = inits.get(node.input[0])
    if (data is None or len(data.dims) != 2 or len(node.input) < 3 or node.input[2] not in inits
            or a.get("gather_axis", 0) != 0 or a.get("quantize_axis", 1) != 1):
        return False
    rows, cols = data.dims
    zp, hzp = _zero_points(node), _zero_points(head)
    if (h["N"], h["K"], h["block_size"]) != (rows, cols, a.get("block_size", 128)) or (
            (zp is None) != (hzp is None)) or (zp is not None and zp not in inits):
        return False
    arr = onnx.numpy_helper.to_array
    scales = arr(inits[head.input[2]])
    if not np.array_equal(scales.reshape(rows, -1), arr(inits[node.input[2]])):
        return False
    # symmetric: int4 codes against MatMulNBits' implicit zero point 8; a tie one step off
    diff = codes(arr(inits[head.input[1]]), cols).astype(np.int16) - (
        8 if zp is None else 0) - arr(data).astype(np.int16)
    if np.abs(diff).max(initial=0) > 1:
        return False
    return zp is None or np.array_equal(
        codes(arr(inits[hzp]), scales.size // rows), arr(inits[zp]).astype(np.int16))


def _shared_nodes(node: onnx.NodeProto, head: onnx.NodeProto, blocks: onnx.TensorProto,
                  cols: int, ids: str, out: str
                  ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes (and their constants) that give ``node``'s lookup into ``out`` from
    ``head``'s blocks: Reshape, GatherBlockQuantized over uint8, and a Slice if padded."""
    rows, width = int(blocks.dims[0]), int(np.prod(blocks.dims[1:]))
    p = f"{node.name}_shared"
    consts = [onnx.numpy_helper.from_array(np.array(v, np.int64), f"{p}_{k}") for k, v in (
        ("shape", [rows, width]), ("starts", [0]), ("ends", [cols]), ("axes", [-1]))]
    attrs = {**{k: v for k, v in _attrs(node).items() if k != "bits"}, "bits": 4}
    padded = width * 2 != cols  # rows padded to whole blocks: the padding is sliced off
    zp = _zero_points(head)
    nodes = [onnx.helper.make_node("Reshape", [head.input[1], f"{p}_shape"], [f"{p}_blocks"],
                                   name=f"{p}_blocks"),
             onnx.helper.make_node("GatherBlockQuantized", [
                 f"{p}_blocks", ids, head.input[2], *([zp] if zp else [])],
                 [f"{p}_padded" if padded else out], name=p, domain=node.domain, **attrs)]
    if padded:
        nodes.append(onnx.helper.make_node("Slice", [f"{p}_padded", *(
            f"{p}_{k}" for k in ("starts", "ends", "axes"))], [out], name=f"{p}_unpad"))
    return nodes, consts


def _same_lookups(node: onnx.NodeProto, head: onnx.NodeProto,
                  inits: dict[str, onnx.TensorProto]) -> bool:
    """This onnxruntime looks up the same rows (a sample) from the head's blocks as from the
    table's own, within one step (a block's scale: the rounding ties above)."""
    import onnxruntime as ort

    data = inits[node.input[0]]
    rows, cols = (int(d) for d in data.dims)
    ids = np.unique(np.linspace(0, rows - 1, SAMPLE_ROWS).astype(np.int64))
    own = onnx.helper.make_node(node.op_type, [node.input[0], "ids", *node.input[2:]], ["own"],
                                domain=node.domain, **_attrs(node))
    nodes, consts = _shared_nodes(node, head, inits[head.input[1]], cols, "ids", "shared")
    used = {i for n in [own, *nodes] for i in n.input} - {"ids"}
    graph = onnx.helper.make_graph(
        [own, *nodes], "tied", [onnx.helper.make_tensor_value_info(
            "ids", onnx.TensorProto.INT64, [len(ids)])],
        [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None)
         for o in ("own", "shared")],
        [*[inits[n] for n in used if n in inits], *consts])
    model = onnx.helper.make_model(graph, opset_imports=[
        onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid(node.domain, 1)])
    model.ir_version = 10
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        a, b = sess.run(["own", "shared"], {"ids": ids})
    except Exception:  # noqa: BLE001 - an onnxruntime that cannot read them so: keep the copy
        return False
    step = float(np.abs(onnx.numpy_helper.to_array(inits[node.input[2]])).max())
    # ties are rare: a layout that reads other codes differs almost everywhere
    return a.shape == b.shape and bool(np.abs(a - b).max() <= step * (1 + 1e-6)) and (
        np.count_nonzero(a != b) <= max(1, a.size // TIES))


def _read_head(model: onnx.ModelProto, node: onnx.NodeProto, head: onnx.NodeProto,
               blocks: onnx.TensorProto, cols: int) -> None:
    """Replace ``node`` (a ``GatherBlockQuantized``) by the lookup of ``head``'s ``blocks``."""
    nodes, consts = _shared_nodes(node, head, blocks, cols, node.input[1], node.output[0])
    model.graph.initializer.extend(consts)
    at = list(model.graph.node).index(node)
    model.graph.node.remove(node)
    for n in reversed(nodes):
        model.graph.node.insert(at, n)
