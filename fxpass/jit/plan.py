"""The whole backend result, cached: a warm process skips the rules, the partitioner and lowering.

Why: in a warm process every region artifact was already on disk, yet the backend still ran the
rules to fixpoint, partitioned, extracted and keyed each region (hashing its weights) before it
could look the artifact up. The *plan* is what those steps produce: the spliced graph (the CPU
remainder plus one call per region), each region's artifact key and call signature, and the
compile report's numbers. It is filed under a key of the captured graph itself
(:func:`graph_key`), computed before any rule runs:

- the aten graph as handed over by AOTAutograd: every node's op, name, target, arguments (node
  arguments such as eps, dims and strides) and output shape/dtype, and the inputs' strides;
- a full digest of every frozen weight and graph constant (memoized per process, see
  ``digest.py``), and which inputs are frozen;
- the options (the framework's and the device's, but for those that change no artifact) and,
  for a device that runs on the host CPU, the CPU fingerprint;
- the rule set: each selected rule's name, plugin distribution and version, priority, roots
  and the digest of the source module of its function (an edited plugin misses);
- the source of the core (``fxpass``), the device's identity (its tool versions and the
  digest of its own source) and the core's tool versions (fxpass, torch).

Anything the encoder does not know (a symbolic size, an unknown argument type, an unknown
``call_module``) means no plan for that graph: it compiles cold, as before. The plan is stored
as JSON (no pickle) plus the CPU remainder's own constants through ``torch.save`` and loaded
with ``weights_only=True``; plans whose constants exceed :data:`MAX_CONSTANT_BYTES` are not
stored. A region that fails at run time on a plan hit rebuilds its eager graph on demand
(``RegionCall``'s lazy fallback), so fallback semantics do not depend on the cache.
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Graph, GraphModule, Node

from fxpass import env
from fxpass.graph import FROZEN
from fxpass.jit.cache import host_cpu_fingerprint, tool_versions
from fxpass.jit.digest import hasher, rule_identity, source_digest, tensor_digest

if TYPE_CHECKING:  # load() decodes plans; options.py imports the lowering (onnx, the rules)
    from fxpass.jit.options import Options

PLAN_VERSION = "2"  # 2: CPU nodes sunk before partitioning; inline fake-value fix
#: The CPU remainder's constants a plan may hold. Under BF16 promotion the remainder holds an
#: f32 copy of the embedding table (125 MiB for a 32000 x 1024 vocabulary), which a 64 MiB
#: bound refused; reading it back is far cheaper than re-running the rules.
MAX_CONSTANT_BYTES = 512 * 1024**2
#: environment variables that change what the rules make of a graph
_KEYED_ENV = ("FXPASS_REWRITE_LIMIT", "FXPASS_FOLD_MAX_GROWTH", "FXPASS_FOLD_MIN_BYTES")


class Unencodable(Exception):
    """This graph holds something the plan cannot write down; it compiles without a plan."""


def _target(t: Any) -> str:
    if isinstance(t, torch._ops.OpOverload):
        s = f"op:{t.namespace}.{t._schema.name.split('::', 1)[-1]}.{t._overloadname}"
    elif isinstance(t, torch._ops.OpOverloadPacket):
        s = f"packet:{t._qualified_op_name.replace('::', '.')}"
    elif callable(t) and getattr(t, "__module__", None) and getattr(t, "__qualname__", None):
        s = f"py:{t.__module__}:{t.__qualname__}"
    else:
        raise Unencodable(f"call target {t!r}")
    if resolve_target(s) is not t:
        raise Unencodable(f"call target {t!r} does not resolve back to itself")
    return s


def resolve_target(s: str) -> Any:
    kind, _, rest = s.partition(":")
    if kind in ("op", "packet"):
        obj: Any = torch.ops
        for part in rest.split("."):
            obj = getattr(obj, part)
        return obj
    if kind == "py":
        mod, _, qual = rest.partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    raise ValueError(f"unknown target kind in plan: {s!r}")


def enc(a: Any) -> Any:
    """JSON form of an FX argument; raises :class:`Unencodable` for anything unknown."""
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return {"f": repr(a)}  # exact, including inf and nan
    if isinstance(a, Node):
        return {"n": a.name}
    if isinstance(a, (list, tuple)):
        return {"l" if isinstance(a, list) else "t": [enc(x) for x in a]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, (torch.memory_format, torch.layout)):
        return {"torch": str(a).removeprefix("torch.")}
    if isinstance(a, slice):
        return {"slice": [enc(a.start), enc(a.stop), enc(a.step)]}
    if isinstance(a, dict) and all(isinstance(k, str) for k in a):
        return {"d": [[k, enc(v)] for k, v in a.items()]}
    raise Unencodable(f"argument of type {type(a).__name__}")


def dec(a: Any, env: dict[str, Node]) -> Any:
    if not isinstance(a, dict):
        return a
    ((k, v),) = a.items()
    if k == "f":
        return float(v)
    if k == "n":
        return env[v]
    if k == "l":
        return [dec(x, env) for x in v]
    if k == "t":
        return tuple(dec(x, env) for x in v)
    if k == "dtype":
        return getattr(torch, v)
    if k == "device":
        return torch.device(v)
    if k == "torch":
        return getattr(torch, v)
    if k == "slice":
        return slice(*(dec(x, env) for x in v))
    if k == "d":
        return {kk: dec(vv, env) for kk, vv in v}
    raise ValueError(f"unknown argument form in plan: {a!r}")


def _val(v: Any, stride: bool = False) -> Any:
    if isinstance(v, torch.Tensor):
        for s in (*v.shape, *(v.stride() if stride else ())):
            if not isinstance(s, int):
                raise Unencodable("symbolic size")
        return [list(v.shape), str(v.dtype)] + ([list(v.stride())] if stride else [])
    if isinstance(v, (tuple, list)):
        return [_val(x) for x in v]
    if v is None or isinstance(v, (bool, int, float)):
        return repr(v)
    raise Unencodable(f"node value of type {type(v).__name__}")


def graph_key(gm: GraphModule, opts: Options, rules: list[Any], device: Any) -> str:
    """The key of the backend's whole result for this captured graph (see the module doc).

    Raises :class:`Unencodable` when the graph cannot be keyed faithfully.
    """
    h = hasher()
    h.update(f"plan{PLAN_VERSION}|{device.name}|".encode())
    for n in gm.graph.nodes:
        target = _target(n.target) if n.op == "call_function" else n.target
        if n.op in ("call_module", "call_method"):
            raise Unencodable(f"{n.op} node {n.name}")
        row = [n.op, n.name, target, enc(n.args), enc(n.kwargs)]
        row.append(_val(n.meta.get("val"), stride=n.op == "placeholder"))
        if n.op == "placeholder" and FROZEN in n.meta:
            row.append(tensor_digest(n.meta[FROZEN]))
        elif n.op == "get_attr":
            t = getattr(gm, n.target) if "." not in n.target else gm.get_parameter(n.target)
            if not isinstance(t, torch.Tensor):
                raise Unencodable(f"get_attr {n.target} is a {type(t).__name__}")
            row.append(tensor_digest(t))
        h.update(json.dumps(row).encode())
    keyed = opts.keyed()
    context = {
        "options": keyed,
        "rules": [rule_identity(r) for r in rules],
        # what else changes the rules' result: a bisection's limit (a plan made under it is
        # partial) and constant folding's bounds (found by a probe: FXPASS_REWRITE_LIMIT=0
        # over a warm cache loaded the unlimited plan)
        "env": {name: env.get(name) for name in _KEYED_ENV},
        "source": source_digest("fxpass"),
        "device": device.identity(opts.dev),
        "tools": tool_versions(),
        "host_cpu": host_cpu_fingerprint() if device.runs_on_host(opts.dev) else None,
    }
    h.update(json.dumps(context, sort_keys=True, default=str).encode())
    return h.hexdigest()


def encode(out: GraphModule, regions: list[dict[str, Any]], report: dict) -> tuple[bytes, bytes]:
    """The plan of a spliced graph: (JSON bytes, constants as ``torch.save`` bytes).

    ``regions`` maps each ``call_module`` target to what rebuilding its call needs.
    """
    by_module = {r["module"]: r for r in regions}
    nodes, consts, size = [], {}, 0
    for n in out.graph.nodes:
        if n.op == "call_function":
            target: Any = _target(n.target)
        elif n.op == "call_module":
            if n.target not in by_module:
                raise Unencodable(f"call_module {n.target}")
            target = n.target
        elif n.op == "get_attr":
            t = getattr(out, n.target, None) if "." not in n.target else None
            if not isinstance(t, torch.Tensor):
                raise Unencodable(f"get_attr {n.target}")
            consts[n.target] = t.detach()
            size += t.numel() * t.element_size()
            target = n.target
        elif n.op in ("placeholder", "output"):
            target = n.target
        else:
            raise Unencodable(f"{n.op} node {n.name}")
        nodes.append([n.op, n.name, target, enc(n.args), enc(n.kwargs)])
    if size > MAX_CONSTANT_BYTES:
        raise Unencodable(f"CPU constants of {size / 2**20:.0f} MiB")
    buf = io.BytesIO()
    torch.save(consts, buf)
    plan = {"version": PLAN_VERSION, "nodes": nodes, "regions": regions, "report": report}
    return json.dumps(plan).encode(), buf.getvalue()


def decode(plan: dict, consts: bytes, calls: dict[str, torch.nn.Module]) -> GraphModule:
    """Rebuild the spliced graph from a plan; ``calls`` maps module names to region calls."""
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(f"plan version {plan.get('version')!r}, not {PLAN_VERSION}")
    # inside a compile, torch.load sees the compile's fake mode (via the tracing context) and
    # maps every storage to "meta": load outside it, or the constants have no data
    with torch._guards.tracing(None):
        tensors = torch.load(io.BytesIO(consts), weights_only=True)
    root = torch.nn.Module()
    for name, mod in calls.items():
        root.add_module(name, mod)
    g = Graph()
    env: dict[str, Node] = {}
    for op, name, target, args, kwargs in plan["nodes"]:
        a, kw = dec(args, env), dec(kwargs, env)
        if op == "output":
            g.output(a[0])
            continue
        if op == "get_attr":
            root.register_buffer(target, tensors[target], persistent=False)
        elif op == "call_function":
            target = resolve_target(target)
        env[name] = g.create_node(op, target, a, kw, name=name)
    return GraphModule(root, g)


def region_entry(module: str, rid: int, name: str, c: Any, rg: Any, r: Any) -> dict[str, Any]:
    """What a plan keeps of one compiled region (``c``: compile.Compiled; ``rg``: RegionGraph;
    ``r``: partition.Region)."""
    phs = rg.gm.graph.find_nodes(op="placeholder")
    (out,) = rg.gm.graph.find_nodes(op="output")
    outs = [a.meta.get("val") if isinstance(a, Node) else None for a in out.args[0]]
    return {
        "module": module,
        "rid": rid,
        "name": name,
        "key": c.key,
        "input_names": [p.name for p in phs],
        "expected": [[list(p.meta["val"].shape), str(p.meta["val"].dtype)] for p in phs],
        "out_shapes": [list(v.shape) if isinstance(v, torch.Tensor) else None for v in outs],
        "nodes": len(r.nodes),
        "macs": r.macs,
        "inputs": len(rg.inputs),
        "outputs": len(rg.outputs),
        "fusions": c.fusions,
        "offloaded_call_nodes": sum(1 for n in r.nodes if n.target is not operator.getitem),
        # region weight attribute -> the captured graph's placeholder (the plan key covers
        # the placeholders, so a hit binds each attribute to this graph's tensor)
        "sources": dict(rg.sources),
    }


def load(
    cache: Any, key: str, opts: Options, frozen: dict[str, torch.Tensor],
    rebuild: Callable[[int], GraphModule] | None = None,
) -> tuple[dict, list[tuple[dict, Any]]] | None:
    """The stored plan and each region's loaded artifact (``compile.Compiled``), or None.

    Any missing, evicted or unreadable part is a miss: the graph compiles cold and the plan is
    written again. Never an error, never a partial plan. ``rebuild(rid)``: region ``rid``'s
    graph made again, for a device that must remake a part of its artifact (``Region``).
    """
    from fxpass.device import Context, Region

    device = opts.get_device()
    ctx = Context(opts, opts.dev, cache)
    data = cache.get(key, ".plan.json")
    consts = cache.get(key, ".plan.pt") if data is not None else None
    if data is None or consts is None:
        return None
    try:
        plan = json.loads(data)
        plan["_consts"] = consts  # decode() loads them with weights_only=True
        loaded = []
        for r in plan["regions"]:
            weights = {c: frozen[p] for c, p in r["sources"].items()}  # plans before: a miss
            again = functools.partial(rebuild, r["rid"]) if rebuild is not None else None
            c = device.reopen(Region(None, r["name"], r["key"], r["input_names"], r["sources"],
                                     rebuild=again), weights, ctx)
            if c is None:
                return None
            loaded.append((r, c))
    except (ValueError, KeyError, TypeError):
        return None
    return plan, loaded


def store(cache: Any, key: str, out: GraphModule, regions: list[dict], report: dict) -> bool:
    """Write the plan of ``out`` under ``key``; False when it cannot be encoded or written."""
    try:
        data, consts = encode(out, regions, report)
    except Unencodable:
        return False
    keep = tuple(r["key"] for r in regions)  # the size bound must not evict what it names
    if cache.put(key, ".plan.pt", consts, keep=keep) is None:
        return False
    return cache.put(key, ".plan.json", data, keep=keep) is not None


def key_for(gm: GraphModule, opts: Options, rules: list, device: Any, cache: Any) -> str | None:
    """The plan key, or None when plans do not apply: no cache, a device (or device options)
    that cannot reopen regions from the cache (``Device.plans``: quantized regions calibrate
    at run time from the float lowering) or a graph it cannot encode."""
    if cache is None or not device.plans(opts.dev):
        return None
    try:
        return graph_key(gm, opts, rules, device)
    except Unencodable:
        return None


def apply(
    cache: Any,
    key: str,
    opts: Options,
    report: Any,
    rebuild: Callable[[int], GraphModule],
    gm: GraphModule,
) -> GraphModule | None:
    """The spliced graph from a stored plan, its report filled in; None on a miss.

    ``rebuild(rid)`` returns region ``rid``'s eager graph; a region call uses it only if its
    executor fails at run time. ``gm`` is the captured graph: its frozen weights are what the
    regions read in place.
    """
    from fxpass.jit.report import RegionReport
    from fxpass.jit.runtime import RegionCall

    frozen = {p.name: p.meta[FROZEN] for p in gm.graph.find_nodes(op="placeholder")
              if FROZEN in p.meta}
    got = load(cache, key, opts, frozen, rebuild)
    if got is None:
        return None
    plan, loaded = got
    calls: dict[str, torch.nn.Module] = {}
    regions = []
    try:
        for r, c in loaded:
            name = f"g{report.graph}_r{r['rid']}"
            expected = [
                torch.empty(shape, dtype=getattr(torch, dt.removeprefix("torch.")), device="meta")
                for shape, dt in r["expected"]
            ]
            outs = [torch.Size(s) if s is not None else None for s in r["out_shapes"]]
            calls[r["module"]] = RegionCall(
                name,
                c.executor,
                functools.partial(rebuild, r["rid"]),
                expected,
                strict=opts.strict,
                out_shapes=outs,
            )
            regions.append(
                RegionReport(
                    name,
                    r["nodes"],
                    r["macs"],
                    r["inputs"],
                    r["outputs"],
                    report.executor,
                    True,
                    fusions=c.fusions,
                    source=cache.record(c.key or r["key"], True),
                    executor_ref=c.executor,
                )
            )
            report.offloaded_call_nodes += r["offloaded_call_nodes"]
            report.offloaded_macs += r["macs"]
        out = decode(plan, plan["_consts"], calls)
    except Exception:  # noqa: BLE001 - an unreadable plan is a miss: compile cold, rewrite it
        return None
    rep = plan["report"]
    report.regions = regions
    report.call_nodes, report.macs = rep["call_nodes"], rep["macs"]
    report.cpu_reasons, report.dropped = dict(rep["cpu_reasons"]), list(rep["dropped"])
    report.rewrites = dict(rep["rewrites"])
    report.notes.append("plan loaded from the cache: rules, partitioner and lowering skipped")
    return out


def report_fields(report: Any) -> dict:
    """The parts of a GraphReport a plan hit restores."""
    return {
        "call_nodes": report.call_nodes,
        "macs": report.macs,
        "cpu_reasons": report.cpu_reasons,
        "dropped": report.dropped,
        "rewrites": report.rewrites,
    }
