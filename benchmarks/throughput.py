"""Throughput with N active sessions: total tokens/s and mean time to first token.

For each N, N one-turn sessions run at once from N threads on a fresh engine
(the scheduler batches them into shared forward passes), and the same N run one
after another; the report gives both rates, their ratio and the mean time to
first token under load. ``benchmarks/batching.py`` has the fuller sweep.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

#: Session counts the report asks for.
DEFAULT_SESSIONS = (1, 4, 16)


def _run(engine: Any, sid: str, text: str, new_tokens: int) -> tuple[int, float | None]:
    from chatkv import Chat

    chat = Chat(sid, engine=engine, persist=False, max_new_tokens=new_tokens, ignore_eos=True)
    try:
        chat.send(text)
        gen = chat.last_stats
        return (len(gen.token_ids) if gen else 0), chat.last_stats.ttft_s if chat.last_stats else None
    finally:
        chat.close()


def measure_throughput(engine: Any, points: list[Any], new_tokens: int,
                       sessions: tuple[int, ...] = DEFAULT_SESSIONS) -> dict[str, Any]:
    """Total generated tokens/s and mean TTFT with ``n`` sessions active, for each ``n``.

    Runs on fresh engines sharing ``engine``'s model (``points`` is unused: the
    prompts are short, so the numbers measure batching, not prefill).

    Returns:
        ``{"available": True, "rows": [{"sessions", "tokens_per_s",
        "sequential_tokens_per_s", "ratio", "mean_ttft_s", "max_batch"}, ...]}``.
    """
    from chatkv import EngineConfig
    from chatkv.engine import Engine

    rows = []
    for n in sessions:
        prompts = [f"Session {i}: tell me a story about the quick brown fox, part {i}." for i in range(n)]
        seq_engine = Engine(engine.loaded, EngineConfig(kv_budget_bytes=512 << 20, compile=False))
        _run(seq_engine, "warmup", "warm up", 4)
        start = time.perf_counter()
        seq_tokens = sum(_run(seq_engine, f"seq-{i}", p, new_tokens)[0] for i, p in enumerate(prompts))
        seq_rate = seq_tokens / (time.perf_counter() - start)
        seq_engine.close()  # one loop thread (one OpenMP pool) at a time

        con_engine = Engine(engine.loaded, EngineConfig(kv_budget_bytes=512 << 20, compile=False))
        _run(con_engine, "warmup", "warm up", 4)
        results: list[tuple[int, float | None]] = [(0, None)] * n
        barrier = threading.Barrier(n + 1)

        def worker(i: int) -> None:
            barrier.wait()
            results[i] = _run(con_engine, f"con-{i}", prompts[i], new_tokens)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        ttfts = [t for _, t in results if t is not None]
        con_rate = sum(c for c, _ in results) / wall
        rows.append({
            "sessions": n, "tokens_per_s": con_rate, "sequential_tokens_per_s": seq_rate,
            "ratio": con_rate / seq_rate if seq_rate else float("nan"),
            "mean_ttft_s": statistics.mean(ttfts) if ttfts else float("nan"),
            "max_batch": con_engine.scheduler.stats.max_batch_seqs,
        })
        con_engine.close()
    return {"available": True, "rows": rows}
