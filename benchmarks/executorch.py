"""ExecuTorch (XNNPACK) as a decode contender of ``benchmarks.weight_only``: fp32 and 8da4w.

ExecuTorch pins its own torchao, so it lives in a virtual environment of its own that sees
this one's packages (torch 2.13 included)::

    python -m venv --system-site-packages .et
    .et/bin/pip install executorch==1.5.1 "torchao>=0.18,<0.19" -c constraints.txt
    .et/bin/python -m benchmarks.weight_only          # adds the et-fp32 and et-8da4w rows

The model goes through transformers' own exporter (``TorchExportableModuleForDecoderOnlyLM``:
a static cache of ``max_len``, one token per call), ``to_edge_transform_and_lower`` with the
XNNPACK partitioner, and ExecuTorch's Python runtime (``_load_for_executorch_from_buffer``).
optimum-executorch is not used: it pins an older transformers. 8da4w is torchao's
``Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, PerGroup(32))`` on every
``nn.Linear`` (the LM head included, the embedding not), as ExecuTorch's LLM recipes do.
The loop is ours and greedy: the prompt one token per call (the exported program takes one),
then one call per new token; decode ms/token cancels the prompt as every row's does.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import torch

#: contender -> quantization (None: fp32)
CONTENDERS = {"et-fp32": None, "et-8da4w": "8da4w"}


def available() -> bool:
    """Whether this interpreter has ExecuTorch (its own environment, see the docstring)."""
    return importlib.util.find_spec("executorch") is not None


class ExecuTorch:
    """One model lowered to XNNPACK; called with ``n`` it generates ``n`` tokens greedily after
    ``ids`` and returns the whole sequence, as the other contenders do."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, max_len: int,
                 quant: str | None = None, group: int = 32):
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner,
        )
        from executorch.exir import to_edge_transform_and_lower
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        m = copy.deepcopy(model).eval()
        m.generation_config.cache_implementation = "static"  # what the exporter takes
        m.generation_config.max_length = max_len
        if quant == "8da4w":
            from torchao.quantization import (
                Int8DynamicActivationIntxWeightConfig,
                PerGroup,
                quantize_,
            )

            quantize_(m, Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=PerGroup(group)))
        elif quant is not None:
            raise ValueError(f"unknown ExecuTorch quantization {quant!r}; known: 8da4w")
        with torch.no_grad():
            ep = TorchExportableModuleForDecoderOnlyLM(m, batch_size=1, max_cache_len=max_len)\
                .export(input_ids=ids[:, :1], cache_position=torch.tensor([0]))
        self.buffer = to_edge_transform_and_lower(
            ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
        self.size = len(self.buffer)
        self.ids, self.max_len = ids, max_len
        self.module = self.load()

    def load(self) -> Any:
        from executorch.extension.pybindings.portable_lib import (
            _load_for_executorch_from_buffer,
        )

        return _load_for_executorch_from_buffer(self.buffer)

    def step(self, token: torch.Tensor, pos: int, module: Any = None) -> torch.Tensor:
        """The logits after ``token`` (shape [1, 1]) at position ``pos``."""
        return (module or self.module).forward((token, torch.tensor([pos])))[0]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits at every position of ``ids`` ([1, T]): [T, vocab]."""
        return torch.cat([self.step(ids[:, i:i + 1], i)[0, -1:].float()
                          for i in range(ids.shape[1])])

    def __call__(self, n: int, module: Any = None, ids: torch.Tensor | None = None
                 ) -> torch.Tensor:
        seq = (self.ids if ids is None else ids)[0].tolist()
        out = None
        for i, t in enumerate(seq):  # the prompt, one token per call
            out = self.step(torch.tensor([[t]]), i, module)
        end = len(seq) + n
        while len(seq) < end:  # n tokens: n - 1 calls after the prompt, as HF's loop makes
            seq.append(int(out[0, -1].argmax()))
            if len(seq) < end:
                out = self.step(torch.tensor([[seq[-1]]]), len(seq) - 1, module)
        return torch.tensor([seq])

class Loaded:
    """A fresh runtime over the same program, with ``generate`` as the benchmark calls it."""

    def __init__(self, et: ExecuTorch):
        self.et, self.module = et, et.load()

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos_token_id: Any = None) -> Any:
        return self.et(max_new_tokens, self.module, ids)
