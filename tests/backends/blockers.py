"""Simulate an install without an optional dependency, in this process.

Why: the plain install (``pip install fxpass``, no extras) has no transformers, and the
commands that need it must refuse in one line naming the extra. CI checks that install for
real (``.ci/plain_install.py``); these in-process tests check each command's message fast.
``None`` in ``sys.modules`` makes ``import transformers`` (and any submodule import) raise
``ModuleNotFoundError`` as an absent package does; ``monkeypatch`` restores the modules.
"""

from __future__ import annotations

import sys

import pytest


def block(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` and every submodule of it unimportable until the test ends."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)
