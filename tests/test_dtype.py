"""The model's dtype: bfloat16 where the CPU computes it natively, float32 elsewhere, or as configured.

bfloat16 answers are compared with the stock model in bfloat16, teacher-forced:
at every position of chatkv's greedy reply, its token is the stock model's
top-1, or ties with it within two bfloat16 rounding steps of the logit (two
computations of the same bf16 forward in a different order can swap such a
near-tie; anything wider is a real difference).
"""

from __future__ import annotations

import math

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.attention import torch_backend
from chatkv.engine import Engine, get_engine
from chatkv.errors import ConfigError
from chatkv.hardware import DTYPE_ENV, cpu_has_fast_bf16, default_dtype, parse_dtype, resolve_dtype
from chatkv.models import load_model

from conftest import stock_copy

TURNS = ["Hello there", "Tell me a story", "And then?"]


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values around ``x`` (8 bits of mantissa)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def teacher_forced_check(reference, prompt_ids: list[int], reply_ids: list[int]) -> tuple[int, float]:
    """(positions where ``reply_ids`` is not the reference's top-1, widest such gap in ulps).

    Fails if any such position's gap exceeds two bfloat16 ulps of the top logit.
    """
    with torch.no_grad():
        logits = reference(torch.tensor([prompt_ids + reply_ids])).logits[0].float()
    rows = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(reply_ids)]
    misses, widest = 0, 0.0
    for i, tok in enumerate(reply_ids):
        top = int(rows[i].argmax())
        if top == tok:
            continue
        misses += 1
        gap = float(rows[i, top] - rows[i, tok]) / bf16_ulp(float(rows[i, top]))
        widest = max(widest, gap)
        assert gap <= 2.0, f"position {i}: chatkv chose {tok}, stock's top-1 {top} leads by {gap:.1f} ulps"
    return misses, widest


def test_names_and_auto() -> None:
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    assert parse_dtype(torch.float16) is torch.float16
    for bad in ("int8", "float64", "", torch.float64):
        with pytest.raises(ConfigError):
            parse_dtype(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="double")
    assert default_dtype("cpu", frozenset({"avx512f", "avx512_bf16"})) is torch.bfloat16
    assert default_dtype("cpu", frozenset({"amx_bf16", "amx_tile"})) is torch.bfloat16
    assert default_dtype("cpu", frozenset({"avx2", "avx512f"})) is torch.float32
    assert default_dtype("cpu") is (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)


def test_the_environment_decides_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    assert resolve_dtype(None) is torch.bfloat16 and resolve_dtype("auto") is torch.bfloat16
    assert resolve_dtype("float32") is torch.float32  # explicit beats the environment
    monkeypatch.setenv(DTYPE_ENV, "auto")
    assert resolve_dtype(None) is default_dtype("cpu")
    monkeypatch.setenv(DTYPE_ENV, "float64")
    with pytest.raises(ConfigError):
        resolve_dtype(None)


def test_engines_load_specs_in_the_configured_dtype_and_refuse_a_mismatch() -> None:
    bf = get_engine("tiny:llama", EngineConfig(dtype="bf16", num_blocks=64, block_size=4))
    fp = get_engine("tiny:llama", EngineConfig(dtype="float32", num_blocks=64, block_size=4))
    assert bf.loaded.dtype is torch.bfloat16 and bf.pool.kv.dtype is torch.bfloat16
    assert fp.loaded.dtype is torch.float32 and fp.pool.kv.dtype is torch.float32
    assert bf.loaded.fingerprint != fp.loaded.fingerprint  # a cache of one is never used by the other
    with pytest.raises(ConfigError, match="differs from the loaded model"):
        Engine(fp.loaded, EngineConfig(dtype="bfloat16"))


@pytest.mark.parametrize("cpu_attention", ["auto", "sdpa"])
def test_bf16_replies_match_stock_bf16_and_survive_a_restart(tmp_path, cpu_attention, monkeypatch) -> None:
    # "auto" attends by bf16 products from position 8 on (1024 by default:
    # this model's turns are short), "sdpa" never.
    monkeypatch.setattr(torch_backend, "PRODUCTS_FROM_POSITION", 8)
    products = []
    attend = torch_backend.product_attention
    monkeypatch.setattr(torch_backend, "product_attention", lambda *a, **kw: products.append(1) or attend(*a, **kw))
    config = EngineConfig(num_blocks=256, block_size=4, cpu_attention=cpu_attention)
    engine = Engine(load_model("tiny:llama", dtype=torch.bfloat16), config)
    reference = stock_copy(engine.loaded.model)
    tok = engine.tokenizer
    chat = Chat("bf", system="You are terse.", engine=engine, max_new_tokens=12)
    for text in TURNS:
        history = chat.messages + [{"role": "user", "content": text}]
        prompt = tok(tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        chat.send(text)
        assert chat.last_stats.prompt_tokens == len(prompt)
        teacher_forced_check(reference, prompt, chat.last_stats.token_ids)
    twin = Chat("bf-twin", system="You are terse.", engine=engine, max_new_tokens=12, persist=False)
    for text in TURNS:
        twin.send(text)
    twin.send("One more.")
    want = twin.last_stats.token_ids
    twin.close()
    chat.close()  # saved to disk in bf16

    fresh = Engine(load_model("tiny:llama", dtype=torch.bfloat16), config)
    resumed = Chat("bf", engine=fresh, max_new_tokens=12)
    assert resumed.wait_restored().source == "disk"
    resumed.send("One more.")
    assert resumed.last_stats.token_ids == want  # restored bf16 KV is exactly the KV it was
    assert resumed.last_stats.reused_tokens > 0
    resumed.close()
    assert bool(products) == (cpu_attention == "auto")


def test_a_float32_engine_never_uses_a_bfloat16_cache() -> None:
    bf = Engine(load_model("tiny:llama", dtype=torch.bfloat16), EngineConfig(num_blocks=128, block_size=4))
    chat = Chat("x", system="s", engine=bf, max_new_tokens=4)
    chat.send("hi")
    chat.close()
    fp = Engine(load_model("tiny:llama", dtype=torch.float32), EngineConfig(num_blocks=128, block_size=4))
    again = Chat("x", engine=fp, max_new_tokens=4)
    assert again.wait_restored().source == "history"
    again.send("and again")
    assert again.last_stats.reused_tokens == 0  # another fingerprint: re-prefilled, history kept
    assert [m["content"] for m in again.messages][:2] == ["s", "hi"]
    again.close()


@pytest.mark.smollm2
def test_smollm2_in_bf16_matches_stock_bf16(smollm2_bf16) -> None:
    engine = Engine(smollm2_bf16, EngineConfig(kv_budget_bytes=256 << 20, block_size=16))
    reference = stock_copy(engine.loaded.model)
    tok = engine.tokenizer
    chat = Chat("smol-bf16", system="You are a terse assistant.", engine=engine, max_new_tokens=32)
    misses = total = 0
    for text in ["What is a KV cache? Answer in one sentence.", "Why would one page it into blocks?",
                 "Tell me a short story about a cat."]:
        history = chat.messages + [{"role": "user", "content": text}]
        prompt = tok(tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        chat.send(text)
        m, _ = teacher_forced_check(reference, prompt, chat.last_stats.token_ids)
        misses += m
        total += len(chat.last_stats.token_ids)
        assert chat.last_stats.reused_tokens > 0 or len(chat.messages) <= 3
    assert misses <= total // 10  # near-ties only, and few of them
    chat.close()
