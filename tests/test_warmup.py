"""The engine's background warm-up: a throwaway turn that leaves no trace but warm kernels."""

from __future__ import annotations

from chatkv import Chat, EngineConfig
from chatkv.config import WARMUP_CONTEXT_TOKENS, WARMUP_DECODE_STEPS, WARMUP_DELTA_TOKENS, WARMUP_PROMPT_TOKENS
from chatkv.engine import Engine
from chatkv.models import load_model

NEW_TURN = WARMUP_PROMPT_TOKENS + WARMUP_DECODE_STEPS
RETURNING_TURN = WARMUP_CONTEXT_TOKENS + WARMUP_DELTA_TOKENS + WARMUP_DECODE_STEPS


def test_warm_up_runs_a_new_and_a_returning_turn_and_leaves_the_pool_as_it_found_it() -> None:
    blocks = (RETURNING_TURN + 3) // 4 + 2
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=blocks, block_size=4))
    assert engine.warmed is not None
    assert engine.warmed.result(timeout=120) == NEW_TURN + RETURNING_TURN
    stats = engine.pool_stats()
    assert (stats.free_blocks, stats.cached_blocks, stats.used_blocks) == (blocks, 0, 0)  # nothing cached
    assert engine.scheduler.stats.submitted == 0 and engine.scheduler.stats.forward_tokens == 0  # not a turn


def test_a_pool_too_small_for_the_returning_turn_runs_only_the_new_one() -> None:
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=128, block_size=4))
    assert engine.wait_warm(timeout=120) == NEW_TURN
    assert engine.pool_stats().free_blocks == 128


def test_replies_are_the_same_with_and_without_warm_up() -> None:
    replies = []
    for warmup in (True, False):
        engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=700, block_size=4, warmup=warmup))
        assert (engine.warmed is None) is (not warmup)
        assert engine.wait_warm(timeout=120) == (NEW_TURN + RETURNING_TURN if warmup else 0)
        chat = Chat("w", system="be brief", engine=engine, persist=False, max_new_tokens=8)
        chat.send("hello there")  # asked for at once: it starts after the warm-up
        chat.send("and again")
        replies.append(chat.last_stats.token_ids)
        assert chat.last_stats.prefix_cache_tokens == 0
        chat.close()
    assert replies[0] == replies[1]


def test_a_small_pool_warms_up_with_what_it_has() -> None:
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=3, block_size=4))
    assert 0 < engine.warmed.result(timeout=120) <= 12  # type: ignore[union-attr]
    assert engine.pool_stats().free_blocks == 3


def test_warm_up_starts_the_restore_readers_once_per_process() -> None:
    import threading

    from chatkv.persistence import RESTORE_READERS

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("chatkv-restore-read")}

    for _ in range(2):  # a second engine finds them running and starts no more
        engine = Engine(load_model("tiny:llama"))
        try:
            engine.wait_warm()
            assert len(readers()) == RESTORE_READERS
        finally:
            engine.close()
