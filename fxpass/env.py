"""Every ``FXPASS_*`` environment variable the core reads, parsed and validated in one place.

A variable is read when it is used (a PassManager is built, rules are selected, plugins are
loaded, a rule runs), never at import: a bad value is then a ``ValueError`` naming the variable
and its valid values, raised where the user can see what they were doing, instead of an import
failure of whichever module happened to read it, or a typo that silently means "off".
Unset and empty mean the default.

``FXPASS_CHECK``
    ``1`` / ``true``: contract checks (lint, meta, idempotence at the fixpoint, rules that edit
    the graph behind the Rewriter's back); ``0`` / ``false`` / empty: off. Any case.
``FXPASS_REWRITE_LIMIT``
    Integer >= 0: stop after that many rewrites, to bisect a bad one; ``0`` applies none (the
    rules still run, so their skip reasons are reported). Empty: no limit. A run that stops
    at the limit warns that its result is partial.
``FXPASS_ENABLE`` / ``FXPASS_DISABLE``
    Comma-separated rule names switched on / off after the target's and the caller's choices.
``FXPASS_DISABLE_PLUGIN_AUTOLOAD``
    Flag (as ``FXPASS_CHECK``): load only fxpass's own plugins (entry points ``builtin_rules``
    and ``bpu``), ignoring every installed third-party one.
``FXPASS_BLOCK_PLUGINS``
    Comma-separated plugin entry point names not to load (``fxpass.load(block=...)`` adds to it).
``FXPASS_FOLD_MAX_GROWTH``
    Number > 0 (default 64; ``inf`` turns the guard off): constant folding refuses a fold whose
    result is more than this many times the bytes of its inputs ...
``FXPASS_FOLD_MIN_BYTES``
    ... and larger than this many bytes (integer >= 0, default 4194304 = 4 MiB).

Variables read outside the core (``FXPASS_CACHE_DIR`` / ``FXPASS_CACHE_MAX_BYTES`` by the BPU
backend, ``FXPASS_HYPOTHESIS_RANDOM`` by ``fxpass.testing``) are validated by their readers.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_FLAG_VALID = "0, 1, true, false (any case) or empty"


@dataclass(frozen=True)
class Variable:
    parse: Callable[[str], Any]  # raises ValueError(reason) on a bad (non-empty) value
    default: Any
    valid: str  # the valid values, for the error message


def _flag(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true"):
        return True
    if v in ("0", "false"):
        return False
    raise ValueError("not a flag")


def _count(raw: str) -> int:
    s = raw.strip()
    if not re.fullmatch(r"[0-9]+", s):  # int() would take "-1", "+1", "1_0", " ١ " ...
        raise ValueError("not an integer >= 0")
    return int(s)


def _names(raw: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    for n in names:
        if not n.isprintable() or any(c.isspace() for c in n):
            raise ValueError(f"{n!r} is not a name (names are separated by commas)")
    return names


def _growth(raw: str) -> float:
    v = float(raw.strip())  # ValueError for "abc"
    if math.isnan(v) or v <= 0:  # nan compares False with everything: it would disable the guard
        raise ValueError("not a number > 0")
    return v


VARIABLES: dict[str, Variable] = {
    "FXPASS_CHECK": Variable(_flag, False, _FLAG_VALID),
    "FXPASS_REWRITE_LIMIT": Variable(
        _count, None, "an integer >= 0 (0: no rewrites), or empty for no limit"
    ),
    "FXPASS_ENABLE": Variable(_names, (), "comma-separated rule names"),
    "FXPASS_DISABLE": Variable(_names, (), "comma-separated rule names"),
    "FXPASS_DISABLE_PLUGIN_AUTOLOAD": Variable(_flag, False, _FLAG_VALID),
    "FXPASS_BLOCK_PLUGINS": Variable(_names, (), "comma-separated plugin entry point names"),
    "FXPASS_FOLD_MAX_GROWTH": Variable(_growth, 64.0, "a number > 0 (inf: no limit)"),
    "FXPASS_FOLD_MIN_BYTES": Variable(_count, 4 << 20, "an integer >= 0 (a byte count)"),
}


def get(name: str) -> Any:
    """The parsed value of ``name`` (its default when unset or empty).

    Raises ``ValueError`` naming the variable, the value and the valid values.
    """
    var = VARIABLES[name]  # KeyError: a variable the core does not know is a bug, not input
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ValueError(
            f"environment variable {name}={raw!r} is invalid ({e}); valid values: {var.valid}"
        ) from None


def validate_all() -> dict[str, Any]:
    """Every variable parsed at once (for a front end that wants to fail before any work)."""
    return {name: get(name) for name in VARIABLES}
