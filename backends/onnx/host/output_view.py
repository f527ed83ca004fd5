"""Host pass: a region output that is a ``Reshape`` leaves the session unreshaped.

Why: onnxruntime cannot hand out an intermediate buffer as a graph output, so a ``Reshape``
feeding an output copies it. The lowering emits matmuls as 2-D ``Gemm`` between reshapes, so
the logits of every decoder (``[T, vocab] -> [1, T, vocab]``) were copied once per call
(16 MB for a 32000-word vocabulary at 128 tokens; the copy was the ``Reshape`` node's time in
onnxruntime's profile).

The output becomes the ``Reshape``'s input, under the output's name, and ``RegionCall``
views it back to the compiled shape, which it already knows and checks (a view of a
contiguous tensor: no copy; it falls back to eager if the element count differs). Only
outputs of a static shape whose data is computed in the graph (not a graph input or a
constant) and is not already another output (itself or through an ``Identity``) are
changed. The board path never runs this pass.
"""

from __future__ import annotations

from typing import Any

from fxpass.backends.onnx.host.onnx_match import producer_of, static_shape


def output_views(model: Any) -> int:
    """Drop the ``Reshape`` in front of each graph output it can; the count dropped."""
    graph = model.graph
    done = 0
    for k, out in enumerate(list(graph.outputs)):
        node = producer_of(out, "Identity", "Reshape")
        while node is not None and node.op_type == "Identity":  # how the lowering names outputs
            node = producer_of(node.inputs[0], "Identity", "Reshape")
        if node is None or node.op_type != "Reshape":
            continue
        data = node.inputs[0]
        if data is None or data.is_graph_input() or data.is_graph_output():
            continue
        if data.is_initializer() or data.const_value is not None or data.producer() is None:
            continue
        if any(u.op_type == "Identity" and u.outputs[0].is_graph_output()
               for u in data.consumers()):
            continue  # also an output as it is: two outputs would become one buffer
        if static_shape(out) is None:
            continue  # RegionCall views it back to the compiled shape: it must be static
        name = out.name
        out.name = f"{name}_view"
        data.name = name
        graph.outputs[k] = data
        done += 1
    return done
