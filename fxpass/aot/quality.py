"""How close a package's logits are to the float model's: ``agreement(logits, reference, ids)``.

Why: a weight-only package (``quantize="w4"`` / ``"w8"``) trades accuracy for bytes, and how
much depends on the model and the text. Greedy tokens compared one by one say little: after
the first token that differs the two continue from different prefixes. Teacher forcing (both
scored on the same tokens, ``Runner.score``) compares every position on equal terms. These are
the measures ``benchmarks.weight_only`` reports::

    from fxpass.aot.quality import agreement
    from fxpass.backends.bpu import load

    runner = load("pkg-w4")                 # export_for_generate(..., options={"quantize": "w4"})
    with torch.no_grad():
        want = model(ids).logits            # the float model, same ids
    print(agreement(runner.score(ids), want, ids))
    # SmolLM2-135M, w4, on benchmarks/data/sample.txt (256 tokens):
    # {'top1': 0.645, 'cosine': 0.9255, 'perplexity': 36.97, 'reference_perplexity': 30.11}
"""

from __future__ import annotations

import torch


def agreement(logits: torch.Tensor, reference: torch.Tensor,
              input_ids: torch.Tensor | None = None) -> dict[str, float]:
    """Per position of ``logits`` against ``reference`` (both (batch, tokens, vocab) or
    (tokens, vocab), over the same tokens): ``top1``, the share of positions whose highest
    logit is the reference's; ``cosine``, the mean cosine similarity of the two logit vectors;
    with ``input_ids``, ``perplexity`` of ``logits`` on the next token of ``input_ids``
    (positions 0..n-2 predicting 1..n-1) and the reference's own (``reference_perplexity``)."""
    if logits.shape != reference.shape:
        raise ValueError(f"logits {list(logits.shape)} and reference {list(reference.shape)} "
                         "differ in shape: score the same tokens with both (Runner.score, and "
                         "the float model's forward over the same input_ids)")
    a, b = logits.double().reshape(-1, logits.shape[-1]), reference.double().reshape(
        -1, reference.shape[-1])
    out = {"top1": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
           "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())}
    if input_ids is not None:
        ids = input_ids.reshape(-1, input_ids.shape[-1]) if input_ids.dim() > 1 else (
            input_ids[None])
        if ids.shape[-1] != logits.shape[-2] or ids.shape[-1] < 2:
            raise ValueError(f"input_ids have {ids.shape[-1]} tokens, the logits "
                             f"{logits.shape[-2]} positions; give the ids the logits scored "
                             "(at least 2 tokens for a perplexity)")
        for key, x in (("perplexity", logits), ("reference_perplexity", reference)):
            x = x.double().reshape(ids.shape[0], ids.shape[1], -1)[:, :-1]
            nll = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]),
                                                    ids[:, 1:].reshape(-1))
            out[key] = float(nll.exp())
    return out
