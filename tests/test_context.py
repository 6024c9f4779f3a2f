"""Conversations longer than the context window (issue 16): the ``trim`` policy."""

from __future__ import annotations

import pytest

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.errors import ConfigError, ContextWindowExceededError
from chatkv.models import load_model

from conftest import stock_copy
from test_chat import stock_greedy

WINDOW = 512
N = 8
SYSTEM = "You are a terse assistant who answers in one short line."


def make_engine(window: int = WINDOW) -> Engine:
    return Engine(load_model("tiny:llama"), EngineConfig(num_blocks=512, block_size=4, max_context=window))


def kept(chat: Chat) -> list[dict[str, str]]:
    return [m.as_dict() for m in chat.history if not m.outside]


def test_trim_runs_past_three_windows_answering_as_stock_on_the_kept_messages():
    engine = make_engine()
    assert engine.max_context == WINDOW
    reference = stock_copy(engine.loaded.model)
    tok = engine.tokenizer
    system_tokens = len(engine.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    chat = Chat("long", engine=engine, system=SYSTEM, max_new_tokens=N)
    total = trims = reusing = 0
    turn = 0
    while total < 3 * WINDOW:
        text = f"Question number {turn}: tell me something about the number {turn}."
        chat.send(text)
        s = chat.last_stats
        window = kept(chat)[:-1]  # what the turn ran on, after any trim
        assert window[-1] == {"role": "user", "content": text}
        want = stock_greedy(reference, tok, window, N, tok.eos_token_id)
        assert s.token_ids == want, turn  # the stock model on exactly the kept messages
        assert s.prompt_tokens + N <= WINDOW
        if s.trimmed_messages:
            trims += 1
            assert s.reused_tokens >= system_tokens  # the system prompt's KV survived the trim
        elif turn and s.reused_tokens > s.prompt_tokens // 2:
            reusing += 1  # between trims the kept turns' KV is reused
        total += s.prompt_tokens - s.reused_tokens + len(s.token_ids)
        turn += 1
    assert trims >= 2
    history = chat.history
    assert len(history) == 1 + 2 * turn  # the stored history keeps everything
    assert history[0].role == "system" and not history[0].outside
    assert any(m.outside for m in history) and not history[-1].outside
    assert reusing > trims  # trimming to half the window leaves room for several turns
    chat.close()


def test_the_window_survives_a_restart():
    engine = make_engine()
    chat = Chat("restart", engine=engine, system=SYSTEM, max_new_tokens=N, chunk_tokens=16)
    turn = 0
    while not any(m.outside for m in chat.history) or chat.last_stats.trimmed_messages:
        chat.send(f"Question number {turn}: tell me something about the number {turn}.")
        turn += 1
    window = [m.outside for m in chat.history]
    cached = chat.num_cached_tokens
    chat.close()
    again = Chat("restart", engine=make_engine(), max_new_tokens=N, chunk_tokens=16)
    assert again.wait_restored().cached_tokens == cached
    assert [m.outside for m in again.history] == window  # stored with the history
    again.send("one more")
    assert again.last_stats.trimmed_messages == 0  # the same window: no new trim ...
    assert again.last_stats.reused_tokens >= again.last_stats.prompt_tokens // 2  # ... and its KV reused
    again.close()


def test_error_policy_raises_and_keeps_the_session():
    engine = make_engine()
    chat = Chat("strict", engine=engine, system=SYSTEM, max_new_tokens=N, context_policy="error")
    with pytest.raises(ContextWindowExceededError):
        for turn in range(100):
            chat.send(f"Question number {turn}: tell me something about the number {turn}.")
    assert len(chat.messages) == 1 + 2 * turn  # the failing turn changed nothing
    assert not any(m.outside for m in chat.history)
    chat.close()
    with pytest.raises(ConfigError, match="context_policy"):
        Chat("bad-policy", engine=engine, context_policy="sideways")


def test_a_message_longer_than_the_window_is_refused_even_under_trim():
    engine = make_engine()
    chat = Chat("huge", engine=engine, system=SYSTEM, max_new_tokens=N)
    chat.send("hello")
    with pytest.raises(ContextWindowExceededError):
        chat.send("word " * WINDOW)
    assert len(chat.messages) == 3
    chat.close()


def test_max_context_is_validated():
    with pytest.raises(ConfigError):
        EngineConfig(max_context=1)
