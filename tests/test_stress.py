"""Many threads on one engine while tiers move and gc runs in another process.

The pool is too small for the sixteen sessions at once, so turns are preempted
and idle sessions demoted; a thread forces tier moves at random; ``chatkv
sessions gc`` runs in a loop in another process. Every greedy reply must equal
the session run alone, the pool must end with every block back, and no pool
access may happen off the engine's loop (the suite runs with
``CHATKV_CHECK_OWNER=1``, so the pool asserts it).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

from chatkv import Chat, EngineConfig
from chatkv.block_pool import CHECK_OWNER
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.tiers import Tier

SESSIONS = 16
TURNS = 3
TEXTS = ["hello there", "tell me more about it", "and then what happened?"]


def engine_with(num_blocks: int) -> Engine:
    return Engine(load_model("tiny:llama"), EngineConfig(num_blocks=num_blocks, block_size=4, block_wait_s=60.0))


def conversation(engine: Engine, i: int, persist: bool) -> list[list[int]]:
    chat = Chat(f"stress-{i}", engine=engine, persist=persist, system=f"Session {i % 3}.",
                max_new_tokens=6, chunk_tokens=16)
    out = []
    try:
        for t in range(TURNS):
            chat.send(f"{TEXTS[t]} ({i})")
            assert chat.last_stats.persist_error is None
            out.append(list(chat.last_stats.token_ids))
    finally:
        chat.close()
    return out


def test_sixteen_threads_with_tier_moves_and_gc_in_another_process():
    assert CHECK_OWNER, "the pool's owner assertion must be on in tests (tests/conftest.py)"
    reference = engine_with(4096)
    want = [conversation(reference, i, persist=False) for i in range(SESSIONS)]

    engine = engine_with(96)  # about a third of what the sixteen conversations hold
    start = engine.pool_stats()
    stop = threading.Event()
    errors: list[BaseException] = []
    moves = {"done": 0}

    def force_tiers() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            sid = f"stress-{rng.randrange(SESSIONS)}"
            try:
                if engine.sessions.get(sid) is not None and engine.sessions.demote(
                        sid, rng.choice([Tier.HOST, Tier.DISK, Tier.EXPIRED])):
                    moves["done"] += 1
            except KeyError:
                pass  # the session closed between the two calls
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                return

    gc_runs = []

    def gc_elsewhere() -> None:
        while not stop.is_set():
            proc = subprocess.run([sys.executable, "-m", "chatkv.cli.main", "sessions", "gc"],
                                  capture_output=True, text=True, env=dict(os.environ))
            gc_runs.append((proc.returncode, proc.stderr[-2000:]))

    results: list[list[list[int]] | None] = [None] * SESSIONS

    def worker(i: int) -> None:
        try:
            results[i] = conversation(engine, i, persist=True)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    helpers = [threading.Thread(target=force_tiers), threading.Thread(target=gc_elsewhere)]
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(SESSIONS)]
    for t in helpers + workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    for t in helpers:
        t.join()

    assert not errors, errors
    assert results == want
    assert gc_runs and all(code == 0 for code, _ in gc_runs), gc_runs
    assert moves["done"] > 0
    assert engine.scheduler.stats.reclaims > 0  # the pool was short: idle sessions were demoted for turns
    end = engine.pool_stats()
    assert end.used_blocks == 0
    assert end.available_blocks == start.available_blocks == end.num_blocks
    tiers = engine.tier_stats()
    assert sum(tiers.sessions.values()) == 0  # every session left the tier manager
    assert engine.scheduler.stats.failed == 0
