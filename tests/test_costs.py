"""Restore or recompute: the choice on both sides of its break-even point, and what it reports."""

from __future__ import annotations

import pytest

from chatkv import Chat, EngineConfig
from chatkv.costs import CostModel, LinearCost, resolve_policy
from chatkv.engine import Engine
from chatkv.errors import ConfigError, OutOfBlocksError
from chatkv.models import load_model
from chatkv.persistence import default_store

TURNS = ["Hello there", "Tell me a story", "And then?"]


def test_linear_fit() -> None:
    cost = LinearCost()
    assert cost.fit() is None and cost.predict(10) is None
    for size in (100, 200, 400):
        cost.add(size, 0.5 + 0.01 * size)
    fixed, slope = cost.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.5) and slope == pytest.approx(0.01)
    one = LinearCost()
    one.add(100, 2.0)
    one.add(100, 4.0)
    assert one.fit() == (0.0, pytest.approx(0.03))  # one size: a mean ratio, no fixed part
    cost.add(0, 1.0)  # ignored
    assert len(cost._samples) == 3


def test_fit_ignores_an_outlier_and_a_slope_lost_in_noise() -> None:
    cost = LinearCost()
    for size in (100, 200, 400, 800):
        cost.add(size, 0.5 + 0.01 * size)
    cost.add(128, 30.0)  # a step that compiled a kernel on its first run
    fixed, slope = cost.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.5) and slope == pytest.approx(0.01)
    flat = LinearCost()  # a GPU's eager step: launch overhead, whatever its length
    for size, seconds in ((64, 0.040), (256, 0.038), (1024, 0.041), (2048, 0.037)):
        flat.add(size, seconds)
    fixed, slope = flat.fit()  # type: ignore[misc]
    assert slope == 0.0 and fixed == pytest.approx(0.039)  # the median


def test_choice_counts_whole_steps() -> None:
    model = CostModel("auto", max_step_tokens=2048)
    for size, seconds in ((64, 0.040), (256, 0.040), (1024, 0.040)):  # all fixed: 40 ms a step
        model.record_prefill(size, seconds)
    for mb in (5, 25, 100):
        model.record_restore(mb * 10**6, 0.003 + 0.00035 * mb)  # 3 ms + 0.35 ms per MB
    # 6 ms of reading beside a 40 ms step is not worth a recompute; 12 ms is.
    assert model.choose(254, 6 * 10**6).decision == "restore"
    assert model.choose(1024, 26 * 10**6).decision == "recompute"
    # 4,097 tokens take 3 steps: two more fixed parts (80 ms) than the turn's own.
    long = model.choose(4097, 94 * 10**6)
    assert long.decision == "restore" and "in 3 steps 80 ms" in long.reason
    assert long.recompute_s == pytest.approx(0.080)


def test_turns_over_long_histories_do_not_make_a_recompute_look_free() -> None:
    """Returning turns (a few dozen tokens over histories of different
    lengths) cost what their attention to the history costs, not what their
    own tokens do: they are left out of the fit a recompute is predicted
    from. Fitted with the fresh prefills, they made its slope negative, then
    0: recomputing 2,000 tokens predicted free, and chosen over a 20 ms read."""
    model = CostModel("auto")
    model.record_prefill(128, 0.060)  # a fresh prefill (the warm-up's)
    for tokens, seconds, history in ((40, 0.80, 4000), (45, 0.075, 2000), (52, 0.060, 1000),
                                     (60, 0.050, 500), (33, 0.85, 4000), (70, 0.055, 500)):
        model.record_prefill(tokens, seconds, context=history)
    model.record_prefill(64, 0.040, context=64)  # a step over as many cached tokens as its own still counts
    model.record_restore(46 * 10**6, 0.020)
    choice = model.choose(2000, 46 * 10**6)
    assert choice.decision == "restore" and choice.recompute_s > 0.5, choice.reason
    assert len(model.prefill._samples) == 2


def test_policies() -> None:
    assert resolve_policy("recompute") == "recompute"
    with pytest.raises(ConfigError):
        resolve_policy("sometimes")
    with pytest.raises(ConfigError):
        EngineConfig(restore_policy="sometimes")
    model = CostModel("auto")
    assert model.choose(1000, 10**6).decision == "restore"  # nothing measured yet
    assert "no measured disk bandwidth" in model.choose(1000, 10**6).reason
    assert CostModel("recompute").choose(1000, 10**6).decision == "recompute"


def _stored_session(sid: str) -> list[int]:
    """Three turns of session ``sid`` saved to the default store; returns the last reply's tokens."""
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=4))
    chat = Chat(sid, system="You are terse.", engine=engine, max_new_tokens=8, chunk_tokens=16)
    for text in TURNS:
        chat.send(text)
    chat.close()
    twin = Chat(f"{sid}-twin", system="You are terse.", engine=engine, max_new_tokens=8, persist=False)
    for text in TURNS + ["One more."]:
        twin.send(text)
    twin.close()
    return twin.last_stats.token_ids


def _engine_measuring(prefill_s_per_token: float, disk_s_per_byte: float) -> Engine:
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=4, restore_policy="auto"))
    engine.warmed.result(timeout=120)  # type: ignore[union-attr]  # (it times a prefill too)
    engine.costs.prefill, engine.costs.disk = LinearCost(), LinearCost()
    for size in (64, 128, 256):
        engine.costs.record_prefill(size, size * prefill_s_per_token)
        engine.costs.record_restore(size * 1000, size * 1000 * disk_s_per_byte)
    return engine


@pytest.mark.parametrize("side", ["fast prefill", "slow prefill"])
def test_both_sides_of_the_break_even_point(side: str) -> None:
    want = _stored_session("s")
    fast = side == "fast prefill"
    engine = _engine_measuring(1e-6 if fast else 1e-1, 1e-6)  # ~1 MB/s disk: a few ms per chunk
    chat = Chat("s", engine=engine, max_new_tokens=8, chunk_tokens=16)
    info = chat.wait_restored()
    assert info.decision == ("recompute" if fast else "restore")
    assert "predicted" in info.reason and "MB" in info.reason
    chat.send("One more.")
    stats = chat.last_stats
    assert stats.token_ids == want  # either way, the answer of a session that never left memory
    if fast:
        assert info.source == "history" and info.cached_tokens == 0 and info.bytes_read == 0
        assert stats.reused_tokens == 0 and stats.not_reused == info.reason
        assert info.reason.startswith("recomputed instead of restored")
    else:
        assert info.source == "disk" and info.cached_tokens > 0 and stats.reused_tokens > 0
    chat.close()
    again = Chat("s", engine=_engine_measuring(1e-1, 1e-9), max_new_tokens=8, chunk_tokens=16)
    assert again.wait_restored().decision == "restore" and again.restore.cached_tokens > 0  # the KV is on disk
    again.close()


@pytest.mark.parametrize("how", ["recompute chosen", "pool too small for the turn"])
def test_a_session_left_without_a_turn_keeps_its_stored_kv_whole(how: str, caplog) -> None:
    """The device holding less of a session's KV than its disk does (a
    recompute decision, or a pool with room for part of it and a turn that
    then failed) is no reason to cut the KV on disk: closing such a session
    leaves all of it there, and the next open restores it and answers as
    before. (It used to be cut to what the device held: nothing, or a part.)"""
    want = _stored_session("s")
    store = default_store()
    stored = store.get_session("s").n_cached
    chunks = [c.hash for c in store.kv_chunks("s")]
    if how == "recompute chosen":
        engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=4,
                                                               restore_policy="recompute"))
        chat = Chat("s", engine=engine, max_new_tokens=8, chunk_tokens=16)
        assert chat.wait_restored().decision == "recompute"
    else:  # 12 blocks of 4 tokens hold part of the history: the turn's restore loads that much, then fails
        engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=12, block_size=4,
                                                               restore_policy="restore"))
        chat = Chat("s", engine=engine, max_new_tokens=8, chunk_tokens=16)
        with pytest.raises(OutOfBlocksError):
            chat.send("One more.")
        assert "loaded part of its KV" in caplog.text
    chat.close()
    engine.close()
    assert store.get_session("s").n_cached == stored and [c.hash for c in store.kv_chunks("s")] == chunks
    again = Chat("s", engine=_engine_measuring(1e-1, 1e-9), max_new_tokens=8, chunk_tokens=16)
    assert again.wait_restored().cached_tokens == stored
    again.send("One more.")
    assert again.last_stats.token_ids == want
    again.close()


def test_a_session_restored_and_closed_without_a_turn_writes_nothing() -> None:
    """Closing a session whose KV was restored whole, with no turn since,
    leaves its chunk files as they are: the device holds no token the store
    lacks. (It used to write the last, partial chunk again, fsync and all.)"""
    _stored_session("s")
    store = default_store()
    chunks = [c.hash for c in store.kv_chunks("s")]
    files = {h: store.path_of(h).stat().st_mtime_ns for h in chunks}
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=4, restore_policy="restore"))
    chat = Chat("s", engine=engine, max_new_tokens=8, chunk_tokens=16)
    restored = chat.wait_restored()
    assert restored.decision == "restore" and restored.cached_tokens == store.get_session("s").n_cached
    chat.close()
    engine.close()
    assert [c.hash for c in store.kv_chunks("s")] == chunks
    assert {h: store.path_of(h).stat().st_mtime_ns for h in chunks} == files
