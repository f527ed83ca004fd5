"""The built-in rules: a plugin like any third-party one (entry point ``fxpass: builtin_rules``).

Each rule lives in its own module whose docstring states before -> after, why, and when the
rule does not fire.
"""

from __future__ import annotations

from fxpass.rule import Rule
from fxpass.rules.alias import alias_removal
from fxpass.rules.amax_pool import amax_to_max_pool
from fxpass.rules.as_strided import as_strided_view
from fxpass.rules.bf16_promotion import bf16_cast_cancel, bf16_promotion
from fxpass.rules.clamp import clamp_to_hardtanh
from fxpass.rules.constant_folding import constant_folding
from fxpass.rules.constant_index import constant_index
from fxpass.rules.constant_pad import constant_pad
from fxpass.rules.cse import cse
from fxpass.rules.erf_gelu import erf_gelu
from fxpass.rules.functional_copy import functional_copy
from fxpass.rules.group_norm import group_norm
from fxpass.rules.im2col import im2col_to_slices
from fxpass.rules.index_put import index_put_to_copy
from fxpass.rules.kv_cache import kv_cache_update
from fxpass.rules.max_dim import max_dim_values
from fxpass.rules.new_full import new_full
from fxpass.rules.reductions import sum_to_mean, vector_norm
from fxpass.rules.repeat_cat import pointwise_before_repeat_cat
from fxpass.rules.rms_norm import rms_norm
from fxpass.rules.roll import roll_to_cat
from fxpass.rules.safe_softmax import safe_softmax
from fxpass.rules.scalar_overloads import scalar_overloads
from fxpass.rules.sdpa import sdpa_decomposition
from fxpass.rules.slice_scatter import slice_scatter_to_cat
from fxpass.rules.square import square
from fxpass.rules.stack import stack_to_cat
from fxpass.rules.unbind import unbind_to_select

ALL = (
    alias_removal,
    safe_softmax,
    sdpa_decomposition,
    scalar_overloads,
    constant_folding,
    constant_index,
    index_put_to_copy,
    kv_cache_update,
    functional_copy,
    roll_to_cat,
    stack_to_cat,
    pointwise_before_repeat_cat,
    unbind_to_select,
    max_dim_values,
    amax_to_max_pool,
    slice_scatter_to_cat,
    new_full,
    im2col_to_slices,
    constant_pad,
    group_norm,
    vector_norm,
    sum_to_mean,
    clamp_to_hardtanh,
    as_strided_view,
    erf_gelu,
    square,
    rms_norm,
    cse,
    bf16_promotion,
    bf16_cast_cancel,
)


def fxpass_rules() -> list[Rule]:
    return list(ALL)
