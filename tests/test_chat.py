"""Chat on tiny random models: equality with the stock model, reuse, sharing, bad input."""

from __future__ import annotations

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.errors import (
    ContextWindowExceededError,
    InvalidMessageError,
    InvalidSessionIdError,
    OutOfBlocksError,
)
from chatkv.models import load_model

from conftest import stock_copy


def make_engine(arch: str = "llama", **cfg) -> Engine:
    cfg.setdefault("num_blocks", 256)
    cfg.setdefault("block_size", 4)
    return Engine(load_model(f"tiny:{arch}"), EngineConfig(**cfg))


def stock_greedy(reference, tokenizer, messages, max_new_tokens, eos_id):
    """What transformers alone answers: re-prefill the whole templated history, greedy."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_three_turns_equal_stock_reprefill(arch):
    engine = make_engine(arch)
    reference = stock_copy(engine.loaded.model)
    tok = engine.tokenizer
    chat = Chat("s1", system="You are terse.", engine=engine, max_new_tokens=12)
    for turn, text in enumerate(["Hello there", "Tell me a story", "Ünïcödé 🙂 ok?"]):
        history = chat.messages + [{"role": "user", "content": text}]
        want = stock_greedy(reference, tok, history, 12, tok.eos_token_id)
        chat.send(text)
        assert chat.last_stats.token_ids == want, f"turn {turn}"
        stats = chat.last_stats
        assert stats.reused_tokens + stats.prefilled_tokens == stats.prompt_tokens
        if turn:
            assert stats.reused_tokens > 0
    chat.close()
    assert engine.pool_stats().used_blocks == 0


def test_sessions_with_the_same_system_prompt_share_blocks_and_free_them():
    engine = make_engine(block_size=4)
    start = engine.pool_stats().available_blocks
    system = "You are a terse assistant. " * 3
    a = Chat("alice", system=system, engine=engine, max_new_tokens=4)
    a.send("Hi")
    b = Chat("bob", system=system, engine=engine, max_new_tokens=4)
    b.send("Yo")
    assert b.last_stats.prefix_cache_tokens >= 16
    assert b.last_stats.prefilled_tokens == b.last_stats.prompt_tokens - b.last_stats.prefix_cache_tokens
    assert engine.pool_stats().shared_blocks >= 4
    a.close()
    b.close()
    assert engine.pool_stats().available_blocks == start
    assert engine.pool_stats().used_blocks == 0


def test_reopening_a_session_in_process_continues_its_history():
    engine = make_engine()
    chat = Chat("again", system="sys", engine=engine, max_new_tokens=5)
    chat.send("one")
    cached = chat.num_cached_tokens
    again = Chat("again", engine=engine, max_new_tokens=5)
    assert again.messages == chat.messages
    again.send("two")
    assert again.last_stats.reused_tokens >= cached - again.last_stats.discarded_tokens
    assert len(again.messages) == 5


def test_fork_shares_blocks_and_diverges_independently():
    engine = make_engine()
    parent = Chat("parent", system="sys", engine=engine, max_new_tokens=6)
    parent.send("base question")
    used = engine.pool_stats().used_blocks
    child = parent.fork("child")
    assert engine.pool_stats().used_blocks == used  # no copy yet
    assert child.messages == parent.messages
    child.send("child question")
    parent.send("parent question")
    assert child.messages[-2]["content"] == "child question"
    assert parent.messages[-2]["content"] == "parent question"
    with pytest.raises(InvalidSessionIdError, match="already exists"):
        parent.fork("child")
    parent.close()
    child.close()
    assert engine.pool_stats().used_blocks == 0


@pytest.mark.parametrize("bad", ["", "../../etc", "a/b", "..", ".hidden", "x" * 129, "semi;colon", 42])
def test_bad_session_ids_are_refused(bad):
    engine = make_engine()
    with pytest.raises(InvalidSessionIdError):
        Chat(bad, engine=engine)


def test_bad_messages_leave_the_session_usable():
    engine = make_engine()
    chat = Chat("ok", engine=engine, max_new_tokens=3)
    chat.send("hello")
    before = chat.messages
    for bad in ["", "   ", None]:
        with pytest.raises(InvalidMessageError):
            chat.send(bad)
    too_long = "word " * engine.max_context  # at least one token per word: past the window
    with pytest.raises(ContextWindowExceededError, match="context"):
        chat.send(too_long)
    assert chat.messages == before
    chat.send("still here")
    assert len(chat.messages) == len(before) + 2


def test_pool_exhaustion_is_a_clear_error_and_recoverable():
    engine = make_engine(num_blocks=12, block_size=4)
    hog = Chat("hog", engine=engine, max_new_tokens=2)
    with pytest.raises(OutOfBlocksError, match="blocks"):
        hog.send("a long message " * 8)
    assert hog.messages == []
    small = Chat("small", engine=engine, max_new_tokens=2)
    hog.close()
    small.send("hi")
    assert len(small.messages) == 2


def test_stopping_a_stream_keeps_the_partial_reply():
    engine = make_engine()
    chat = Chat("partial", engine=engine, max_new_tokens=30)
    stream = chat.stream("tell me everything")
    pieces = [next(stream) for _ in range(2)]
    stream.close()
    assert chat.messages[-1]["role"] == "assistant"
    assert chat.history[-1].partial
    assert chat.messages[-1]["content"].startswith("".join(pieces))
    chat.send("next")  # the session is still usable
    assert not chat.history[-1].partial


def test_keyboard_interrupt_mid_generation_keeps_the_session(monkeypatch):
    engine = make_engine()
    chat = Chat("ctrlc", engine=engine, max_new_tokens=30, ignore_eos=True)
    chat.send("first")
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_forward(batch)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    with pytest.raises(KeyboardInterrupt):
        chat.send("second")
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert chat.history[-1].partial and chat.last_stats.finish_reason == "interrupted"
    monkeypatch.setattr(engine.runner, "forward", real_forward)
    chat.send("third")
    assert len(chat.messages) == 6


def test_stop_strings_and_sampling_options():
    engine = make_engine()
    chat = Chat("opts", engine=engine, max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    r1 = chat.send("x")
    chat2 = Chat("opts2", engine=engine, max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=7)
    assert chat2.send("x") == r1  # seeded sampling is reproducible
    greedy = Chat("g", engine=engine, max_new_tokens=16).send("y")
    if len(greedy) > 3:
        stop = greedy[2:4]
        cut = Chat("g2", engine=engine, max_new_tokens=16, stop=[stop]).send("y")
        assert cut == greedy[: greedy.index(stop)]
