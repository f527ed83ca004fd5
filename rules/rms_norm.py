"""rms_norm: the RMSNorm of Llama, Qwen3, Mistral (and any model spelling it out) ->
``aten.rms_norm``. Off by default: a target that has an RMSNorm kernel enables it.

Before -> after: ``w * (x * rsqrt(mean(x ** 2, -1, keepdim) + eps))``, in float32 or in a
bf16/fp16 model's form (cast to float32, normalize, cast back, then ``* w``) ->
``rms_norm(x, [d], w, eps)`` (with the same casts around it).

The worked example of ``pattern_from`` (docs/writing-a-rule.md): the pattern is the function
itself, traced on a float32 and a bf16 example and normalized by the rules that canonicalize
its ops (named here: a built-in rule cannot load the plugin registry while it is being
loaded); ``square`` makes ``x * x`` and ``x ** 2.0`` match too. Does not fire when the weight
is not 1-D over the last dim.
"""

from __future__ import annotations

import torch

from fxpass.pattern import pattern_from, pattern_rule
from fxpass.rules._util import aten
from fxpass.rules.alias import alias_removal
from fxpass.rules.scalar_overloads import scalar_overloads
from fxpass.rules.square import square


def _rms(x, w, eps):  # Llama/Qwen3's LlamaRMSNorm.forward
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


RMS = pattern_from(_rms, (torch.ones(2, 8), torch.ones(8)),
                   (torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)),
                   nums=["eps"], rules=[square, scalar_overloads, alias_removal])


def _last_dim_weight(m) -> bool | str:
    x, w = m.x.meta["val"], m.w.meta["val"]
    return (w.dim() == 1 and w.shape[0] == x.shape[-1]) or "weight is not 1-D over the last dim"


@pattern_rule(RMS, name="rms_norm", check=_last_dim_weight, default=False)
def rms_norm(rw, m):
    """w * x * rsqrt(mean(x^2) + eps) -> rms_norm(x, [d], w, eps)."""
    return rw.call(aten.rms_norm.default, m.x, [m.x.meta["val"].shape[-1]], m.w, m.eps)
