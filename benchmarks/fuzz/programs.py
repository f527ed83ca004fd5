"""Random tensor programs for the fuzz benchmark: Hypothesis draws them, one interpreter runs them.

A program is a list of steps over a pool of values (inputs, then each step's result). Values
share one "main" shape or that shape with the last dim 1 (a keepdim reduction), so every op
finds operands that broadcast. The same program runs eagerly, as a traced aten graph (the
rules path) and inside ``torch.compile`` (the backend path), so all three see identical code.

Why the generator tracks *exactness*: comparisons (``x > c``), float -> int casts and bool
reductions turn a last-bit difference into a flipped bit. A matmul in onnxruntime sums in a
different order than ATen, so ``(x @ w) > 0.5`` can legitimately differ. Those ops therefore
only read values computed by ops that give bit-identical results in any IEEE implementation
(movement, casts, neg/abs/relu/clamp/max/min/where, multiplication by powers of two).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Step:
    op: str
    args: tuple[int, ...]  # indices into the value pool
    param: Any = None  # a scalar, a dtype, or a weight index


@dataclass
class Program:
    shape: tuple[int, ...]
    inputs: list[tuple[torch.dtype, tuple[int, ...]]]
    weights: list[tuple[torch.dtype, tuple[int, ...]]]
    steps: list[Step] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    input_modes: list[tuple[str, int]] = field(default_factory=list)  # (mode, seed) per input
    weight_seed: int = 0

    def to_json(self) -> dict[str, Any]:
        """Everything needed to rebuild the program (``Program.from_json``), as JSON."""
        def enc(x: Any) -> Any:
            return str(x) if isinstance(x, torch.dtype) else x

        return {"shape": list(self.shape),
                "inputs": [[enc(d), list(s)] for d, s in self.inputs],
                "weights": [[enc(d), list(s)] for d, s in self.weights],
                "steps": [[s.op, list(s.args), enc(s.param)] for s in self.steps],
                "outputs": self.outputs, "input_modes": [list(m) for m in self.input_modes],
                "weight_seed": self.weight_seed}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Program:
        def dec(x: Any) -> Any:
            if isinstance(x, str) and x.startswith("torch."):
                return getattr(torch, x[6:])
            return tuple(x) if isinstance(x, list) else x

        return Program(
            tuple(d["shape"]), [(dec(a), tuple(b)) for a, b in d["inputs"]],
            [(dec(a), tuple(b)) for a, b in d["weights"]],
            [Step(o, tuple(a), dec(p)) for o, a, p in d["steps"]], list(d["outputs"]),
            [tuple(m) for m in d["input_modes"]], d["weight_seed"])

    def __repr__(self) -> str:
        ins = ", ".join(f"{str(d)[6:]}{list(s)}:{m}" for (d, s), (m, _) in
                        zip(self.inputs, self.input_modes, strict=True))
        body = "; ".join(f"v{len(self.inputs) + i}={s.op}{list(s.args)}"
                         + (f"({s.param})" if s.param is not None else "")
                         for i, s in enumerate(self.steps))
        seeds = [s for _, s in self.input_modes]
        return f"<program in=[{ins}] {body} -> {self.outputs} seeds={seeds},{self.weight_seed}>"


W = list[torch.Tensor]
# name -> (arity, fn(args, param, weights), exact?) ; "exact" = bit-identical everywhere
_Fn = Callable[[Sequence[torch.Tensor], Any, W], torch.Tensor]


def _cast_int(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    # float -> int of NaN/Inf/out-of-range is undefined in C++: make it defined first (CPU ops)
    if x.dtype.is_floating_point:
        x = torch.nan_to_num(x, 0.0, 0.0, 0.0).clamp(-1000, 1000)
    return x.to(dt)


SUPPORTED: dict[str, tuple[int, _Fn, bool]] = {
    "mm": (1, lambda a, p, w: a[0] @ w[p], False),
    "linear": (1, lambda a, p, w: F.linear(a[0], w[p], w[p + 1]), False),
    "add": (2, lambda a, p, w: a[0] + a[1], False),
    "sub": (2, lambda a, p, w: a[0] - a[1], False),
    "mul": (2, lambda a, p, w: a[0] * a[1], False),
    "div": (2, lambda a, p, w: a[0] / a[1], False),
    "add_s": (1, lambda a, p, w: a[0] + p, False),
    "mul_s": (1, lambda a, p, w: a[0] * p, False),
    "mul_2": (1, lambda a, p, w: a[0] * 2.0, True),
    "div_s": (1, lambda a, p, w: a[0] / p, False),
    "relu": (1, lambda a, p, w: torch.relu(a[0]), True),
    "neg": (1, lambda a, p, w: -a[0], True),
    "sigmoid": (1, lambda a, p, w: torch.sigmoid(a[0]), False),
    "tanh": (1, lambda a, p, w: torch.tanh(a[0]), False),
    "silu": (1, lambda a, p, w: F.silu(a[0]), False),
    "gelu": (1, lambda a, p, w: F.gelu(a[0]), False),
    "gelu_tanh": (1, lambda a, p, w: F.gelu(a[0], approximate="tanh"), False),
    "hardswish": (1, lambda a, p, w: F.hardswish(a[0]), False),
    "hardtanh": (1, lambda a, p, w: F.hardtanh(a[0]), True),
    "sqrt": (1, lambda a, p, w: torch.sqrt(a[0]), False),
    "rsqrt": (1, lambda a, p, w: torch.rsqrt(a[0]), False),
    "pow": (1, lambda a, p, w: a[0] ** p, False),
    "softmax": (1, lambda a, p, w: torch.softmax(a[0], -1), False),
    "masked_softmax": (
        2, lambda a, p, w: a[0].masked_fill(a[1], -math.inf).softmax(-1), False),
    "masked_fill": (2, lambda a, p, w: a[0].masked_fill(a[1], p), True),
    "layer_norm": (
        1, lambda a, p, w: F.layer_norm(a[0], a[0].shape[-1:], w[p], w[p + 1]), False),
    "mean_keep": (1, lambda a, p, w: a[0].mean(-1, keepdim=True), False),
    "transpose_rt": (1, lambda a, p, w: a[0].transpose(0, -1).clone().transpose(0, -1), True),
    "reshape_rt": (1, lambda a, p, w: a[0].reshape(-1).reshape(a[0].shape), True),
    "unsq_sq": (1, lambda a, p, w: a[0].unsqueeze(0).squeeze(0), True),
    "slice_cat": (1, lambda a, p, w: torch.cat(
        [a[0][..., a[0].shape[-1] // 2:], a[0][..., : a[0].shape[-1] // 2]], -1), True),
    "select_keep": (1, lambda a, p, w: a[0].select(-1, 0).unsqueeze(-1), True),
    "expand": (1, lambda a, p, w: a[0].expand(p), True),
    "where": (3, lambda a, p, w: torch.where(a[0], a[1], a[2]), True),
    "gt": (1, lambda a, p, w: a[0] > p, True),
    "eq": (1, lambda a, p, w: a[0] == p, True),
    "all_keep": (1, lambda a, p, w: a[0].all(-1, keepdim=True), True),
    "any_keep": (1, lambda a, p, w: a[0].any(-1, keepdim=True), True),
    "cast": (1, lambda a, p, w: _cast_int(a[0], p) if not p.is_floating_point and p != torch.bool
             else a[0].to(p), True),
    "clone": (1, lambda a, p, w: a[0].clone(), True),
}
#: Not in the BPU table: they stay on the CPU, so regions form around them (side branches,
#: residuals), which is where non-convex partitions used to splice a use before its def.
CPU: dict[str, tuple[int, _Fn, bool]] = {
    "cos": (1, lambda a, p, w: torch.cos(a[0]), False),
    "exp": (1, lambda a, p, w: torch.exp(a[0]), False),
    "cumsum": (1, lambda a, p, w: torch.cumsum(a[0], -1), False),
    "abs": (1, lambda a, p, w: a[0].abs(), True),
    "clamp": (1, lambda a, p, w: a[0].clamp(-p, p), True),
    "maximum": (2, lambda a, p, w: torch.maximum(a[0], a[1]), True),
    "minimum": (2, lambda a, p, w: torch.minimum(a[0], a[1]), True),
    "amax_keep": (1, lambda a, p, w: a[0].amax(-1, keepdim=True), True),
    "sum_keep": (1, lambda a, p, w: a[0].sum(-1, keepdim=True), False),
    "erf": (1, lambda a, p, w: torch.erf(a[0]), False),
    "flip": (1, lambda a, p, w: a[0].flip(-1), True),
    "nan_to_num": (1, lambda a, p, w: torch.nan_to_num(a[0]), True),
}
#: Terminal ops: graph outputs only (0-dim and lower-rank results, issue 9 item 20).
TERMINAL: dict[str, tuple[int, _Fn, bool]] = {
    "mean_last": (1, lambda a, p, w: a[0].mean(-1), False),
    "all_last": (1, lambda a, p, w: a[0].all(-1), True),
    "any_last": (1, lambda a, p, w: a[0].any(-1), True),
    "select_last": (1, lambda a, p, w: a[0].select(-1, 0), True),
    "sum_all": (1, lambda a, p, w: a[0].sum(), False),
    "mm_vec": (1, lambda a, p, w: a[0] @ w[p], False),  # weight of shape (n,): drops a dim
}
OPS = {**SUPPORTED, **CPU, **TERMINAL}

#: The terms each summing op adds up, summed over the last dim of what the function returns
#: (float64 in, float64 out). If the positive terms, or the negative ones, add up past the
#: dtype's maximum, *some* summation order overflows: which results are then finite depends on
#: the kernel's order (eager's, onnxruntime's, the BPU's). ``benchmarks.fuzz.referee`` reads this.
SUM_TERMS: dict[str, Callable[[list, Any, list], torch.Tensor]] = {
    "mm": lambda a, p, w: (a[0].unsqueeze(-1) * w[p]).transpose(-1, -2),
    "mm_vec": lambda a, p, w: a[0] * w[p],
    "linear": lambda a, p, w: torch.cat(
        [a[0].unsqueeze(-2) * w[p], w[p + 1].expand(*a[0].shape[:-1], -1).unsqueeze(-1)], -1),
    "layer_norm": lambda a, p, w: torch.cat(
        [a[0], (a[0] - a[0].mean(-1, keepdim=True)) ** 2], -1),
    "mean_keep": lambda a, p, w: a[0],
    "mean_last": lambda a, p, w: a[0],
    "sum_keep": lambda a, p, w: a[0],
    "cumsum": lambda a, p, w: a[0],
    "sum_all": lambda a, p, w: a[0].reshape(-1),
}
_FLOAT_ONLY = {
    "mm", "linear", "sigmoid", "tanh", "silu", "gelu", "gelu_tanh", "hardswish", "hardtanh",
    "sqrt", "rsqrt", "pow", "softmax", "masked_softmax", "masked_fill", "layer_norm",
    "mean_keep", "cos", "exp", "erf", "mean_last", "mm_vec", "div_s", "div",
}
_BOOL_ONLY = {"all_keep", "any_keep", "all_last", "any_last"}
_NUMERIC = {"add", "sub", "mul", "add_s", "mul_s", "mul_2", "neg", "relu", "abs", "clamp",
            "maximum", "minimum", "amax_keep", "sum_keep", "cumsum", "gt", "eq", "sum_all"}


def run(prog: Program, inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> tuple:
    """Interpret ``prog`` (eagerly, under a tracer or under Dynamo: plain Python over torch)."""
    vals = list(inputs)
    w = list(weights)
    for s in prog.steps:
        vals.append(OPS[s.op][1]([vals[i] for i in s.args], s.param, w))
    return tuple(vals[i] for i in prog.outputs)


class ProgramModule(torch.nn.Module):
    """The program as a module whose weights are parameters (so the backend freezes them)."""

    def __init__(self, prog: Program, weights: Sequence[torch.Tensor]):
        super().__init__()
        self.prog = prog
        self.w = torch.nn.ParameterList(
            [torch.nn.Parameter(t, requires_grad=False) for t in weights])

    def forward(self, *xs: torch.Tensor) -> tuple:
        return run(self.prog, xs, list(self.w))


# ---------------------------------------------------------------------------- generation
SPECIAL = (math.nan, math.inf, -math.inf, 0.0, -0.0)
MODES = ("normal", "normal", "special", "special", "huge", "tiny", "allspecial")


def make_tensor(dt: torch.dtype, shape: Sequence[int], mode: str, seed: int) -> torch.Tensor:
    """One input: normal values, or with NaN/+-Inf/+-0 ("special"), near the dtype's maximum
    ("huge"), subnormal ("tiny"), or special everywhere ("allspecial")."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dt.is_floating_point:
        return torch.randint(-4, 5, shape, generator=g).to(dt)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    fi = torch.finfo(dt)
    if mode == "huge":
        x = x.sign() * fi.max * (0.5 + 0.5 * torch.rand(shape, generator=g, dtype=torch.float64))
    elif mode == "tiny":
        x = x * fi.tiny * 0.25
    if mode in ("special", "allspecial") and x.numel():
        pick = torch.rand(shape, generator=g) < (0.2 if mode == "special" else 1.0)
        which = torch.randint(0, len(SPECIAL), shape, generator=g)
        x = torch.where(pick, torch.tensor(SPECIAL, dtype=torch.float64)[which], x)
    return x.to(dt)


def materialize(prog: Program) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Real inputs and weights for ``prog`` (deterministic from its seeds)."""
    ins = [make_tensor(dt, s, m, seed) for (dt, s), (m, seed) in
           zip(prog.inputs, prog.input_modes, strict=True)]
    g = torch.Generator().manual_seed(prog.weight_seed)
    ws = [(torch.randn(s, generator=g) * 0.5).to(dt) for dt, s in prog.weights]
    return ins, ws


class _Draw:
    """Builds one program: each step is checked on meta tensors (shape/dtype) when drawn."""

    def __init__(self, draw: Any, shape: tuple[int, ...]):
        self.draw, self.prog = draw, Program(shape, [], [])
        self.meta: list[torch.Tensor] = []
        self.exact: list[bool] = []
        self.wmeta: list[torch.Tensor] = []

    def add_input(self, dt: torch.dtype, shape: tuple[int, ...]) -> None:
        self.prog.inputs.append((dt, shape))
        mode = self.draw(st.sampled_from(MODES))
        self.prog.input_modes.append((mode, self.draw(st.integers(0, 2**31 - 1))))
        self.meta.append(torch.empty(shape, dtype=dt, device="meta"))
        self.exact.append(True)

    def weight(self, dt: torch.dtype, shape: tuple[int, ...]) -> int:
        self.prog.weights.append((dt, shape))
        self.wmeta.append(torch.empty(shape, dtype=dt, device="meta"))
        return len(self.prog.weights) - 1

    def candidates(self, op: str, need_exact: bool = False) -> list[int]:
        out = []
        for i, v in enumerate(self.meta):
            if need_exact and not self.exact[i]:
                continue
            if op in _FLOAT_ONLY and not v.dtype.is_floating_point:
                continue
            if op in _BOOL_ONLY and v.dtype != torch.bool:
                continue
            if op in _NUMERIC and v.dtype == torch.bool:
                continue
            out.append(i)
        return out

    def step(self, op: str, terminal: bool = False) -> int | None:
        arity, fn, exact_op = OPS[op]
        # comparisons and int casts only read bit-exact values (see the module docstring)
        need_exact = op in ("gt", "eq", "all_keep", "any_keep", "all_last", "any_last") or (
            op == "cast")
        draw = self.draw
        if op == "where":
            conds = [i for i, v in enumerate(self.meta) if v.dtype == torch.bool]
            rest = self.candidates("add")
            if not conds or not rest:
                return None
            args = (draw(st.sampled_from(conds)), draw(st.sampled_from(rest)),
                    draw(st.sampled_from(rest)))
        elif op in ("masked_fill", "masked_softmax"):
            conds = [i for i, v in enumerate(self.meta) if v.dtype == torch.bool]
            xs = self.candidates(op)
            if not conds or not xs:
                return None
            args = (draw(st.sampled_from(xs)), draw(st.sampled_from(conds)))
        else:
            cands = self.candidates(op, need_exact)
            if not cands:
                return None
            args = tuple(draw(st.sampled_from(cands)) for _ in range(arity))
        x = self.meta[args[0]]
        param: Any = None
        if op in ("mm", "mm_vec"):
            shape = (x.shape[-1],) if op == "mm_vec" else (x.shape[-1], self.prog.shape[-1])
            param = self.weight(x.dtype, shape)
        elif op in ("linear", "layer_norm"):
            n = self.prog.shape[-1] if op == "linear" else x.shape[-1]
            param = self.weight(x.dtype, (n, x.shape[-1]) if op == "linear" else (n,))
            self.weight(x.dtype, (n,))
        elif op in ("add_s", "mul_s"):
            param = draw(st.sampled_from([0.5, -1.5, 3, 1e-3, 0.0]))
        elif op == "div_s":
            param = draw(st.sampled_from([2.0, -0.25, 3.0]))
        elif op == "pow":
            param = draw(st.sampled_from([2, 3, 0.5, -1]))
        elif op in ("gt", "eq"):
            param = draw(st.sampled_from([0.0, 0.5, -1.0, 1]))
        elif op == "masked_fill":
            param = draw(st.sampled_from([-math.inf, 0.0, -1e4]))
        elif op == "clamp":
            param = draw(st.sampled_from([1.0, 3.0]))
        elif op == "expand":
            if x.dim() != len(self.prog.shape):
                return None
            param = tuple(self.prog.shape)
        elif op == "cast":
            param = draw(st.sampled_from(
                [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                 torch.bool]))
        try:
            out = fn([self.meta[i] for i in args], param, self.wmeta)
        except Exception:  # noqa: BLE001 - a step that does not type-check is not drawn
            if param is not None and op in ("mm", "mm_vec", "linear", "layer_norm"):
                pass  # the unused weight stays: harmless
            return None
        if not terminal and out.shape not in (torch.Size(self.prog.shape),
                                              torch.Size(self.prog.shape[:-1] + (1,))):
            return None
        self.prog.steps.append(Step(op, args, param))
        self.meta.append(out)
        self.exact.append(exact_op and all(self.exact[i] for i in args))
        return len(self.meta) - 1


#: Ops the BPU takes are drawn 3x as often as CPU ops, so regions are big and cut by CPU ops.
_CHOICES = [*SUPPORTED, *SUPPORTED, *SUPPORTED, *CPU]


@st.composite
def programs(draw: Any, max_steps: int = 10) -> Program:
    """A random program: 1-3 inputs (one dtype is the main float dtype; others int/bool or
    other floats), 1..max_steps ops, outputs = unused values plus random fan-out, sometimes a
    terminal reduction (0-dim results)."""
    rank = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    if draw(st.integers(0, 9)) == 0:  # empty tensors
        shape[draw(st.integers(0, rank - 1))] = 0
    b = _Draw(draw, tuple(shape))
    main = draw(st.sampled_from([torch.float32] * 4 + [torch.float16, torch.bfloat16]))
    b.add_input(main, tuple(shape))
    for _ in range(draw(st.integers(0, 2))):
        dt = draw(st.sampled_from([main, torch.float32, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64, torch.bool]))
        keep = draw(st.booleans()) and rank > 0
        b.add_input(dt, tuple(shape[:-1] + [1]) if keep else tuple(shape))
    # a matmul first, most of the time, so a region has compute even in short programs
    if draw(st.integers(0, 3)) > 0:
        b.step("mm")
    fanout: list[int] = []
    for _ in range(draw(st.integers(1, max_steps))):
        i = b.step(draw(st.sampled_from(_CHOICES)))
        if i is not None and draw(st.integers(0, 4)) == 0:
            fanout.append(i)
    if draw(st.integers(0, 3)) == 0:
        t = b.step(draw(st.sampled_from(list(TERMINAL))), terminal=True)
        if t is not None:
            fanout.append(t)
    n_in = len(b.prog.inputs)
    used = {a for s in b.prog.steps for a in s.args}
    outs = [i for i in range(n_in, len(b.meta)) if i not in used]
    outs += [i for i in fanout if i not in outs]
    if not b.prog.steps:
        b.step("clone")
        outs = [len(b.meta) - 1]
    b.prog.outputs = outs or [len(b.meta) - 1]
    b.prog.weight_seed = draw(st.integers(0, 2**31 - 1))
    return b.prog
