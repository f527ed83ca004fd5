"""Small stock models with random weights (no downloads) for the demo, explain, tests, benchmarks.

Each entry builds a real ``transformers`` model class from a small config, or a plain torch
module, and example inputs. ``get(name, **overrides)`` returns ``(model, kwargs)``.

It is a tool beside the core, not part of it: the CLI's ``demo``, ``explain`` and ``export``
commands name these models, and the tests and benchmarks use them; the rewrite framework
itself never builds a model (and must not need ``transformers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Factory = Callable[..., tuple[torch.nn.Module, dict[str, Any]]]


class MissingExtra(ImportError):
    """A model needs an optional dependency this install lacks (a plain ``pip install
    fxpass`` has no transformers); the message names the extra that brings it, so a command
    can print it as its one-line error."""


def _tf(model: str) -> Any:
    """The ``transformers`` module, or a :class:`MissingExtra` naming ``model`` and the extra."""
    try:
        import transformers
    except ImportError as e:  # a plain install: the HF models need the demo extra
        why = ("transformers is not installed"
               if isinstance(e, ModuleNotFoundError) and e.name == "transformers"
               else f"transformers failed to import ({type(e).__name__}: {e})")
        raise MissingExtra(
            f"{model} is a transformers model, and {why}; install it with "
            'pip install "fxpass[demo]"') from None
    return transformers


def _ids(vocab: int, tokens: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(0))


def _decoder(
    cls_cfg: str,
    cls_model: str,
    *,
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    vocab=512,
    tokens=8,
    dtype=torch.float32,
    **extra,
):
    tf = _tf(cls_model)
    cfg = getattr(tf, cls_cfg)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(256, tokens * 2),
        **extra,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(tf, cls_model)(cfg).eval().to(dtype)
    return model, {"input_ids": _ids(vocab, tokens), "use_cache": False}


def _head_dim(kw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3 configs default head_dim to 128 whatever the width: keep it hidden / heads."""
    kw.setdefault("head_dim", kw.get("hidden", 64) // kw.get("heads", 4))
    return kw


def qwen3(**kw: Any):
    return _decoder("Qwen3Config", "Qwen3ForCausalLM", **_head_dim(kw))


def qwen3_moe(*, experts=8, top_k=2, **kw: Any):
    """Qwen3-MoE: its routing (``topk``, ``sort``, ``histc``, indexing by the routed tokens) is
    data-dependent and stays on the CPU, so each layer is several regions with torch between."""
    kw.setdefault("moe_intermediate_size", kw.get("hidden", 64) // 2)
    return _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=experts,
                    num_experts_per_tok=top_k, **_head_dim(kw))


def llama(**kw: Any):
    return _decoder("LlamaConfig", "LlamaForCausalLM", **kw)


def mistral(**kw: Any):
    kw.setdefault("sliding_window", None)
    return _decoder("MistralConfig", "MistralForCausalLM", **kw)


def gpt2(*, layers=2, hidden=64, heads=4, vocab=512, tokens=8, dtype=torch.float32):
    tf = _tf("GPT2LMHeadModel")
    cfg = tf.GPT2Config(
        vocab_size=vocab,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        n_positions=max(256, tokens * 2),
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg).eval().to(dtype)
    return model, {"input_ids": _ids(vocab, tokens), "use_cache": False}


def bert(*, layers=2, hidden=64, heads=4, vocab=512, tokens=8, dtype=torch.float32):
    """BERT with a padding mask: the last quarter of the second sequence is padding."""
    tf = _tf("BertModel")
    cfg = tf.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 2,
        max_position_embeddings=max(256, tokens * 2),
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.BertModel(cfg).eval().to(dtype)
    ids = _ids(vocab, tokens, batch=2)
    mask = torch.ones_like(ids)
    mask[1, tokens - max(1, tokens // 4) :] = 0
    return model, {"input_ids": ids, "attention_mask": mask}


def vit(*, layers=2, hidden=64, heads=4, image=32, patch=8, dtype=torch.float32, **_: Any):
    tf = _tf("ViTModel")
    cfg = tf.ViTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 2,
        image_size=image,
        patch_size=patch,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.ViTModel(cfg).eval().to(dtype)
    pix = torch.randn(1, 3, image, image, generator=torch.Generator().manual_seed(0)).to(dtype)
    return model, {"pixel_values": pix}


class GeluMLP(torch.nn.Module):
    """The seed pull request's 2-layer GELU MLP (128 -> 256 -> 128 by default)."""

    def __init__(self, d: int = 128, h: int = 256):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def mlp(*, d=128, h=256, tokens=8, dtype=torch.bfloat16, **_: Any):
    torch.manual_seed(0)
    model = GeluMLP(d, h).eval().to(dtype)
    return model, {"x": torch.randn(1, tokens, d).to(dtype)}


MODELS: dict[str, Factory] = {
    "qwen3": qwen3,
    "qwen3-moe": qwen3_moe,
    "llama": llama,
    "mistral": mistral,
    "gpt2": gpt2,
    "bert": bert,
    "vit": vit,
    "mlp": mlp,
}
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-tiny": ("qwen3", {}),
    "llama-tiny": ("llama", {}),
    "qwen3-4l-1024": ("qwen3", dict(layers=4, hidden=1024, heads=16, kv_heads=8, vocab=32000)),
    "llama-4l-1024": ("llama", dict(layers=4, hidden=1024, heads=16, kv_heads=8, vocab=32000)),
}


def get(name: str, **overrides: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build a model by name (``qwen3``, ``qwen3-tiny``, ...); unknown names list the known."""
    if name in PRESETS:
        base, kw = PRESETS[name]
        return MODELS[base](**{**kw, **overrides})
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS) + sorted(PRESETS)}")
    return MODELS[name](**overrides)
