"""The default model, SmolLM2-135M-Instruct (fp32): chatkv answers exactly as
transformers does when it re-prefills the whole history every turn."""

from __future__ import annotations

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine

pytestmark = pytest.mark.smollm2

#: fp32 logits of chatkv (paged SDPA, prefill of the delta only) vs transformers
#: (SDPA over the whole history): measured max abs difference is ~1e-5.
LOGIT_ATOL = 1e-4

TURNS = [
    "What is a KV cache? Answer in one sentence.",
    "Why would one page it into blocks?",
    "Name one drawback.",
]
SYSTEM = "You are a terse assistant."
MAX_NEW = 24


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, EngineConfig(kv_budget_bytes=256 << 20, block_size=16))


def stock_turn(reference, tokenizer, messages, max_new=MAX_NEW):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        first_logits = reference(x).logits[0, -1].float()
        out = reference.generate(x, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(ids):].tolist(), first_logits, len(ids)


def test_three_turns_match_stock_transformers(engine, smollm2_reference, monkeypatch):
    tok = engine.tokenizer
    chat = Chat("smol-3turns", system=SYSTEM, engine=engine, max_new_tokens=MAX_NEW)
    first_logits = []
    real_forward = engine.runner.forward

    def recording(batch):
        logits = real_forward(batch)
        first_logits.append(logits[0].clone())
        return logits

    monkeypatch.setattr(engine.runner, "forward", recording)
    prev_len = 0
    for turn, text in enumerate(TURNS):
        history = chat.messages + [{"role": "user", "content": text}]
        want_ids, want_logits, prompt_len = stock_turn(smollm2_reference, tok, history)
        first_logits.clear()
        reply = chat.send(text)
        got = chat.last_stats.token_ids
        assert got == want_ids, f"turn {turn}: {tok.decode(got)!r} != {tok.decode(want_ids)!r}"
        assert reply.strip()
        diff = (first_logits[0] - want_logits).abs().max().item()
        assert diff < LOGIT_ATOL, f"turn {turn}: first-token logits differ by {diff}"
        stats = chat.last_stats
        assert stats.prompt_tokens == prompt_len
        if turn:
            # Only the new turn is prefilled: everything up to the end of the
            # previous reply comes from the cache.
            assert stats.discarded_tokens == 0
            assert stats.reused_tokens == prev_len
            assert stats.prefilled_tokens == prompt_len - prev_len
            assert stats.prefilled_tokens < 40
        prev_len = chat.num_cached_tokens
    chat.close()
    assert engine.pool_stats().used_blocks == 0


def test_shared_system_prompt_is_prefilled_once(engine):
    start = engine.pool_stats().available_blocks
    system = "You are a helpful assistant who answers questions about databases. " * 4
    a = Chat("smol-a", system=system, engine=engine, max_new_tokens=4)
    a.send("Hi")
    b = Chat("smol-b", system=system, engine=engine, max_new_tokens=4)
    b.send("Hello")
    assert b.last_stats.prefix_cache_tokens >= 48
    assert engine.pool_stats().shared_blocks >= 3
    a.close()
    b.close()
    assert engine.pool_stats().available_blocks == start


_PROCESS_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(2)
from chatkv import Chat, EngineConfig
turns = json.loads(sys.argv[1])
chat = Chat("smol-restart", system=sys.argv[2], max_new_tokens=int(sys.argv[3]),
            engine_config=EngineConfig(kv_budget_bytes=256 << 20))
info = chat.wait_restored()
out = {"restore": info.source, "restored_tokens": info.cached_tokens, "turns": []}
for text in turns:
    chat.send(text)
    s = chat.last_stats
    out["turns"].append({"ids": chat.last_stats.token_ids, "reused": s.reused_tokens,
                         "prefilled": s.prefilled_tokens, "prompt": s.prompt_tokens})
out["cached"] = chat.num_cached_tokens
chat.close()
print("RESULT" + json.dumps(out))
"""


def _run_process(turns, home):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, CHATKV_HOME=str(home))
    proc = subprocess.run(
        [sys.executable, "-c", _PROCESS_SCRIPT, json.dumps(turns), SYSTEM, str(MAX_NEW)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_resume_in_a_new_process_prefills_only_the_new_turn(engine, smollm2_reference, chatkv_home):
    first = _run_process(TURNS[:2], chatkv_home)
    assert first["restore"] == "new"
    second = _run_process(TURNS[2:], chatkv_home)
    assert second["restore"] == "disk" and second["restored_tokens"] == first["cached"]
    turn3 = second["turns"][0]
    assert turn3["reused"] == first["cached"]
    assert turn3["prefilled"] == turn3["prompt"] - first["cached"] < 40

    # The same three turns in one process (no persistence) ...
    single = Chat("smol-single", system=SYSTEM, engine=engine, persist=False, max_new_tokens=MAX_NEW)
    for text in TURNS:
        single.send(text)
    assert turn3["ids"] == single.last_stats.token_ids
    # ... and transformers re-prefilling the whole history.
    history = single.messages[:-1]
    want, _, _ = stock_turn(smollm2_reference, engine.tokenizer, history)
    assert turn3["ids"] == want
    single.close()


def test_trim_past_three_windows_matches_stock_on_the_kept_messages(smollm2, smollm2_reference):
    """Issue 16's must-show on the real model: a window of 256 tokens, a
    conversation whose stored history (every message, templated) grows past
    three windows under context_policy="trim" (26 turns of ~30 tokens)."""
    from chatkv.persistence import default_store

    window, new, turns = 256, 8, 26
    engine = Engine(smollm2, EngineConfig(kv_budget_bytes=64 << 20, block_size=16, max_context=window))
    tok = engine.tokenizer
    system_tokens = len(engine.encode_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    chat = Chat("smol-trim", system=SYSTEM, engine=engine, max_new_tokens=new)
    trims = 0
    for turn in range(turns):
        chat.send(f"Give me one fact about the number {turn + 1}.")
        s = chat.last_stats
        kept = [m.as_dict() for m in chat.history if not m.outside][:-1]
        want, _, n_prompt = stock_turn(smollm2_reference, tok, kept, new)
        assert s.token_ids == want, turn
        assert s.prompt_tokens == n_prompt and n_prompt + new <= window
        if s.trimmed_messages:
            trims += 1
            assert s.reused_tokens >= system_tokens  # the system prompt's KV is reused after a trim
    assert trims >= 3 and len(chat.history) == 1 + 2 * turns
    # The history itself, not the tokens processed (re-prefills count there), spans three windows.
    stored = len(engine.encode_chat(chat.messages, add_generation_prompt=False))
    assert stored >= 3 * window, stored
    records = default_store().messages("smol-trim")  # and the store keeps all of it, marked
    assert [(r.role, r.content, r.outside_window) for r in records] == \
        [(m.role, m.content, m.outside) for m in chat.history]
    inside = [m.as_dict() for m in chat.history if not m.outside]
    assert len(engine.encode_chat(inside, add_generation_prompt=False)) <= window  # the rest is marked outside
    chat.close()


def test_the_text_bound_is_at_least_every_tokens_decoded_length(smollm2):
    """``max_token_chars`` reads the vocabulary's spellings (milliseconds, where
    decoding every token took a tenth of a second of the first turn): it must
    still bound what any one token decodes to."""
    from chatkv.models import max_token_chars

    tok = smollm2.tokenizer
    longest = max(len(tok.convert_tokens_to_string([t])) for t in tok.get_vocab())
    assert max_token_chars(tok) >= longest
