"""The int4 decode region's cache writes (``backends/onnx/host/row_write.py``), A/B.

    python -m benchmarks.probes.row_write [--repeats 30]

1. **One cache write alone:** a [1, 4, 256, 64] float32 cache with one row written, as
   ``Where`` (the lowering's form), ``ScatterElements`` and ``ScatterND``, each followed by a
   ``ReduceSum`` that reads the result (medians of 1000 runs).
2. **The decode region:** a Qwen3 4 x 512 ``w4`` (block 128) package's decode region on one
   captured step's inputs, built with the ``row_write`` fusion and without it, plus two
   timing-only ablations of the fused model (their outputs differ, they only show a cost): the
   scatters as ``Identity`` (no cache copy) and the attention's ``If`` replaced by its fused
   branch (no exactness guard). The sessions are timed in round robin, medians.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper


def _session(proto: onnx.ModelProto) -> Any:
    import onnxruntime as ort

    from fxpass.backends.onnx.host.ort import DISABLED_OPTIMIZERS, OPT_LEVEL

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVEL)
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=DISABLED_OPTIMIZERS)


def one_write(runs: int = 1000) -> dict[str, float]:
    """us per run of one row written into a [1, 4, 256, 64] cache, by op."""
    s, rng = 256, np.random.default_rng(0)
    t = rng.standard_normal((1, 4, s, 64)).astype(np.float32)
    row = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    hit = np.zeros((1, 1, s, 1), bool)
    hit[0, 0, 7, 0] = True
    forms = {
        "Where": (["hit", "row", "t"], {"hit": hit, "row": row, "t": t}, {}),
        "ScatterElements": (["t", "i", "row"], {"t": t, "i": np.full((1, 4, 1, 64), 7, np.int64),
                                                "row": row}, {"axis": 2}),
        "ScatterND": (["t", "i", "u"], {"t": t, "u": row.reshape(4, 64),
                                        "i": np.array([[0, h, 7] for h in range(4)], np.int64)},
                      {}),
    }
    out = {}
    for op, (names, feeds, attrs) in forms.items():
        inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                list(v.shape)) for n, v in feeds.items()]
        g = helper.make_graph(
            [helper.make_node(op, names, ["w"], **attrs),
             helper.make_node("ReduceSum", ["w"], ["o"], keepdims=1)],
            "g", inputs, [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        m.ir_version = 10
        sess = _session(m)
        for _ in range(100):
            sess.run(None, feeds)
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            ts.append(time.perf_counter() - t0)
        out[op] = float(np.median(ts) * 1e6)
    return out


def _decode_region(tmp: str, fuse: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The decode region's model and a mid-generation step's feeds, from a w4 package."""
    import torch
    from onnx.external_data_helper import load_external_data_for_model

    from benchmarks.generate import _build
    from fxpass.aot.export import export_for_generate
    from fxpass.aot.package import load
    from fxpass.backends.onnx.host import ort as hort
    from fxpass.backends.onnx.host import prepare

    passes = prepare._passes
    if not fuse:
        prepare._passes = lambda w=None: [p for p in passes(w) if p[0] != "row_write"]
    try:
        model, ids = _build("qwen3-4x512")
        program = export_for_generate(model, max_cache_len=256, prefill_length=32, device="ort",
                                      options={"quantize": "w4", "block_size": 128,
                                               "cache": False})
        path = program.save(f"{tmp}/{'fused' if fuse else 'where'}")
    finally:
        prepare._passes = passes
    seen: list[tuple[Any, list[torch.Tensor]]] = []
    call = hort.OrtExecutor.__call__

    def spy(self: Any, *t: torch.Tensor) -> Any:
        seen.append((self, [x.clone() for x in t]))
        return call(self, *t)

    hort.OrtExecutor.__call__ = spy
    try:
        load(path).generate(ids, max_new_tokens=40, eos_token_id=[])
    finally:
        hort.OrtExecutor.__call__ = call
    ex, tensors = seen[len(seen) // 2]  # a decode step
    feeds = {n: t.numpy() for n, t in zip(ex.input_names, tensors, strict=True)}
    feeds.update({n: t.numpy() for n, t in ex.shared.items()})
    # the decode program's region: exported second, so its graph number is the larger
    name = max(Path(path).glob("region_g*_r0.onnx"),
               key=lambda f: int(f.name.split("_")[1][1:]))
    proto = onnx.load(str(name), load_external_data=False)
    load_external_data_for_model(proto, str(path))
    return proto, feeds


def _ablated(proto: onnx.ModelProto, what: str) -> onnx.ModelProto:
    m = onnx.ModelProto.FromString(proto.SerializeToString())
    nodes = []
    for n in m.graph.node:
        if what == "no copy" and n.op_type == "ScatterND":
            n.op_type = "Identity"
            del n.input[1:]
        if what == "no guard" and n.op_type == "If":
            (then,) = [a.g for a in n.attribute if a.name == "then_branch"]
            for x in then.node:
                y = onnx.NodeProto()
                y.CopyFrom(x)
                y.output[0], y.name = n.output[0], f"{n.name}/then"
                nodes.append(y)
            continue
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def region(repeats: int) -> dict[str, float]:
    """ms per decode-region run, each form on the same captured step."""
    with tempfile.TemporaryDirectory() as tmp:
        fused, feeds = _decode_region(tmp, True)
        where, where_feeds = _decode_region(tmp, False)
    forms = {"Where (no fusion)": (where, where_feeds), "ScatterND (row_write)": (fused, feeds),
             "no copy (timing only)": (_ablated(fused, "no copy"), feeds),
             "no guard (timing only)": (_ablated(fused, "no guard"), feeds)}
    sessions = {k: (_session(m), f) for k, (m, f) in forms.items()}
    ts: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(repeats):
        for k, (s, f) in sessions.items():
            for _ in range(20):
                t0 = time.perf_counter()
                s.run(None, f)
                ts[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v) * 1e3) for k, v in ts.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    print("one cache write, us:", {k: round(v, 1) for k, v in one_write().items()})
    print("decode region, ms:", {k: round(v, 3) for k, v in region(args.repeats).items()})


if __name__ == "__main__":
    main()
