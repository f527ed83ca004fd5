"""onnxruntime's per-call overhead and matmul throughput on this machine.

The host executor's ``min_compute_macs`` default comes from these two numbers: a region is
worth a session call when its MACs take longer than the call overhead, i.e. MACs >=
overhead_seconds * MACs_per_second. (The board default, 100M MACs, comes from the original
pull request's 0.8 ms per BPU submission.)

    python -m benchmarks.probes.ort_overhead
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper


def _session(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(m)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def _median_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def measure() -> dict[str, float]:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])
    s = _session([helper.make_node("Relu", ["x"], ["y"])], [x], [y])
    feed = {"x": np.ones((1, 16), np.float32)}
    overhead = _median_us(lambda: s.run(["y"], feed))
    k = 512
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [k, k])
    o = helper.make_tensor_value_info("o", TensorProto.FLOAT, [k, k])
    w = onnx.numpy_helper.from_array(np.random.rand(k, k).astype(np.float32), "w")
    s2 = _session([helper.make_node("MatMul", ["a", "w"], ["o"])], [a], [o], [w])
    feed2 = {"a": np.random.rand(k, k).astype(np.float32)}
    mm_us = _median_us(lambda: s2.run(["o"], feed2), n=50)
    macs_per_s = k**3 / ((mm_us - overhead) * 1e-6)
    return {
        "call_overhead_us": overhead,
        "gmacs_per_s": macs_per_s / 1e9,
        "break_even_macs": overhead * 1e-6 * macs_per_s,
    }


if __name__ == "__main__":
    r = measure()
    print(
        f"onnxruntime call overhead {r['call_overhead_us']:.1f} us (median), matmul "
        f"{r['gmacs_per_s']:.1f} GMAC/s -> break-even region size {r['break_even_macs']:.3g} MACs"
    )
