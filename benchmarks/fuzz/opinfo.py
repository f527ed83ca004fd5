"""The OpInfo sweep: PyTorch's own sample inputs for every op, through the backend.

Each sample runs as ``op(matmul_prefix(x), *args, **kwargs)``: the matmul (``x @ I``, exact
for finite values) gives the region compute, so with ``min_compute_macs=0`` the op is
offloaded whenever the BPU table takes it. Only float32 samples, up to ``samples`` per op.
``aot_eager`` is the control: a mismatch or crash that also happens under ``aot_eager``
belongs to PyTorch's compile stack and is listed separately, not counted against fxpass.
Random and uninitialized-memory ops (bernoulli, empty, ...) are skipped: no two runs agree.
"""

from __future__ import annotations

import json
import re
import signal
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from benchmarks.fuzz.check import compare

#: Prefixes of ops whose result is random or uninitialized memory (no two runs agree).
RANDOM = ("bernoulli", "normal", "uniform", "rand", "randn", "randint", "multinomial",
          "empty", "new_empty", "nn.functional.dropout", "nn.functional.alpha_dropout",
          "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "exponential",
          "geometric", "cauchy", "log_normal", "randint_like", "rand_like", "randn_like",
          "nn.functional.fractional_max_pool", "torch._refs.rand", "svd_lowrank",
          "pca_lowrank", "nonzero_static", "unique")
TIMEOUT = 60  # seconds per sample; a hang is counted as skipped, not hidden


def prefix(x: torch.Tensor) -> torch.Tensor:
    """``x @ I`` in x's shape: a matmul in front of the op, exact for finite x."""
    k = x.shape[-1] if x.dim() else 1
    return (x.reshape(-1, k) @ torch.eye(k, dtype=x.dtype)).reshape(x.shape)


def make_fn(op: Any, spec: Any, first: int | None) -> Any:
    def fn(*leaves: Any) -> Any:
        leaves = list(leaves)
        if first is not None:
            leaves[first] = prefix(leaves[first])
        inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
        return op(inp, *args, **kwargs)

    return fn


def _call(fn: Any, leaves: list, backend: str | None, options: dict | None = None) -> Any:
    args = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
    if backend is None:
        return fn(*args)
    torch._dynamo.reset()
    kw = {"options": options} if options else {}
    c = torch.compile(fn, backend=backend, dynamic=False, **kw)
    return c(*args)


def _same(a: Any, b: Any) -> str | None:
    try:
        return compare(pytree.tree_leaves(a), pytree.tree_leaves(b))[0]
    except Exception as e:  # noqa: BLE001 - e.g. a dtype torch cannot compare
        return f"cannot compare: {type(e).__name__}: {e}"


class _Timeout(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise _Timeout()


def sweep(samples: int, shard: tuple[int, int] = (0, 1), max_ops: int | None = None,
          checkpoint: Path | None = None, first_sample: int = 0) -> dict:
    """Run the sweep; returns counts, findings and the ops that are PyTorch's."""
    from torch.testing._internal.common_methods_invocations import op_db

    import fxpass

    k, n = shard
    ops = sorted((o for o in op_db if torch.float32 in o.supported_dtypes("cpu")),
                 key=lambda o: (o.name, o.variant_test_name))
    if max_ops is not None:
        ops = ops[:: max(1, len(ops) // max_ops)][:max_ops]
    ops = ops[k::n]
    options = {"min_compute_macs": 0, "cache_dir": tempfile.mkdtemp(prefix="fxpass-opinfo-")}
    r: dict[str, Any] = {"ops": 0, "samples": 0, "offloaded": 0, "regions": 0, "mismatch": 0,
                         "crash": 0, "pytorch": 0, "skipped": 0, "fallbacks": 0}
    pytorch_ops: Counter = Counter()
    skipped: Counter = Counter()
    fallback_reasons: Counter = Counter()
    findings: list[dict] = []
    t0 = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    warnings.simplefilter("ignore")
    for i, op in enumerate(ops):
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if op.name.startswith(RANDOM):
            skipped["random"] += 1
            continue
        r["ops"] += 1
        try:
            gen = op.sample_inputs("cpu", torch.float32, requires_grad=False)
            cases = []
            for j, s in enumerate(gen):
                if j >= samples:
                    break
                if j >= first_sample:
                    cases.append(s)
        except Exception:  # noqa: BLE001
            skipped["sample_inputs raised"] += 1
            continue
        for s in cases:
            leaves, spec = pytree.tree_flatten((s.input, list(s.args), dict(s.kwargs)))
            first = next((j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                          and x.dtype == torch.float32 and x.numel() > 0), None)
            fn = make_fn(op.op, spec, first)
            signal.alarm(TIMEOUT)
            try:
                outcome = _one(fn, leaves, options, name, fxpass, r, fallback_reasons)
            except _Timeout:
                outcome = ("skip", "timeout")
            finally:
                signal.alarm(0)
            kind, detail = outcome
            if kind == "skip":
                skipped[detail] += 1
                r["skipped"] += 1
                continue
            r["samples"] += 1
            if kind in ("mismatch", "crash"):
                r[kind] += 1
                findings.append({"kind": f"opinfo_{kind}", "case": f"{name} {s}"[:600],
                                 "message": detail[-3000:]})
            elif kind == "pytorch":
                r["pytorch"] += 1
                pytorch_ops[name] += 1
        if (i + 1) % 20 == 0 and checkpoint is not None:
            checkpoint.write_text(json.dumps({"opinfo": {
                **r, "seconds": time.perf_counter() - t0, "pytorch_ops": dict(pytorch_ops),
                "skip_reasons": dict(skipped), "fallback_reasons": dict(fallback_reasons),
                "findings": findings, "ops_done": i + 1, "ops_total": len(ops)}}))
        if (i + 1) % 50 == 0:
            print(f"  opinfo {i + 1}/{len(ops)} ops in {time.perf_counter() - t0:.0f}s: "
                  f"{r['samples']} samples, {r['offloaded']} offloaded, {r['mismatch']} "
                  f"mismatches, {r['crash']} crashes", flush=True)
    r.update(seconds=time.perf_counter() - t0, pytorch_ops=dict(pytorch_ops),
             skip_reasons=dict(skipped), fallback_reasons=dict(fallback_reasons),
             findings=findings)
    return r


def _one(fn: Any, leaves: list, options: dict, name: str, fxpass: Any, r: dict,
         fallback_reasons: Counter) -> tuple[str, str]:
    """One sample: ("ok" | "mismatch" | "crash" | "pytorch" | "skip", detail)."""
    try:
        expected = _call(fn, leaves, None)
        again = _call(fn, leaves, None)
    except Exception:  # noqa: BLE001
        return "skip", "eager raised"
    problem = _same(expected, again)
    if problem:
        return "skip", ("uncomparable" if problem.startswith("cannot compare")
                        else "nondeterministic in eager")
    seen = {id(x) for x in fxpass.compile_reports()}
    try:
        with torch.no_grad():
            got = _call(fn, leaves, "fxpass_bpu", options)
        problem, kind = _same(expected, got), "mismatch"
    except Exception:  # noqa: BLE001
        problem, kind = traceback.format_exc(), "crash"
    new = [x for x in fxpass.compile_reports() if id(x) not in seen]
    regions = sum(1 for x in new for g in x.regions if g.fallback is None)
    r["regions"] += regions
    r["offloaded"] += regions > 0
    for x in new:
        for g in x.regions:
            if g.fallback is not None:
                r["fallbacks"] += 1
                reason = re.sub(r" at 0x[0-9a-f]+", "", g.fallback)
                fallback_reasons[f"{name}: {reason}"[:200]] += 1
    if problem is None:
        return "ok", ""
    try:  # the control: does PyTorch's own compile stack get it wrong too?
        with torch.no_grad():
            ctrl = _call(fn, leaves, "aot_eager")
        if _same(expected, ctrl) is not None:
            return "pytorch", problem
    except Exception:  # noqa: BLE001
        return "pytorch", problem
    return kind, problem
