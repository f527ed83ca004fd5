"""``load(path).generate(...)``: a lean generation loop over a package's prefill and decode
programs, without HF's ``generate()`` and without Dynamo.

Why its own loop: through ``torch.compile`` each decode step paid for Dynamo's frame and
guards and for HF's generation loop (logits processors, stopping criteria, cache objects),
about a third of a small model's step. Here a step is one call of the decode program (a few
aten ops and one region) and an argmax. ExecuTorch's llama runner is the model.

Prompts of any length up to the cache: whole ``prefill_length`` chunks through the prefill
program, then the tail. ``tail="pad"`` (default) runs the tail as one more prefill chunk
padded with the last token: the padding's keys and values land in cache slots past the
prompt, which no real position attends to (the static cache's mask is causal by position)
and which the decode steps overwrite before they are read. Where a padded chunk would run
past the cache, or with ``tail="decode"``, the tail runs one token at a time through the
decode program (``python -m benchmarks.deploy`` measures both).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


class Runner:
    """A loaded generation package: ``generate(input_ids, max_new_tokens, ...)``."""

    def __init__(self, package: Any):
        self.package = package
        meta = package.manifest["generate"]
        self.max_cache_len = int(meta["max_cache_len"])
        self.prefill_length = int(meta["prefill_length"])
        self.batch_size = int(meta["batch_size"])
        self.eos_token_id = list(meta.get("eos_token_id") or [])
        self.pad_token_id = meta.get("pad_token_id")
        self._prefill = package.programs["prefill"]
        self._decode = package.programs["decode"]
        self._positions = torch.arange(self.max_cache_len)
        #: each position's one-element view, made once: a slice per step is a torch op
        self._at = list(self._positions.view(-1, 1))

    def _check(self, input_ids: Any, max_new_tokens: int) -> None:
        where = f"{self.package.path}"
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or (
                input_ids.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"{where}: input_ids must be a 2-D integer tensor (batch, tokens), "
                             f"got {getattr(input_ids, 'dtype', type(input_ids).__name__)}"
                             f"{list(getattr(input_ids, 'shape', []))}")
        b, t = input_ids.shape
        if b != self.batch_size:
            raise ValueError(f"{where}: the package was exported for batch size "
                             f"{self.batch_size}, got {b}; export again with batch_size={b}")
        if t == 0:
            raise ValueError(f"{where}: empty prompt; give at least one token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if t + max_new_tokens > self.max_cache_len:
            raise ValueError(
                f"{where}: the prompt ({t} tokens) plus max_new_tokens ({max_new_tokens}) is "
                f"{t + max_new_tokens}, past the cache of {self.max_cache_len} the package was "
                "exported with; shorten them, or export again with a larger max_cache_len")

    def _step(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        """The decode program at ``pos``: logits (batch, 1, vocab)."""
        return self._decode.step(ids, self._at[pos])[0]

    def prefill(self, input_ids: torch.Tensor, tail: str = "pad") -> torch.Tensor:
        """Run the prompt into the cache; the logits of its last token (batch, 1, vocab)."""
        p, t = self.prefill_length, input_ids.shape[1]
        pos, logits = 0, None
        while t - pos >= p:
            (out,) = self._prefill.step(input_ids[:, pos:pos + p], self._positions[pos:pos + p])
            logits, pos = out[:, -1:, :], pos + p
        if pos == t:
            return logits
        if tail == "pad" and pos + p <= self.max_cache_len:
            chunk = input_ids[:, pos:]
            pad = chunk[:, -1:].expand(chunk.shape[0], p - chunk.shape[1])
            (out,) = self._prefill.step(torch.cat([chunk, pad], 1).contiguous(),
                                        self._positions[pos:pos + p])
            return out[:, t - pos - 1:t - pos, :]
        for i in range(pos, t):
            logits = self._step(input_ids[:, i:i + 1].contiguous(), i)
        return logits

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        streamer: Any = None,
        seed: int | None = None,
        tail: str = "pad",
    ) -> torch.Tensor:
        """The prompt followed by up to ``max_new_tokens`` tokens, as HF's ``generate()``
        returns them: greedy by default; with ``do_sample``, temperature, then top-k, then
        top-p, as HF's warpers apply them, drawn from a generator seeded with ``seed``. A
        sequence that produced an end token continues with the pad token (the end token if
        there is none); generation stops when every sequence has ended."""
        self._check(input_ids, max_new_tokens)
        if tail not in ("pad", "decode"):
            raise ValueError(f"tail must be 'pad' or 'decode', got {tail!r}")
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        eos = self.eos_token_id if eos_token_id is None else (
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        pad = self.pad_token_id if self.pad_token_id is not None else (eos[0] if eos else 0)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        ids = input_ids.to(torch.long)
        for s in self.package.state.values():
            s.zero_()
        if streamer is not None:
            streamer.put(ids.cpu())
        with cpu_threads(self._decode.spec.get("cpu_threads")):
            return self._loop(ids, max_new_tokens, do_sample, temperature, top_k, top_p, eos,
                              pad, gen, streamer, tail)

    def _loop(self, ids: torch.Tensor, max_new_tokens: int, do_sample: bool,
              temperature: float, top_k: int | None, top_p: float | None, eos: list[int],
              pad: int, gen: torch.Generator | None, streamer: Any, tail: str) -> torch.Tensor:
        logits = self.prefill(ids, tail)
        pos = ids.shape[1]
        out = [ids]
        done = [False] * ids.shape[0]
        ends = set(eos)
        for step in range(max_new_tokens):
            nxt = _pick(logits, do_sample, temperature, top_k, top_p, gen)  # (batch,) numpy
            if ends:  # per sequence, in Python: a batch is a handful of ints
                toks = nxt.tolist()
                for b, t in enumerate(toks):
                    if done[b]:
                        toks[b] = pad
                    done[b] = done[b] or t in ends
                nxt = np.array(toks, dtype=np.int64)
            tok = torch.from_numpy(nxt.reshape(-1, 1))
            out.append(tok)
            if streamer is not None:
                streamer.put(tok)
            if step == max_new_tokens - 1 or (ends and all(done)):
                break
            logits = self._step(tok, pos)
            pos += 1
        if streamer is not None:
            streamer.end()
        return torch.cat(out, 1)


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """torch's CPU ops on ``n`` threads inside (``runtime.TorchThreads``, once per loop)."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None,
          top_p: float | None, gen: torch.Generator | None) -> np.ndarray:
    """The next token per sequence from the last position's ``logits`` (batch, 1, vocab)."""
    if not do_sample:  # numpy's argmax: 3 us over 32k logits against torch's 48 (same ties, NaN)
        return np.argmax(logits.detach().numpy()[:, -1], -1)
    scores = logits[:, -1].float() / temperature
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(-1, order, remove), -float("inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0].numpy()
