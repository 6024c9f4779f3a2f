"""Conversations longer than the context window (issue 16): the ``sink`` policy.

The sink policy keeps the first tokens and the most recent window in the cache,
drops the oldest tokens after the sink in whole blocks and rotates the kept
keys down in place (:mod:`chatkv.rope`): nothing is re-prefilled.
"""

from __future__ import annotations

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.block_pool import BlockPool, block_hash
from chatkv.engine import Engine
from chatkv.errors import ConfigError
from chatkv.models import load_model
from chatkv.persistence import SHIFT_SEP, default_store
from chatkv.rope import rope_shift_for, shift_blocks
from chatkv.sequence import Sequence, Shift

SYSTEM = "You are a terse assistant who answers in one short line."
N = 8


def question(turn: int) -> str:
    return f"Question number {turn}: tell me something about the number {turn}."


# -- the shift itself ------------------------------------------------------------------


def _config(family: str = "llama", rope: dict | None = None, **extra):
    from transformers import AutoConfig

    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, **extra)
    if rope is not None:
        kw["rope_parameters"] = rope
    return AutoConfig.for_model(family, **kw)


def _model(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def _embedded(model, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys ``[tokens, heads, dim]`` embedded at ``positions`` by the model's own rotary code."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = k.transpose(0, 1)[None]  # [1, heads, tokens, dim]
    cos, sin = model.model.rotary_emb(x, positions[None])
    _, out = apply_rotary_pos_emb(x, x, cos, sin)
    return out[0].transpose(0, 1)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}


def _check_exact(model) -> None:
    rope = rope_shift_for(model)
    torch.manual_seed(0)
    k = torch.randn(40, 2, rope.head_dim)
    p = torch.arange(1500, 1540)
    # The model embeds positions in float32: its angle p * theta is off by up to
    # p * eps / 2, on each side of the comparison. The shift itself adds ~nothing.
    tol = 2 * float(p.max()) * torch.finfo(torch.float32).eps * float(k.abs().max())
    for delta in (1, 16, 700, 1499):
        want = _embedded(model, k, p - delta)  # RoPE(k, p - d), computed directly
        got = rope.shift(_embedded(model, k, p), delta)  # the shift applied to RoPE(k, p)
        assert torch.allclose(got, want, atol=tol, rtol=0), (rope.rope_type, delta, (got - want).abs().max(), tol)


@pytest.mark.parametrize("family,rope", [
    ("llama", None), ("llama", LLAMA3),
    ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ("llama", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 512}),
    ("qwen2", None), ("qwen3", None),
])
def test_the_shift_equals_rope_at_the_new_position(family, rope):
    _check_exact(_model(_config(family, rope)))


def test_the_shift_is_exact_for_the_tiny_model_and_smollm2(smollm2):
    _check_exact(load_model("tiny:llama").model)
    _check_exact(smollm2.model)


def test_shift_blocks_rotates_keys_in_the_pool_and_leaves_values():
    model = load_model("tiny:llama").model
    rope = rope_shift_for(model)
    pool = BlockPool(8, 4, 1, 2, 16, torch.float32, "cpu", "ns")
    torch.manual_seed(1)
    raw = torch.randn(8, 4, 2, 16)
    positions = torch.arange(32).view(8, 4)
    for b in range(8):
        pool.kv[0, 0, b] = _embedded(model, raw[b], positions[b] + 100)
    pool.kv[0, 1] = raw
    shift_blocks(pool.kv, [2, 5], 60, rope)
    for b in range(8):
        want = _embedded(model, raw[b], positions[b] + (40 if b in (2, 5) else 100))
        assert torch.allclose(pool.kv[0, 0, b], want, atol=1e-4)
    assert torch.equal(pool.kv[0, 1], raw)


def test_sink_is_refused_for_a_model_whose_positions_cannot_be_shifted():
    dynamic = _model(_config("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    with pytest.raises(ConfigError, match="dynamic"):
        rope_shift_for(dynamic)
    from transformers import AutoConfig

    gpt2 = _model(AutoConfig.for_model("gpt2", vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="sink"):
        rope_shift_for(gpt2)
    loaded = load_model("tiny:llama")
    loaded.extra.pop("rope_shift", None)
    real = loaded.model.config.rope_parameters
    loaded.model.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    engine = Engine(loaded, EngineConfig(num_blocks=64, block_size=4))
    try:
        rotary = loaded.model.model.rotary_emb
        rotary.rope_type, kept = "longrope", rotary.rope_type
        with pytest.raises(ConfigError, match="longrope"):
            Chat("refused", engine=engine, context_policy="sink", persist=False)
    finally:
        rotary.rope_type = kept
        loaded.model.config.rope_parameters = real
        loaded.extra.pop("rope_shift", None)
    with pytest.raises(ConfigError, match="sink_tokens"):
        Chat("bad-sink", engine=engine, context_policy="sink", sink_tokens=-1, persist=False)


# -- the pool: shifted blocks are never served as unshifted ones -------------------------


def test_shifted_blocks_hash_under_the_shift_and_are_not_matched_by_a_plain_prefix():
    pool = BlockPool(32, 4, 1, 1, 16, torch.float32, "cpu", "ns")
    rope = rope_shift_for(load_model("tiny:llama").model)
    seq = Sequence()
    pool.write_tokens(seq, list(range(24)), torch.randn(1, 2, 24, 1, 16))
    other = pool.fork(seq)  # shares every block: the shift must copy, not rotate, them
    shared_before = pool.kv[:, :, other.block_table].clone()
    shift = Shift(4, 8, b"k" * 8)
    pool.drop_and_shift(seq, 4, 8, shift, lambda kv, blocks, n: shift_blocks(kv, blocks, n, rope))
    assert seq.token_ids == list(range(4)) + list(range(12, 24)) and seq.num_computed == 16
    assert seq.block_table[0] == other.block_table[0]  # the sink block is still shared
    assert torch.equal(pool.kv[:, :, other.block_table], shared_before)  # the fork's KV is untouched
    plain = block_hash(block_hash(None, (0, 1, 2, 3), pool.namespace), (12, 13, 14, 15), pool.namespace)
    assert seq.block_hashes[0] == block_hash(None, (0, 1, 2, 3), pool.namespace)
    assert seq.block_hashes[1] != plain
    # A sequence with the same token ids but no shift gets the sink block only.
    fresh = Sequence()
    assert pool.match_prefix(fresh, seq.token_ids + [99]) == 4
    # The shifted sequence itself (after a preemption) gets all of its blocks back.
    again = Sequence(shift=shift)
    assert pool.match_prefix(again, seq.token_ids + [99]) == 16
    for s in (seq, other, fresh, again):
        pool.release(s)
    assert pool.num_available == pool.num_blocks


# -- conversations ---------------------------------------------------------------------


def test_sink_runs_past_three_windows_with_no_history_re_prefilled(smollm2):
    window = 160
    engine = Engine(smollm2, EngineConfig(kv_budget_bytes=64 << 20, block_size=16, max_context=window))
    chat = Chat("sink-long", engine=engine, system=SYSTEM, max_new_tokens=N, context_policy="sink",
                persist=False)
    total = turn = drops = 0
    while total < 3 * window:
        before, cached = chat.messages, chat.num_cached_tokens
        chat.send(question(turn))
        s = chat.last_stats
        assert s.prompt_tokens + N <= window and len(s.token_ids) > 0
        # Every cached token's KV is reused, across drops too (minus what the drop let go) ...
        assert s.discarded_tokens == 0 and s.reused_tokens == cached - s.shifted_tokens, (turn, s)
        # ... so the prefill is the new turn alone: its tokens, plus the template's close of the
        # previous reply (at most its last sampled token, an end-of-turn token and a newline).
        new = len(engine.encode_chat(chat.messages[:-1])) - len(engine.encode_chat(before, add_generation_prompt=False))
        assert s.prefilled_tokens <= new + 3 or not turn, (turn, s.prefilled_tokens, new)
        drops += s.shifted_tokens > 0
        total += new + len(s.token_ids)
        turn += 1
    assert drops >= 2
    seq = chat._session.kv.seq
    assert seq.shift is not None and seq.shift.sink == 16 and seq.shift.dropped >= window
    history = chat.history
    assert len(history) == 1 + 2 * turn and history[0].role == "system" and not history[0].outside
    assert any(m.outside for m in history) and not any(m.outside for m in history[-4:])
    chat.close()


def _tiny_engine() -> Engine:
    return Engine(load_model("tiny:llama"), EngineConfig(num_blocks=512, block_size=4, max_context=192))


def _until_shifted(chat: Chat, start: int = 0) -> int:
    turn = start
    while chat._session.kv.seq.shift is None or chat.last_stats.shifted_tokens:
        chat.send(question(turn))
        turn += 1
    return turn


def test_a_shifted_session_answers_the_same_after_offload_disk_and_restart():
    engine = _tiny_engine()
    kw = dict(max_new_tokens=N, context_policy="sink", chunk_tokens=16)
    ref = Chat("ref", engine=_tiny_engine(), system=SYSTEM, persist=False, **kw)
    chat = Chat("spill", engine=engine, system=SYSTEM, **kw)
    turn = _until_shifted(chat)
    for t in range(turn):
        ref.send(question(t))
    assert ref.history == chat.history and ref.last_stats.token_ids == chat.last_stats.token_ids
    shift = chat._session.kv.seq.shift
    # Every stored chunk carries the shift (part of its hash).
    chunks = default_store().kv_chunks("spill")
    assert chunks and all(c.kv_format.endswith(SHIFT_SEP + shift.tag) for c in chunks)

    def step(c: Chat, r: Chat, t: int, source: str) -> None:
        c.send(question(t))
        r.send(question(t))
        assert c.last_stats.kv_source == source
        assert c.last_stats.token_ids == r.last_stats.token_ids, (source, t)
        assert c.last_stats.reused_tokens == r.last_stats.reused_tokens  # nothing was re-prefilled

    assert engine.sessions.demote("spill", "host")
    step(chat, ref, turn, "host")
    assert engine.sessions.demote("spill", "disk")
    step(chat, ref, turn + 1, "disk")
    cached, shift = chat.num_cached_tokens, chat._session.kv.seq.shift
    chat.close()
    again = Chat("spill", engine=_tiny_engine(), **kw)  # a new engine: a restart
    info = again.wait_restored()
    assert info.source == "disk" and info.cached_tokens == cached and again._session.kv.seq.shift == shift
    step(again, ref, turn + 2, "device")
    # The conversation goes on past more drops, still in step with the reference.
    for t in range(turn + 3, turn + 12):
        step(again, ref, t, "device")
    assert again._session.kv.seq.shift.dropped > shift.dropped
    again.close()
    ref.close()


def test_a_rewind_into_the_dropped_part_starts_the_window_again():
    engine = _tiny_engine()
    chat = Chat("rw", engine=engine, system=SYSTEM, max_new_tokens=N, context_policy="sink", persist=False)
    turn = _until_shifted(chat)
    chat.rewind(turn - 1)  # back to the first turn, long dropped
    assert chat._session.kv.seq.shift is None
    chat.send("a new second question")
    s = chat.last_stats
    assert s.shifted_tokens == 0 and s.reused_tokens >= 4  # the sink (the system prompt's start) was kept
    assert len(chat.messages) == 5
    chat.close()


def test_the_repl_takes_the_sink_policy():
    from click.testing import CliRunner

    from chatkv.cli.main import main

    args = ["repl", "--model", "tiny:llama", "--session", "sink-repl", "--max-new-tokens", "4",
            "--context-policy", "sink", "--sink-tokens", "8"]
    res = CliRunner().invoke(main, args, input="hi\nthere\n", catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert res.stderr.count("[reused") == 2
    assert "sink" in CliRunner().invoke(main, ["repl", "--help"]).stdout


def test_a_new_system_prompt_starts_the_window_again():
    engine = _tiny_engine()
    chat = Chat("sys", engine=engine, system=SYSTEM, max_new_tokens=N, context_policy="sink", persist=False)
    turn = _until_shifted(chat)
    chat.set_system("Be brief.")
    chat.send(question(turn))
    s = chat.last_stats
    assert s.prompt_tokens + N <= engine.max_context and len(s.token_ids) > 0
    shift = chat._session.kv.seq.shift
    # Either the whole history fits again, or a fresh drop was made against the new prompt.
    assert shift is None or s.shifted_tokens > 0
    chat.close()
