"""One resume in a fresh process: the "after a process restart" tier of the benchmark.

Reads a JSON request on stdin (``home``, ``session``, ``user``, ``model``,
``dtype``, ``threads``, ``new_tokens``, ``spawned_at`` and optionally
``next_session`` and ``idle_s``, the idle seconds before each timed turn as
in :data:`benchmarks.measure.TURN_GAP_S`), loads the model, opens the
session from the store at ``home``, sends ``user`` and prints one JSON line:
time to first token counted from ``Chat()`` (``ttft_s``), from the process's
spawn (``process_to_first_token_s``), the model load time, the restore's
seconds and bytes, the decode seconds and the generated token ids. With
``next_session`` (a copy of the same session), the same turn is then timed
again on it in the same process after the same idle, its KV read from disk
again (the prefix cache emptied first): ``next_ttft_s`` (with ``next_open_s``,
``next_first_token_s``, ``next_restore_s``), what the first turn of a fresh
process is compared with. Before each timed turn's idle, the session's chunk
files are read once, so both turns (and the hand-made resume, likewise)
restore from the page cache.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    """Run the request on stdin; print the answer as one JSON line on stdout."""
    req = json.loads(sys.stdin.read())
    import torch

    torch.set_num_threads(int(req["threads"]))
    from chatkv.storage import Store

    from benchmarks.replay import timed_turn
    from chatkv.chat import Chat
    from chatkv.engine import Engine
    from chatkv.hardware import resolve_dtype
    from chatkv.models import load_model

    store = Store(req["home"])  # first, as the REPL and the server open theirs: it warms up while the model loads
    t0 = time.perf_counter()
    spec = req["model"]
    loaded = load_model(None if spec == "default" else spec, dtype=resolve_dtype(req.get("dtype")))
    model_load_s = time.perf_counter() - t0
    engine = Engine(loaded)
    engine.wait_warm()  # the warm-up belongs to loading, not to the timed turn
    idle_s = float(req.get("idle_s", 0.0))
    _in_page_cache(store, req["session"])
    time.sleep(idle_s)  # the user's think time, as before every system's timed turn
    chat_at = time.time()
    ttft, decode, tokens, chat, parts = timed_turn(lambda: Chat(req["session"], engine=engine, store=store),
                                            req["user"], int(req["new_tokens"]))
    info = chat.restore
    chat.close()
    nxt: dict[str, float] = {}
    if req.get("next_session"):
        engine.call(engine.pool.evict_cached, "cold prefix cache")  # the next restore reads the files again
        _in_page_cache(store, req["next_session"])
        time.sleep(idle_s)  # the same idle as before the first turn: only the process's first call differs
        n_ttft, _, n_tokens, n_chat, n_parts = timed_turn(
            lambda: Chat(req["next_session"], engine=engine, store=store), req["user"], int(req["new_tokens"]))
        assert n_chat.restore.source == "disk" and n_tokens == tokens, (n_chat.restore, n_tokens, tokens)
        nxt = {"next_ttft_s": n_ttft, "next_restore_s": n_chat.restore.seconds, "next_open_s": n_parts["open_s"],
               "next_first_token_s": n_parts["first_token_s"]}
        n_chat.close()
    engine.close()
    store.close()
    print(json.dumps({**nxt,
        "ttft_s": ttft, "decode_s": decode, "tokens": tokens, "restore_s": info.seconds,
        "bytes_read": info.bytes_read, **parts, "cached_tokens": info.cached_tokens, "model_load_s": model_load_s,
        "process_to_first_token_s": chat_at + ttft - float(req["spawned_at"]),
    }))
    return 0


def _in_page_cache(store: "object", session_id: str) -> None:
    """Read the session's chunk files once, so that both timed turns restore
    from the page cache (this VM's kernel pages out files left idle about a
    minute, and the process's load and compile can take that long)."""
    from pathlib import Path

    from benchmarks.measure import raw_read

    raw_read(Path(store.path_of(c)) for c in store.kv_chunks(session_id))  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
