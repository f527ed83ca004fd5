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

One runner serves several threads: each ``generate`` call runs on a state of its own (the KV
cache and the cache-length counters: a *slot*) over the package's shared weights, programs
and region sessions, as onnxruntime-genai's ``Generator`` owns its cache over a shared
``Model``. Slots are pooled: a call takes a free one (or makes one, the first being the
package's own state) and gives it back, so a process holds as many caches as it ever ran
calls at once. Why not one cache and a lock: on the 2-core host both take the same wall time
for 4 threads x 5 calls (the cores are busy either way), but under a lock a caller waits for
every call ahead of it before its first token (2 s at worst against 0.08 s,
``python -m benchmarks.deploy``); a slot costs only the cache's memory.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Slot:
    """One caller's state (name -> tensor, written in place) and each program's step over it."""

    state: dict[str, torch.Tensor]
    prefill: Callable[..., tuple[Any, ...]]
    decode: Callable[..., tuple[Any, ...]]


class Runner:
    """A loaded generation package: ``generate(input_ids, max_new_tokens, ...)``, safe to call
    from several threads at once (each call on a state of its own, module doc)."""

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
        #: rows of the embedding the prompt is looked up in: a token id past it is refused
        #: with the vocabulary's size (None: the lookup is not a CPU op we can see)
        self.vocab_size: int | None = getattr(self._prefill, "embedding_rows", lambda: None)()
        self._positions = torch.arange(self.max_cache_len)
        #: each position's one-element view, made once: a slice per step is a torch op
        self._at = list(self._positions.view(-1, 1))
        self._lock = threading.Lock()
        #: free slots; the package's own state is the first
        self._free: list[Slot] = [self._slot(package.state)]
        self.slots = 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.package.path} is a generation package: call "
                        "runner.generate(input_ids, max_new_tokens=...), not the runner itself")

    def _slot(self, state: dict[str, torch.Tensor]) -> Slot:
        return Slot(state, self._prefill.bind(state), self._decode.bind(state))

    @contextmanager
    def _acquire(self) -> Iterator[Slot]:
        """A free slot for one call, given back after it (a new one when all are in use)."""
        with self._lock:
            slot = self._free.pop() if self._free else None
            if slot is None:
                self.slots += 1
        if slot is None:
            slot = self._slot({k: torch.zeros_like(t) for k, t in self.package.state.items()})
        try:
            yield slot
        finally:
            with self._lock:
                self._free.append(slot)

    def _check(self, input_ids: Any, max_new_tokens: int, least: int = 1) -> None:
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
        if not isinstance(max_new_tokens, int) or max_new_tokens < least:
            raise ValueError(f"{where}: max_new_tokens must be an int >= {least}, got "
                             f"{max_new_tokens!r}")
        if t + max_new_tokens > self.max_cache_len:
            raise ValueError(
                f"{where}: the prompt ({t} tokens) plus max_new_tokens ({max_new_tokens}) is "
                f"{t + max_new_tokens}, past the cache of {self.max_cache_len} the package was "
                "exported with; shorten them, or export again with a larger max_cache_len")
        if self.vocab_size is not None:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"{where}: input_ids holds token id {hi if hi >= self.vocab_size else lo}, "
                    f"outside the model's vocabulary of {self.vocab_size} (ids 0 to "
                    f"{self.vocab_size - 1}); encode the prompt with the model's own tokenizer")

    def prefill(self, input_ids: torch.Tensor, tail: str = "pad",
                slot: Slot | None = None) -> torch.Tensor:
        """Run the prompt into ``slot``'s cache (a free slot's without one); the logits of its
        last token (batch, 1, vocab)."""
        if slot is None:
            with self._acquire() as slot:
                return self.prefill(input_ids, tail, slot)
        return deque(self._prompt(input_ids, tail, slot), maxlen=1)[0][:, -1:]

    def _prompt(self, ids: torch.Tensor, tail: str, slot: Slot) -> Iterator[torch.Tensor]:
        """Run ``ids`` into ``slot``'s cache (module doc: whole chunks, then the tail padded
        or token by token); yields each call's logits at its real tokens (batch, n, vocab),
        views of a program's output, valid until the next call."""
        p, t = self.prefill_length, ids.shape[1]
        pos = 0
        while t - pos >= p or (tail == "pad" and pos < t and pos + p <= self.max_cache_len):
            chunk, real = ids[:, pos:pos + p], min(p, t - pos)
            if real < p:  # the tail, padded with its last token
                chunk = torch.cat([chunk, chunk[:, -1:].expand(chunk.shape[0], p - real)],
                                  1).contiguous()
            (out,) = slot.prefill(chunk, self._positions[pos:pos + p])
            yield out[:, :real]
            pos += real
        for i in range(pos, t):
            yield slot.decode(ids[:, i:i + 1].contiguous(), self._at[i])[0]

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits after every token of ``input_ids`` (batch, tokens): (batch, tokens,
        vocab), float32, computed as ``generate`` runs a prompt (``_prompt``) on a cache of
        its own.

        Why: teacher-forced quality of the package itself against the float model, on your
        own text (``fxpass.aot.quality.agreement``), e.g. before deploying ``quantize="w4"``:
        what a greedy token-by-token comparison cannot show once the two have diverged."""
        self._check(input_ids, 0, least=0)
        with self._acquire() as slot, cpu_threads(self._decode.spec.get("cpu_threads")):
            for s in slot.state.values():
                s.zero_()
            # (copies: each call's logits are a buffer the next call reuses)
            return torch.cat([x.float().clone() for x in self._prompt(
                input_ids.to(torch.long), "pad", slot)], 1)

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
        if streamer is not None:
            streamer.put(ids.cpu())
        with self._acquire() as slot, cpu_threads(self._decode.spec.get("cpu_threads")):
            for s in slot.state.values():
                s.zero_()
            return self._loop(slot, ids, max_new_tokens, do_sample, temperature, top_k, top_p,
                              eos, pad, gen, streamer, tail)

    def _loop(self, slot: Slot, ids: torch.Tensor, max_new_tokens: int, do_sample: bool,
              temperature: float, top_k: int | None, top_p: float | None, eos: list[int],
              pad: int, gen: torch.Generator | None, streamer: Any, tail: str) -> torch.Tensor:
        logits = self.prefill(ids, tail, slot)
        decode, at = slot.decode, self._at
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
            logits = decode(tok, at[pos])[0]
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
        x = logits.detach()
        if x.dtype == torch.bfloat16:  # numpy has none; float32 holds each value exactly
            x = x.float()
        return np.argmax(x.numpy()[:, -1], -1)  # the slice in numpy: no torch view per step
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
