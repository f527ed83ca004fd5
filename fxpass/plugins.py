"""Plugin discovery: pluggy hookspecs are the contract, the ``fxpass`` entry point group finds them.

A plugin is a plain module with functions named after the hooks (``fxpass_rules``,
``fxpass_targets``); no decorator is needed. The built-in rules and the BPU target register
exactly this way in our own ``pyproject.toml``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from .rule import Rule

GROUP = "fxpass"
hookspec = pluggy.HookspecMarker(GROUP)
hookimpl = pluggy.HookimplMarker(GROUP)


class Hooks:
    """The hook contract every fxpass plugin may implement."""

    @hookspec
    def fxpass_rules(self) -> Sequence[Rule]:
        """Return the rules this plugin provides."""

    @hookspec
    def fxpass_targets(self) -> Sequence[Target]:
        """Return the backend targets this plugin provides."""


@dataclass(frozen=True)
class Target:
    """A backend target: which rules it wants on top of the defaults, and which it turns off."""

    name: str
    description: str = ""
    enable: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    plugin: str = "<unregistered>"


class PluginLoadWarning(UserWarning):
    """A plugin's entry point failed to import; its rules are missing, everything else loads."""


class _Manager(pluggy.PluginManager):
    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("fxpass_"):
            return {}  # plain functions named after a hook are hook implementations
        return opts


@dataclass
class Registry:
    rules: dict[str, Rule] = field(default_factory=dict)
    targets: dict[str, Target] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (entry point, error)

    def add_rules(self, rules: Iterable[Rule], source: str) -> None:
        for r in rules:
            if not isinstance(r, Rule):
                raise TypeError(f"plugin {source!r} returned {r!r} from fxpass_rules; want a Rule")
            if r.name in self.rules:
                raise ValueError(
                    f"rule name {r.name!r} is registered twice: by {self.rules[r.name].plugin!r} "
                    f"and by {source!r}. Rename one of them (names are global)."
                )
            self.rules[r.name] = dataclasses.replace(r, plugin=source)

    def add_targets(self, targets: Iterable[Target], source: str) -> None:
        for t in targets:
            if t.name in self.targets:
                raise ValueError(
                    f"target {t.name!r} is registered twice: by {self.targets[t.name].plugin!r} "
                    f"and by {source!r}"
                )
            self.targets[t.name] = dataclasses.replace(t, plugin=source)


_cache: Registry | None = None


def load(refresh: bool = False, extra: Iterable[Any] = ()) -> Registry:
    """Discover plugins through the ``fxpass`` entry point group (cached unless ``refresh``)."""
    global _cache
    if _cache is not None and not refresh and not extra:
        return _cache
    pm = _Manager(GROUP)
    pm.add_hookspecs(Hooks)
    reg = Registry()
    sources: list[tuple[Any, str]] = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
        source = f"{dist}:{ep.name}"
        try:
            mod = ep.load()
        except Exception as e:  # reported, not fatal: one broken plugin must not stop the rest
            reg.failures.append((source, f"{type(e).__name__}: {e}"))
            warnings.warn(
                f"fxpass plugin entry point {ep.name!r} ({ep.value}, from {dist}) failed to "
                f"import and was skipped: {type(e).__name__}: {e}",
                PluginLoadWarning,
                stacklevel=2,
            )
            continue
        sources.append((mod, source))
    for i, mod in enumerate(extra):
        sources.append((mod, f"<extra:{getattr(mod, '__name__', i)}>"))
    for mod, source in sources:
        if pm.is_registered(mod):
            continue
        pm.register(mod, name=source)
        for impl, name in (("fxpass_rules", "rules"), ("fxpass_targets", "targets")):
            fn = getattr(mod, impl, None)
            if fn is None:
                continue
            items = list(fn())
            (reg.add_rules if name == "rules" else reg.add_targets)(items, source)
    if not extra:
        _cache = reg
    return reg


def _names(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def select_rules(
    registry: Registry | None = None,
    *,
    target: str | None = None,
    enable: Iterable[str] | None = None,
    disable: Iterable[str] | None = None,
) -> list[Rule]:
    """The rules to run: defaults, plus/minus the target's choices, the caller's, then env.

    ``FXPASS_ENABLE`` / ``FXPASS_DISABLE`` (comma-separated names) apply last, so a user can
    switch a rule off without touching code. Unknown names are an error listing known ones.
    """
    reg = registry or load()
    on = {n for n, r in reg.rules.items() if r.default}
    steps: list[tuple[list[str], list[str]]] = []
    if target is not None:
        if target not in reg.targets:
            raise ValueError(f"unknown fxpass target {target!r}; known: {sorted(reg.targets)}")
        t = reg.targets[target]
        steps.append((list(t.enable), list(t.disable)))
    steps.append((_names(enable), _names(disable)))
    steps.append(
        (_names(os.environ.get("FXPASS_ENABLE")), _names(os.environ.get("FXPASS_DISABLE")))
    )
    for en, dis in steps:
        unknown = [n for n in en + dis if n not in reg.rules]
        if unknown:
            raise ValueError(f"unknown rule name(s) {unknown}; known rules: {sorted(reg.rules)}")
        on |= set(en)
        on -= set(dis)
    return [r for n, r in reg.rules.items() if n in on]
