"""Tiny random-weight models of each supported family, and helpers shared by the decode tests."""
from __future__ import annotations

import functools

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    # default init (0.02): with a sparse budget drafts are accepted ~20-50 % of the time
    initializer_range=0.02,
)


def make_config(family: str, **over):
    kw = dict(_COMMON)
    if family == "llama":
        kw.update(vocab_size=256, num_attention_heads=4, num_key_value_heads=2)
        kw.update(over)
        return LlamaConfig(**kw)
    if family == "qwen2":
        kw.update(vocab_size=200, num_attention_heads=6, num_key_value_heads=2)
        kw.update(over)
        return Qwen2Config(**kw)
    if family == "qwen3":
        kw.update(vocab_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        kw.update(over)
        return Qwen3Config(**kw)
    if family == "mistral":
        kw.update(vocab_size=128, num_attention_heads=4, num_key_value_heads=1, sliding_window=None)
        kw.update(over)
        return MistralConfig(**kw)
    raise KeyError(family)


_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
}


def make_model(family: str, seed: int = 0, **over):
    """A fresh fp32 random-weight model (2 layers, hidden 64), eval mode, sdpa attention."""
    torch.manual_seed(seed)
    cfg = make_config(family, **over)
    cfg._attn_implementation = "sdpa"
    model = _CLASSES[family](cfg).eval()
    model.generation_config.pad_token_id = 0
    return model


@functools.lru_cache(maxsize=None)
def cached_model(family: str):
    return make_model(family)


def make_prompts(vocab: int, lengths, seed: int = 1, pad_id: int = 0):
    """Left-padded random prompts ``[B, max(lengths)]`` (ids in ``[3, vocab)``) and their mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), T), dtype=torch.long)
    for b, L in enumerate(lengths):
        ids[b, T - L :] = torch.randint(3, vocab, (L,), generator=g)
        mask[b, T - L :] = 1
    return ids, mask


def hf_greedy(model, ids, mask, max_new_tokens, eos_token_id=None):
    with torch.inference_mode():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )


def first_diff(a, b):
    """Human-readable location of the first differing token of two [B, T] tensors."""
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    d = (a != b).nonzero()
    if len(d) == 0:
        return "equal"
    r, c = d[0].tolist()
    return f"row {r} col {c}: {a[r, max(0, c - 3): c + 4].tolist()} vs {b[r, max(0, c - 3): c + 4].tolist()}"


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared, busy machine every OpenMP barrier of
    a tiny op can wait a scheduler quantum; run them single-threaded and restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
