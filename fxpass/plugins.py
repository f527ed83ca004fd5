"""Plugin discovery: pluggy hookspecs are the contract, the ``fxpass`` entry point group finds them.

A plugin is a plain module with functions named after the hooks (``fxpass_rules``,
``fxpass_targets``, ``fxpass_commands``); no decorator is needed. The built-in rules and the
BPU target (with its ``demo`` and ``explain`` commands) register exactly this way in our own
``pyproject.toml``.

One broken third-party plugin must not break every ``fxpass.load()`` (and with it the
built-ins): a plugin that fails to import (``SystemExit`` included, ``KeyboardInterrupt``
not), whose hook raises or returns something other than a list of :class:`Rule` /
:class:`Target`, whose hook has the wrong signature, or that defines an unknown ``fxpass_*``
function (a misspelled hook, which pluggy's ``check_pending`` reports) is skipped as a whole
with a :class:`PluginLoadWarning` naming its distribution and entry point, and recorded in
``Registry.failures``. Two plugins registering the same rule or target name remain an error:
which one the user meant is ambiguous.

Where a plugin is first imported must not change what it contributes: the registry is often
first loaded inside ``torch.compile`` (the backend selects its rules there), under Dynamo's
tracing context and fake mode. Plugins are imported and their hooks called under
:func:`fxpass.tracing.clean_mode`, so a module that traces at import (``pattern_from``) or builds
constant tensors gets real tensors and a fresh fake mode, as at top level. A plugin module that
itself loads the registry while it imports (``pattern_from(..., target=...)`` does) gets every
plugin but itself (half imported, it has no hooks yet); that inner registry is not cached.

Switching plugins off: ``FXPASS_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the ``fxpass``
distribution's own entry points (``builtin_rules``, ``bpu``); ``FXPASS_BLOCK_PLUGINS=a,b`` and
``fxpass.load(block=("a", "b"))`` skip plugins by entry point name (an unknown name warns,
listing the known ones). Both variables are validated by :mod:`fxpass.env`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from . import env
from .device import Device, DeviceError, check_device
from .rule import Rule
from .tracing import clean_mode

GROUP = "fxpass"
hookspec = pluggy.HookspecMarker(GROUP)
hookimpl = pluggy.HookimplMarker(GROUP)


class Hooks:
    """The hook contract every fxpass plugin may implement."""

    @hookspec
    def fxpass_rules(self) -> Sequence[Rule]:
        """Return the rules this plugin provides."""

    @hookspec
    def fxpass_commands(self) -> Sequence[Command]:
        """Return the ``fxpass`` CLI subcommands this plugin provides."""

    @hookspec
    def fxpass_targets(self) -> Sequence[Target]:
        """Return the backend targets this plugin provides."""

    @hookspec
    def fxpass_devices(self) -> Sequence[Any]:
        """Return the devices (:class:`fxpass.device.Device` instances) this plugin provides."""


@dataclass(frozen=True)
class Target:
    """A backend target: which rules it wants on top of the defaults, and which it turns off.

    A target's rule set is: every rule that is on by default, plus the rules it names in
    ``enable``, plus every rule carrying one of ``enable_tags``, plus every rule that names
    the target in its own ``targets`` (how a third-party plugin joins a target it does not
    own), minus the rules named in ``disable``. The user's ``enable=``/``disable=``/``only=``
    and ``FXPASS_ENABLE``/``FXPASS_DISABLE`` apply after that (:func:`select_rules`).
    """

    name: str
    description: str = ""
    enable: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    plugin: str = "<unregistered>"
    enable_tags: tuple[str, ...] = ()

    def selects(self, r: Rule) -> bool:
        """Whether this target turns ``r`` on (before user switches)."""
        if r.name in self.disable:
            return False
        return (
            r.default
            or r.name in self.enable
            or bool(r.tags & set(self.enable_tags))
            or self.name in r.targets
        )


@dataclass(frozen=True)
class Command:
    """A ``fxpass NAME`` subcommand contributed by a plugin (the core CLI imports no backend).

    ``arguments(parser)`` adds the command's arguments; ``run(args)`` returns the exit code.
    """

    name: str
    help: str
    arguments: Callable[[Any], None]
    run: Callable[[Any], int]
    plugin: str = "<unregistered>"


class PluginLoadWarning(UserWarning):
    """A plugin failed to import or its hooks failed; it was skipped, everything else loads.
    Also: a blocked plugin name that no entry point has."""


class _PluginError(Exception):
    """A plugin's hook broke the hook contract (the message says how)."""


class _Manager(pluggy.PluginManager):
    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if (
            opts is None
            and name.startswith("fxpass_")
            and inspect.isroutine(getattr(plugin, name, None))
        ):
            return {}  # plain functions named after a hook are hook implementations
        return opts


@dataclass
class Registry:
    rules: dict[str, Rule] = field(default_factory=dict)
    targets: dict[str, Target] = field(default_factory=dict)
    commands: dict[str, Command] = field(default_factory=dict)
    devices: dict[str, Any] = field(default_factory=dict)  # name -> fxpass.device.Device
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
        _add(self.targets, "target", targets, source)

    def add_commands(self, commands: Iterable[Command], source: str) -> None:
        _add(self.commands, "fxpass command", commands, source)

    def add_devices(self, devices: Iterable[Any], source: str) -> None:
        for d in devices:
            if d.name in self.devices:
                raise ValueError(f"device {d.name!r} is registered twice: by "
                                 f"{self.devices[d.name].plugin!r} and by {source!r}")
            d.plugin = source
            self.devices[d.name] = d


def _add(table: dict[str, Any], what: str, items: Iterable[Any], source: str) -> None:
    """Register named items from ``source``; a name taken by another plugin is an error."""
    for item in items:
        if item.name in table:
            raise ValueError(
                f"{what} {item.name!r} is registered twice: by {table[item.name].plugin!r} "
                f"and by {source!r}"
            )
        table[item.name] = dataclasses.replace(item, plugin=source)


_cache: dict[tuple[bool, frozenset[str]], Registry] = {}  # per (autoload off, blocked)
#: per thread: how many load() calls are running (more than one: a plugin loading the registry
#: while it is imported, whose registry lacks that plugin and must not be cached)
_loading = threading.local()
_HOOKS = (("fxpass_rules", Rule), ("fxpass_targets", Target), ("fxpass_commands", Command),
          ("fxpass_devices", object))


def _is_own(dist: str) -> bool:
    return re.sub(r"[-_.]+", "-", dist).lower() == "fxpass"


def _call_hook(pm: pluggy.PluginManager, plugin: Any, hook: str, kind: type) -> list[Any]:
    """Call one plugin's implementation of ``hook`` through pluggy; check what it returned.

    ``subset_hook_caller`` keeps the other plugins out, so an exception or a bad return value
    is attributed to this plugin alone.
    """
    caller = getattr(pm.hook, hook)
    if not any(impl.plugin is plugin for impl in caller.get_hookimpls()):
        return []
    others = [p for p in pm.get_plugins() if p is not plugin]
    results = pm.subset_hook_caller(hook, remove_plugins=others)()
    if not results:  # pluggy drops None results
        raise _PluginError(f"{hook}() returned None; want a list of {kind.__name__}")
    value = results[0]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _PluginError(
            f"{hook}() returned a {type(value).__name__} ({value!r:.80}); "
            f"want a list of {kind.__name__}"
        )
    items = list(value)
    for item in items:
        if not isinstance(item, kind):
            raise _PluginError(
                f"{hook}() returned {item!r:.80} ({type(item).__name__}) in its list; "
                f"want {kind.__name__} objects"
            )
    return items


def _collect(pm: pluggy.PluginManager, plugin: Any, source: str) -> tuple[list, ...]:
    """Register ``plugin`` and call its hooks; on any failure it is unregistered again, so a
    plugin contributes everything or nothing."""
    try:
        pm.register(plugin, name=source)  # PluginValidationError: a hook's signature is wrong
        try:
            pm.check_pending()  # an fxpass_* function matching no hook: a misspelled hook name
        except pluggy.PluginValidationError as e:
            hooks = ", ".join(name for name, _ in _HOOKS)
            raise _PluginError(f"{e} (a misspelled hook name? fxpass hooks: {hooks})") from e
        rules = _call_hook(pm, plugin, "fxpass_rules", Rule)
        targets = _call_hook(pm, plugin, "fxpass_targets", Target)
        commands = _call_hook(pm, plugin, "fxpass_commands", Command)
        devices = [check_device(d) for d in _call_hook(pm, plugin, "fxpass_devices", Device)]
    except BaseException:
        if pm.is_registered(plugin):  # also when register() failed half-way through its hooks
            pm.unregister(plugin)
        raise
    return rules, targets, commands, devices


def _fail(reg: Registry, source: str, where: str, what: str, e: BaseException) -> None:
    detail = str(e) if isinstance(e, _PluginError) else f"{type(e).__name__}: {e}"
    reg.failures.append((source, detail))
    warnings.warn(
        f"fxpass plugin {where} {what} and was skipped: {detail}",
        PluginLoadWarning,
        stacklevel=4,
    )


def load(
    refresh: bool = False, extra: Iterable[Any] = (), block: Iterable[str] | None = None
) -> Registry:
    """Discover plugins through the ``fxpass`` entry point group (cached unless ``refresh``).

    ``block`` (and env ``FXPASS_BLOCK_PLUGINS``) names entry points not to load;
    ``FXPASS_DISABLE_PLUGIN_AUTOLOAD=1`` loads only fxpass's own. ``extra`` modules are
    registered as plugins too (never cached). The cache is kept per configuration.
    """
    autoload_off = env.get("FXPASS_DISABLE_PLUGIN_AUTOLOAD")
    blocked_arg, blocked_env = _names(block), list(env.get("FXPASS_BLOCK_PLUGINS"))
    blocked = {*blocked_arg, *blocked_env}
    key = (autoload_off, frozenset(blocked))
    if refresh:
        _cache.clear()
    extra = list(extra)
    if key in _cache and not extra:
        return _cache[key]
    depth = getattr(_loading, "depth", 0)
    _loading.depth = depth + 1
    try:
        with clean_mode():
            reg = _load(autoload_off, blocked, blocked_arg, blocked_env, extra)
    finally:
        _loading.depth = depth
    if not extra and depth == 0:
        _cache[key] = reg
    return reg


def _load(
    autoload_off: bool, blocked: set[str], blocked_arg: list[str], blocked_env: list[str],
    extra: list[Any],
) -> Registry:
    """One discovery (see :func:`load`): import the entry points, register and call hooks."""
    pm = _Manager(GROUP)
    pm.add_hookspecs(Hooks)
    reg = Registry()
    eps = sorted(entry_points(group=GROUP), key=lambda e: e.name)
    known = sorted({ep.name for ep in eps})
    for names, how in (
        (blocked_arg, "fxpass.load(block=...)"),
        (blocked_env, "FXPASS_BLOCK_PLUGINS"),
    ):
        unknown = [b for b in names if b not in known]
        if unknown:
            warnings.warn(
                f"{how} names no installed fxpass plugin: {unknown}; known plugin entry "
                f"points: {known}",
                PluginLoadWarning,
                stacklevel=3,
            )
    sources: list[tuple[Any, str, str]] = []
    for ep in eps:
        dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
        source = f"{dist}:{ep.name}"
        if ep.name in blocked or (autoload_off and not _is_own(dist)):
            continue
        where = f"entry point {ep.name!r} ({ep.value}, from distribution {dist!r})"
        try:
            mod = ep.load()
        except (Exception, SystemExit) as e:  # one broken plugin must not stop the rest
            _fail(reg, source, where, "failed to import", e)
            continue
        sources.append((mod, source, where))
    for i, mod in enumerate(extra):
        name = getattr(mod, "__name__", i)
        sources.append((mod, f"<extra:{name}>", f"module {name!r} (passed as extra)"))
    for mod, source, where in sources:
        if pm.is_registered(mod):
            continue
        try:
            rules, targets, commands, devices = _collect(pm, mod, source)
        except (Exception, SystemExit) as e:
            _fail(reg, source, where, "broke the hook contract", e)
            continue
        reg.add_rules(rules, source)  # duplicate names across plugins: a ValueError, as before
        reg.add_targets(targets, source)
        reg.add_commands(commands, source)
        reg.add_devices(devices, source)
    return reg


def _failed_plugins(reg: Registry) -> str:
    """The plugins that failed to load: the likely reason a name is unknown."""
    if not reg.failures:
        return ""
    return "; plugins that failed to load: " + "; ".join(f"{s}: {e}" for s, e in reg.failures)


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
    only: Iterable[str] | None = None,
) -> list[Rule]:
    """The rules to run: defaults, plus/minus the target's choices, the caller's, then env.

    ``target`` applies :meth:`Target.selects` (its enable list and tags, and rules that join
    it). ``only`` replaces all of that with exactly the named rules (the target's and the
    defaults are ignored; ``disable`` and ``FXPASS_DISABLE`` still apply, ``enable`` with
    ``only`` is an error). ``FXPASS_ENABLE`` / ``FXPASS_DISABLE`` (comma-separated names)
    apply last, so a user can switch a rule off without touching code. Unknown names are an
    error naming where they came from and listing the known ones.
    """
    reg = registry or load()

    def known(names: list[str], source: str) -> list[str]:
        unknown = [n for n in names if n not in reg.rules]
        if unknown:
            raise ValueError(
                f"unknown rule name(s) {unknown} in {source}; known rules: {sorted(reg.rules)}"
                + _failed_plugins(reg)
            )
        return names

    if target is not None and target not in reg.targets:
        raise ValueError(
            f"unknown fxpass target {target!r}; known: {sorted(reg.targets)}" + _failed_plugins(reg)
        )
    if only is not None:
        only = known(_names(only), "only=")
        if _names(enable):
            raise ValueError(
                "only= and enable= together: only= already names every rule that runs; "
                "add the rules to only= instead"
            )
        on = set(only)
    elif target is not None:
        t = reg.targets[target]
        known(list(t.enable) + list(t.disable), f"target {t.name!r} ({t.plugin})")
        on = {n for n, r in reg.rules.items() if t.selects(r)}
    else:
        on = {n for n, r in reg.rules.items() if r.default}
    steps = [
        (_names(enable), _names(disable), "enable=", "disable="),
        (
            list(env.get("FXPASS_ENABLE")),
            list(env.get("FXPASS_DISABLE")),
            "FXPASS_ENABLE",
            "FXPASS_DISABLE",
        ),
    ]
    for en, dis, en_from, dis_from in steps:
        on |= set(known(en, en_from))
        on -= set(known(dis, dis_from))
    return [r for n, r in reg.rules.items() if n in on]


def get_device(name: str | Device, plugin: str | None = None) -> Device:
    """The installed device called ``name``; an error names the plugin to install.

    ``plugin`` (``dist:entry_point``, as a package records it): that entry point is imported
    alone first, so a deployed process that loads a package never imports the rule set or
    other plugins; the whole registry is asked only when that one has no such device."""
    if isinstance(name, Device):
        return name
    found = _from_one_plugin(name, plugin) if plugin else None
    if found is not None:
        return found
    reg = load()
    if name not in reg.devices:
        failed = "".join(f"; plugin {s} failed to load: {e}" for s, e in reg.failures)
        raise DeviceError(f"fxpass device {name!r} is not installed (installed: "
                          f"{sorted(reg.devices)}); install the plugin that provides it"
                          f"{failed}")
    return reg.devices[name]


def _from_one_plugin(name: str, plugin: str) -> Device | None:
    """Device ``name`` from the one entry point ``plugin`` names, or None: not installed,
    blocked (``FXPASS_BLOCK_PLUGINS``, ``FXPASS_DISABLE_PLUGIN_AUTOLOAD``), broken (the full
    registry then reports it) or providing no such device."""
    dist, _, ep_name = plugin.partition(":")
    if (not ep_name or ep_name in env.get("FXPASS_BLOCK_PLUGINS")
            or (env.get("FXPASS_DISABLE_PLUGIN_AUTOLOAD") and not _is_own(dist))):
        return None
    for ep in entry_points(group=GROUP, name=ep_name):
        if getattr(getattr(ep, "dist", None), "name", None) not in (dist, None):
            continue
        try:
            hook = getattr(ep.load(), "fxpass_devices", None)
            found = [d for d in (hook() if hook else []) if getattr(d, "name", None) == name]
            if found:
                return check_device(found[0])
        except Exception:  # noqa: BLE001 - the registry reports a broken plugin in full
            return None
    return None
