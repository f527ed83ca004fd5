"""The built-in rules: a plugin like any third-party one (entry point ``fxpass: builtin_rules``).

Each rule lives in its own module whose docstring states before -> after, why, and when the
rule does not fire.
"""

from __future__ import annotations

from fxpass.rule import Rule
from fxpass.rules.alias import alias_removal
from fxpass.rules.bf16_promotion import bf16_cast_cancel, bf16_promotion
from fxpass.rules.constant_folding import constant_folding
from fxpass.rules.cse import cse
from fxpass.rules.kv_cache import kv_cache_update
from fxpass.rules.safe_softmax import safe_softmax
from fxpass.rules.scalar_overloads import scalar_overloads
from fxpass.rules.sdpa import sdpa_decomposition

ALL = (
    alias_removal,
    safe_softmax,
    sdpa_decomposition,
    scalar_overloads,
    constant_folding,
    kv_cache_update,
    cse,
    bf16_promotion,
    bf16_cast_cancel,
)


def fxpass_rules() -> list[Rule]:
    return list(ALL)
