"""One decode step's matrix-vector products, each alone: onnxruntime's kernels against torch's.

    python -m benchmarks.probes.gemv [--model qwen3-4x512]

Why: a decode step multiplies one row by every weight, so it is memory-bound, and the host
executor's GEMV kernel sets its floor. ``benchmarks.generate`` showed the fxpass_bpu decode
region taking most of a step while inductor (the same aten graph, torch's kernels) was about
twice as fast; this benchmark isolates the one op that both spend their time in.

For every distinct ``nn.Linear`` shape of ``benchmarks.generate``'s model, side by side
(``harness.interleave``, medians):

- ``ort gemm(transB)``: ``Gemm(x, W, transB=1)`` with ``W`` fed in place, prepacking off:
  exactly how a decode region runs its Linear layers (``host.shared_weights``);
- ``ort gemm(transB) 1 thread``: the same, ``intra_op_num_threads=1``;
- ``ort matmul(W^T)``: ``MatMul`` over a transposed copy held by the session (what a lowering
  that spends a copy of every weight would get);
- ``torch linear``: ``torch.nn.functional.linear`` (MKL), what eager and inductor call.

``per token`` sums each contender over the model's Linear layers (shape x count). Writes
``benchmarks/probes/results/gemv.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import harness
from benchmarks.generate import MODELS, _build

OUT = Path(__file__).resolve().parent / "results"


def _session(k: int, n: int, transposed: bool, threads: int | None, w: np.ndarray) -> Any:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])
    if transposed:
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        graph = helper.make_graph([node], "g", [x], [y], [numpy_helper.from_array(w.T, "w")])
    else:
        node = helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)
        wi = helper.make_tensor_value_info("w", TensorProto.FLOAT, [n, k])
        graph = helper.make_graph([node], "g", [x, wi], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def shapes(name: str) -> collections.Counter[tuple[int, int]]:
    """(in_features, out_features) -> how many Linear layers of the model have it."""
    model, _ = _build(name)
    return collections.Counter(
        (m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)
    )


def run(name: str, budget_s: float) -> dict[str, Any]:
    rows = []
    for (k, n), count in sorted(shapes(name).items()):
        torch.manual_seed(0)
        w, x = torch.randn(n, k), torch.randn(1, k)
        wn, xn = w.numpy(), x.numpy()
        want = torch.nn.functional.linear(x, w).numpy()
        gemm = _session(k, n, False, None, wn)
        gemm1 = _session(k, n, False, 1, wn)
        matmul = _session(k, n, True, None, np.ascontiguousarray(wn))
        feed = {"x": xn, "w": wn}
        contenders = {
            "ort gemm(transB)": lambda s=gemm, f=feed: s.run(None, f),
            "ort gemm(transB) 1 thread": lambda s=gemm1, f=feed: s.run(None, f),
            "ort matmul(W^T)": lambda s=matmul, f={"x": xn}: s.run(None, f),
            "torch linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
        }
        for label, fn in contenders.items():  # the same product, or the timing means nothing
            got = fn()
            got = got.numpy() if isinstance(got, torch.Tensor) else got[0]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=label)
        stats = harness.interleave(contenders, budget_s=budget_s)
        rows.append({"k": k, "n": n, "count": count,
                     **{c: s.median for c, s in stats.items()}})
        print(f"[gemv] {k}x{n} x{count}: "
              + ", ".join(f"{c} {s.median * 1e3:.3f} ms" for c, s in stats.items()))
    labels = [c for c in rows[0] if c not in ("k", "n", "count")]
    total = {c: sum(r[c] * r["count"] for r in rows) for c in labels}
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": name, "rows": rows,
            "per_token": total, "environment": harness.environment()}


def to_markdown(data: dict[str, Any]) -> str:
    labels = list(data["per_token"])
    cols = ["shape (in x out)", "layers", *labels, "ort gemm / torch"]
    rows = []
    for r in [*data["rows"], {"k": None, **data["per_token"]}]:
        cells = {c: f"{r[c] * 1e3:.3f}" for c in labels}
        cells["ort gemm / torch"] = f"{r['ort gemm(transB)'] / r['torch linear']:.2f}x"
        if r["k"] is None:
            cells.update({"shape (in x out)": "**per token**", "layers": ""})
        else:
            cells.update({"shape (in x out)": f"{r['k']} x {r['n']}", "layers": r["count"]})
        rows.append(cells)
    head = (f"Run {data['date']}, {data['model']}, ms per product (medians, side by side); "
            "per token = the sum over the model's Linear layers.\n\n")
    return head + harness.markdown_table(rows, cols)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-4x512", choices=list(MODELS))
    ap.add_argument("--budget", type=float, default=6.0, help="seconds per shape and contender")
    a = ap.parse_args(argv)
    data = run(a.model, a.budget)
    harness.write_results(OUT, "gemv", data, to_markdown(data))


if __name__ == "__main__":
    main()
