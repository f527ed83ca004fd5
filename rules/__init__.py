"""The built-in rules: a plugin like any third-party one (entry point ``fxpass: builtin_rules``)."""

from __future__ import annotations

from fxpass.rule import Rule


def fxpass_rules() -> list[Rule]:
    return []
