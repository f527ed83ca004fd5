"""Plugins load the same wherever they are first imported, and a failed one is never only a
warning.

Why: the registry is often first loaded inside ``torch.compile`` (the backend selects its
rules there, under Dynamo's tracing context). A plugin that builds its pattern by example at
import (``pattern_from`` on a function using ``torch.clamp``) failed there with "Mixing fake
modes NYI", was skipped with a warning on stderr, and the compile succeeded without its rule;
the same plugin worked when ``fxpass.select_rules()`` had run first.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fxpass
from fxpass import plugins
from fxpass.plugins import PluginLoadWarning
from tests.fxpass.test_plugin_isolation import make_dist

#: a third party's plugin, by example: hardsigmoid(x) = clamp(x + 3, 0, 6) / 6, its pattern
#: traced at import (normalized by the bpu target's rules, which loads the registry re-entrantly)
BY_EXAMPLE = textwrap.dedent(
    '''
    import torch

    from fxpass.pattern import pattern_from, pattern_rule

    aten = torch.ops.aten
    HARDSIGMOID = pattern_from(lambda x: torch.clamp(x + 3, 0, 6) / 6, (torch.ones(4),),
                               target="bpu")


    @pattern_rule(HARDSIGMOID, name="tp_hardsigmoid", default=False, targets=["bpu"])
    def tp_hardsigmoid(rw, m):
        """clamp(x + 3, 0, 6) / 6 -> hardsigmoid(x), a third party's rule built by example."""
        return rw.call(aten.hardsigmoid.default, m.x)


    def fxpass_rules():
        return [tp_hardsigmoid]
    '''
)


class Scaled(torch.nn.Module):
    """A Linear, then the hardsigmoid spelled out as the plugin's pattern traced it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.proj(x) + 3, 0, 6) / 6


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty plugin registry (nothing loaded yet: the next load is the first), a fresh
    Dynamo and artifact cache; the throwaway distributions are removed afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("FXPASS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("FXPASS_BLOCK_PLUGINS", raising=False)
    monkeypatch.setenv("FXPASS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(plugins, "_cache", {})
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()
    for m in [m for m in sys.modules if m.startswith("tp_")]:
        del sys.modules[m]
    importlib.invalidate_caches()
    monkeypatch.undo()
    fxpass.load(refresh=True)


def _compile(options: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    model, x = Scaled().eval(), torch.randn(4, 16)
    compiled = torch.compile(model, backend="fxpass_bpu",
                             options={"min_compute_macs": 0, **(options or {})})
    with torch.no_grad():
        return compiled(x), model(x)


def test_a_by_example_plugin_first_imported_inside_torch_compile_fires(fresh):
    make_dist(fresh, "tp-hsig", "tp_hsig", BY_EXAMPLE)
    assert "tp_hsig" not in sys.modules  # so the backend's load is its first import
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        got, want = _compile()
    assert "tp_hsig" in sys.modules
    torch.testing.assert_close(got, want)
    report = fxpass.compile_reports()[-1]
    assert report.rewrites.get("tp_hardsigmoid") == 1, str(report)
    assert not fxpass.load().failures
    assert fxpass.load().rules["tp_hardsigmoid"].plugin == "tp-hsig:tp_hsig"


def test_a_plugin_that_fails_to_load_is_in_the_compile_report(fresh):
    make_dist(fresh, "tp-broken", "tp_broken", "raise ImportError('tp_broken needs acme')\n")
    with pytest.warns(PluginLoadWarning, match="tp_broken needs acme"):
        got, want = _compile()
    torch.testing.assert_close(got, want)
    report = fxpass.compile_reports()[-1]
    notes = [n for n in report.notes if "tp-broken:tp_broken" in n]
    assert notes and "tp_broken needs acme" in notes[0], report.notes
    assert "note: plugin(s) failed to load" in str(report)


def test_a_plugin_that_fails_to_load_fails_a_strict_compile(fresh):
    make_dist(fresh, "tp-broken", "tp_broken", "raise ImportError('tp_broken needs acme')\n")
    with pytest.warns(PluginLoadWarning), pytest.raises(Exception, match="tp-broken:tp_broken"):
        _compile({"strict": True})


def test_a_registry_loaded_during_a_plugin_import_is_not_cached(fresh):
    """A plugin loading the registry while it imports (``pattern_from(target=...)``) sees every
    plugin but itself. Cached, that registry was what the next ``load()`` returned after the
    outer load failed: the plugin's clash with a built-in rule name went silent."""
    clash = BY_EXAMPLE.replace('name="tp_hardsigmoid"', 'name="cse"')
    make_dist(fresh, "tp-clash", "tp_clash", clash)
    for _ in range(2):
        with pytest.raises(ValueError, match="'cse' is registered twice"):
            fxpass.load()
