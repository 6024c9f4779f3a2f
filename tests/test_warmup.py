"""The engine's background warm-up: throwaway turns that leave no trace but warm kernels and code paths."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from chatkv import Chat, EngineConfig
from chatkv.config import WARMUP_CONTEXT_TOKENS, WARMUP_DECODE_STEPS, WARMUP_DELTA_TOKENS, WARMUP_PROMPT_TOKENS
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.session import REHEARSAL_PREFIX, REHEARSAL_SESSION_ID, REHEARSAL_TURNS

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


_LONG_PREFILL_PROBE = """
import json, resource, sys, torch
from chatkv import EngineConfig
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.runner import StepInput
from chatkv.sequence import Sequence
if sys.argv[1] == "off":
    Engine._warm_product_buffers = lambda self: None
engine = Engine(load_model("tiny:llama", dtype=torch.bfloat16),
                EngineConfig(num_blocks=1200, block_size=4, compile="off", cpu_attention="auto"))
engine.wait_warm(timeout=300)
def job():
    runner = engine.runner
    seq = Sequence(token_ids=[])
    runner.write_placeholder_history(seq, [7 * i % 290 + 10 for i in range(4000)])
    new = [3 * i % 290 + 10 for i in range(400)]
    seq.token_ids.extend(new)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    runner.forward([StepInput(seq, new)])  # over 4,000 tokens: the products' chunks, about 8M scores
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    runner.pool.discard(seq)
    return faults
print(json.dumps({"faults": engine.call(job)}))
engine.close()
"""


def test_the_warm_up_leaves_a_long_prefills_attention_buffers_in_the_process() -> None:
    # A fresh process each way: what its allocators hold is the point.
    import json
    import os
    import subprocess
    import sys

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _LONG_PREFILL_PROBE, mode], capture_output=True, text=True,
                             check=True, env={**os.environ, "CHATKV_ADAPT_THREADS": "0"})
        return json.loads(out.stdout.strip().splitlines()[-1])["faults"]

    buffers = (8 << 20) * 4 // os.sysconf("SC_PAGE_SIZE")  # one chunk's float32 scores, in pages
    warmed, cold = faults("on"), faults("off")
    assert cold > buffers // 2, cold  # without it, the first long prefill writes fresh pages
    assert warmed < cold // 4, (warmed, cold)  # with it, its attention's are there (its mask is not)


def _pool_and_counters(engine: Engine) -> tuple:
    tiers, pool = engine.tier_stats(), engine.pool_stats()
    sched = dataclasses.replace(engine.scheduler.stats, jobs=0)  # the reads below are jobs themselves
    return tiers.hits, tiers.misses, tiers.demotions, pool, sched


def test_the_rehearsal_reopens_a_saved_session_from_disk_and_leaves_no_trace(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CHATKV_REHEARSAL", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its store goes, to see it go
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    left = tmp_path / f"{REHEARSAL_PREFIX}{int(gone.stdout)}-x"  # a killed process's rehearsal store
    (left / "kv").mkdir(parents=True)
    alive = tmp_path / f"{REHEARSAL_PREFIX}{os.getppid()}-y"  # a running one's
    alive.mkdir()
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=1200, block_size=4))
    try:
        engine.wait_warm(timeout=120)
        assert engine.rehearsed is not None and engine.rehearsed.result(timeout=120) == REHEARSAL_TURNS
        assert engine.costs.disk.predict(1 << 20) is not None  # its restores read chunk files, and were timed
        hits, misses, demotions, pool, sched = _pool_and_counters(engine)
        assert sum(hits.values()) == misses == sum(demotions.values()) == 0  # its counts were put back
        assert (pool.free_blocks, pool.cached_blocks, pool.prefix_hit_blocks, pool.evicted_blocks) == (1200, 0, 0, 0)
        assert sched.submitted == sched.finished == sched.steps == 0
        assert list(tmp_path.iterdir()) == [alive]  # its store is gone, and the dead process's
        assert engine.sessions.get(REHEARSAL_SESSION_ID) is None
        with Chat("after", engine=engine, persist=False, max_new_tokens=4) as chat:  # the engine serves as before
            chat.send("hello")
            assert engine.tier_stats().hits["device"] == 1 and engine.scheduler.stats.finished == 1
    finally:
        engine.close()


def test_the_rehearsal_gives_way_to_a_session_already_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_REHEARSAL", "1")
    engine = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=1200, block_size=4, warmup=False))
    try:
        assert engine.rehearsed is None  # no warm-up, no rehearsal
        with Chat("first", engine=engine, persist=False, max_new_tokens=4) as chat:
            chat.send("hello")
            before = _pool_and_counters(engine)
            assert engine.sessions.rehearse() == 0
            assert _pool_and_counters(engine) == before
        assert engine.sessions.rehearse() == REHEARSAL_TURNS  # alone again
    finally:
        engine.close()


def test_the_rehearsal_is_off_where_asked_and_where_the_pool_is_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    small = Engine(load_model("tiny:llama"), EngineConfig(num_blocks=200, block_size=4, warmup=False))
    try:
        monkeypatch.setenv("CHATKV_REHEARSAL", "0")
        assert small.sessions.rehearse() == 0
        monkeypatch.setenv("CHATKV_REHEARSAL", "1")
        assert small.sessions.rehearse() == 0  # 800 slots: less than twice its history
        assert small.pool_stats().free_blocks == 200
    finally:
        small.close()
