"""Prepare a region's ONNX model for the host executor: onnxscript's onnxruntime fusions.

The lowering emits one standard op per aten op, which is what hbdk4 wants. On the host the
same model runs faster through onnxruntime's fused CPU kernels. onnxscript's
``optimize_for_ort`` knows those fusions (RMSNorm -> ``SimplifiedLayerNormalization``, the
residual add folded into it as ``SkipSimplifiedLayerNormalization``, GELU, attention, rotary)
and its authors keep them correct, so we call it rather than write our own. The lowering
spells its ops the way those patterns expect (``ReduceMean`` with explicit
``noop_with_empty_axes`` and ``axes=[-1]``), which is what makes them fire.

Which fusions fired is returned, shown in the compile report and checked in a test. A failure
here is not swallowed: the region falls back to eager with the error in the warning (or raises
under ``strict=True``), and ``host_fusions=False`` switches the step off. The board path
never goes through this module.
"""

from __future__ import annotations

import onnx


def fuse_for_ort(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The region model with onnxruntime's fused operators, and the count of each fusion."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = ir.from_proto(proto)
    model, counts = optimize_for_ort(model)
    fused = ir.to_proto(model)
    # onnxruntime reads at most the IR version it was built for; keep the lowering's.
    fused.ir_version = min(fused.ir_version, proto.ir_version)
    return fused, {k: v for k, v in counts.items() if v}
