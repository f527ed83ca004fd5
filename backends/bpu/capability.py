"""Which nodes the BPU can take, per march, and why not when it cannot.

Source: ``docs/bpu-facts.md`` (the original pull request's whitelist, verified on an RDK
S600 with ``convert(advice=True)``, plus our reading of the public OpenExplorer constraint
tables). It is *data*: a march is a set of operator families and dtypes plus global limits,
so a correction never touches the partitioner. Which op belongs to which family, how it is
lowered and which arguments it admits live in one table,
:data:`fxpass.backends.onnx.lowering.OPS`; the reasons come from one function,
:class:`fxpass.backends.onnx.lowering.Reasons`, which the lowering asks too. A node the
capability accepts is therefore one the lowering can emit.

Float tensors: the tensor engine computes in int8/int16, and a float conv/matmul handed to
``convert`` is placed on the board's CPU (docs/bpu-facts.md). Float32/float16 are accepted here
because the compile step quantizes: on the board path a region reaches hbdk4 only as a
calibrated Q/DQ model (:mod:`fxpass.backends.onnx.quantize`, which holds which ops need
integer inputs per march); on the host, quantization is opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from fxpass.backends.bpu.marches import CORES, DEFAULT_MARCH
from fxpass.backends.onnx.lowering import FAMILIES, OPS, Reasons

F32, F16, BOOL = torch.float32, torch.float16, torch.bool
INT = {torch.int8, torch.int16, torch.int32, torch.uint8}
#: families on the BPU's published operator list ("unlisted" ops are lowered, not offloaded)
DEVICE_FAMILIES = frozenset(FAMILIES) - {"unlisted"}

__all__ = ["DEFAULT_MARCH", "FAMILIES", "MARCHES", "Capability", "March", "march", "reject_reason"]


@dataclass(frozen=True)
class March:
    name: str
    families: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_rank: int = 10
    max_reduce: int = 65535
    max_io: int = 256
    cores: int = 1
    ops: frozenset[Any] = field(default=frozenset())

    def __post_init__(self) -> None:
        unknown = self.families - set(FAMILIES)
        if unknown:
            raise ValueError(f"march {self.name}: unknown families {sorted(unknown)}")
        ops = frozenset(t for t, op in OPS.items() if op.family in self.families)
        object.__setattr__(self, "ops", ops)


_DTYPES = frozenset({F32, F16, BOOL, *INT})
MARCHES: dict[str, March] = {
    name: March(name, DEVICE_FAMILIES, _DTYPES, cores=cores) for name, cores in CORES.items()}


def march(name: str) -> March:
    """The march called ``name``; a ValueError lists the known ones."""
    if name not in MARCHES:
        raise ValueError(f"unknown march {name!r}; known: {sorted(MARCHES)} (default nash-p)")
    return MARCHES[name]


class Capability(Reasons):
    """The partitioner's reject-reason callable for one graph and march (cached per node and
    per value; build one per partition run)."""

    def __init__(self, m: March) -> None:
        super().__init__(m)
        self.m = m


def reject_reason(node: Node, m: March) -> str | None:
    """None if the BPU can take ``node``; otherwise a short human reason (uncached, one-off)."""
    return Reasons(m)(node)
