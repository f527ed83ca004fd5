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

import threading

import onnx

# onnxscript's fusion rules are module-level objects whose matchers keep the current match on
# the instance, so two threads fusing at once corrupt each other's bindings ("check() missing
# 1 required positional argument"). Regions compile in a thread pool; the passes take
# milliseconds on a weightless model, so they run one at a time.
_FUSING = threading.Lock()


def _passes() -> list[tuple[str, object]]:
    """(name, fusion pass) in the order ``optimize_for_ort`` applies them; names are its
    count keys, so reports read the same as before."""
    from onnxscript.rewriter.ort_fusions.bias_gelu import fuse_bias_gelu
    from onnxscript.rewriter.ort_fusions.erfgelu import fuse_erfgelu
    from onnxscript.rewriter.ort_fusions.gelu import fuse_gelu
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import (
        fuse_skip_layer_normalization,
        fuse_skip_rms_normalization,
    )

    from fxpass.backends.bpu.attention import fuse_attention

    return [
        ("attention", fuse_attention),
        ("erf_gelu", fuse_erfgelu),
        ("rms_normalization", fuse_rms_normalization),
        ("skip_layer_normalization", fuse_skip_layer_normalization),
        ("skip_rms_normalization", fuse_skip_rms_normalization),
        ("gelu", fuse_gelu),
        ("bias_gelu", fuse_bias_gelu),
    ]


def fuse_for_ort(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The region model with onnxruntime's fused operators, and the count of each fusion."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    model = ir.from_proto(proto)
    with _FUSING:
        counts = {name: fuse(model) for name, fuse in _passes()}
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
    fused = ir.to_proto(model)
    # onnxruntime reads at most the IR version it was built for; keep the lowering's.
    fused.ir_version = min(fused.ir_version, proto.ir_version)
    return fused, {k: v for k, v in counts.items() if v}
