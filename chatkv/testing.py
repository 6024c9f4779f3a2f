"""Tiny random chat models for tests and examples.

``tiny_model("llama")`` builds, in well under a second, a deterministic random
model of the given architecture and a byte-level BPE tokenizer with a ChatML
chat template. Every process builds identical weights, so fingerprints (and
therefore persisted KV) are stable across restarts.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache keeps the keys and values of every token the model has seen.",
    "Paged attention stores them in fixed-size blocks, like virtual memory pages.",
    "You are a terse assistant. Hello! How are you today? Tell me a story.",
    "Ünïcödé text, emoji 🙂 and numbers 0123456789 must round-trip too.",
]

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (~300 tokens) with ChatML special tokens.

    Any text round-trips through it. ``<|im_end|>`` is the end-of-sequence token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, eos_token_id: int) -> Any:
    """A transformers config for a 2-layer model of ``arch`` with GQA (4 query heads,
    2 KV heads). Mistral and Qwen use a 24-token sliding window (Qwen on one of
    its layers only) so that windowed attention is exercised."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        return AutoConfig.for_model("llama", **common)
    if arch == "mistral":
        return AutoConfig.for_model("mistral", sliding_window=24, **common)
    if arch in ("qwen2", "qwen3"):
        cfg = AutoConfig.for_model(
            arch, use_sliding_window=True, sliding_window=24, max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"], **common,
        )
        return cfg
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHS}")


def tiny_model(arch: str = "llama", seed: int = 0) -> tuple[Any, Any]:
    """Build ``(model, tokenizer)``: a deterministic random ``arch`` model in float32.

    Raises:
        ValueError: ``arch`` is not one of :data:`ARCHS`.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    config = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Larger-than-default weights give peaked, arch-specific logits, so greedy
        # tokens are stable and differences in attention show up in tests.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.15)
    model.eval()
    return model, tokenizer
