"""Issue 16, item 4: dead tokens are trimmed.

A reply cut short (the REPL's Ctrl-C: the stream closed, or KeyboardInterrupt
raised in it) and then retried, and a complete reply regenerated, leave no
unreachable KV behind: the pool holds exactly the blocks a fresh session that
ran only the surviving turn holds, the store references exactly that
session's chunks (content addressed, so the same hashes), the dead replies'
chunk files are gone from disk with nothing left for gc to find, and the next
turn answers as stock transformers re-prefilling the history.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.models import load_model
from chatkv.persistence import default_store
from chatkv.storage import Store, collect_garbage

from conftest import stock_copy
from test_chat import stock_greedy

BS = 4
CHUNK = 16
N = 8  # greedy reply budget
DEAD = 40  # sampled replies to be cut or replaced: several chunks of their own
SYSTEM = "You are terse."
QUESTION = "Tell me a story."
NEXT = "And then?"


def make_engine() -> Engine:
    return Engine(load_model("tiny:llama"), EngineConfig(num_blocks=256, block_size=BS))


def open_chat(engine: Engine, sid: str, store: Store | None = None) -> Chat:
    return Chat(sid, engine=engine, system=SYSTEM, max_new_tokens=N, chunk_tokens=CHUNK, store=store)


def sampled(seed: int) -> dict:
    """A long sampled reply, unlike the greedy one (so its KV and chunks differ)."""
    return dict(temperature=1.0, seed=seed, ignore_eos=True, max_new_tokens=DEAD)


def cut(stream, how: str, pieces: int = 20) -> str:
    """Take ``pieces`` pieces of ``stream``, then stop it as the REPL's Ctrl-C does."""
    taken = "".join(next(stream) for _ in range(pieces))
    if how == "close":  # the first Ctrl-C: the REPL breaks out and closes the stream
        stream.close()
    else:  # a second Ctrl-C lands inside the generator
        with pytest.raises(KeyboardInterrupt):
            stream.throw(KeyboardInterrupt)
    return taken


def chunk_files(home: Path) -> set[str]:
    return {p.name.removesuffix(".safetensors") for p in (home / "kv").glob("*/*.safetensors")}


def referenced(store: Store, sid: str) -> list[str]:
    return [c.hash for c in store.kv_chunks(sid)]


@pytest.mark.parametrize("how", ["close", "ctrl-c", "complete"])
def test_dead_replies_leave_no_kv_in_the_pool_or_on_disk(how, chatkv_home, tmp_path):
    engine = make_engine()
    pool_blocks = engine.pool_stats().num_blocks
    assert engine.pool_stats().used_blocks == 0
    store = default_store()
    chat = open_chat(engine, "dead")
    seq = chat._session.kv.seq
    prompt = engine.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                                add_generation_prompt=True)

    # Two dead replies: the first turn's, then a first retry's (both sampled).
    dead_chunks: set[str] = set()
    dead_tokens: list[list[int]] = []
    for i, start in enumerate([lambda kw: chat.stream(QUESTION, **kw), lambda kw: chat.stream_regenerate(**kw)]):
        if how == "complete":
            _ = "".join(start(sampled(10 + i)))
            assert chat.last_stats.finish_reason == "length" and not chat.history[-1].partial
        else:
            taken = cut(start(sampled(10 + i)), how)
            assert chat.history[-1].partial and chat.messages[-1]["content"] == taken
            assert chat.last_stats.finish_reason == "interrupted"
        assert len(chat.messages) == 3
        dead_tokens.append(list(chat.last_stats.token_ids))
        # What the dead reply holds now is exactly its delivered tokens (tokens the
        # engine ran ahead with were dropped, their blocks too), on disk as in the pool
        # (the last one's KV may or may not be computed yet).
        assert seq.token_ids == prompt + dead_tokens[-1] and len(seq.token_ids) - 1 <= seq.num_computed
        assert engine.pool_stats().used_blocks == -(-seq.num_computed // BS)
        assert store.cached_token_ids("dead") == seq.computed_ids
        dead_chunks |= set(referenced(store, "dead"))
        assert len(dead_tokens[-1]) > CHUNK  # the reply has chunks of its own

    # The retry that stays: greedy, so a fresh session running the turn once holds the same.
    reply = chat.regenerate()
    stats = chat.last_stats
    assert chat.messages == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                             {"role": "assistant", "content": reply}]
    assert not chat.history[-1].partial
    assert stats.reused_tokens == len(prompt) - 1  # the kept prompt's KV was reused
    assert all(d[:2] != stats.token_ids[:2] for d in dead_tokens)  # the dead replies really differ

    fresh_engine = make_engine()
    fresh_store = Store(tmp_path / "fresh-home")
    fresh = open_chat(fresh_engine, "fresh", store=fresh_store)
    fresh.send(QUESTION)
    assert fresh.last_stats.token_ids == stats.token_ids and fresh.messages == chat.messages
    fseq = fresh._session.kv.seq

    # The pool: the blocks in use are exactly those of the surviving tokens, as in the fresh session.
    assert seq.token_ids == fseq.token_ids == prompt + stats.token_ids
    assert seq.num_computed == fseq.num_computed
    used = engine.pool_stats().used_blocks
    assert used == fresh_engine.pool_stats().used_blocks == -(-seq.num_computed // BS)
    assert engine.pool_stats().available_blocks == pool_blocks - used  # the dead blocks are free again

    # The disk: the session references the fresh session's very chunks, and nothing else is left.
    survivors = referenced(store, "dead")
    assert survivors == referenced(fresh_store, "fresh")
    assert store.cached_token_ids("dead") == seq.computed_ids
    gone = dead_chunks - set(survivors)
    assert gone  # the dead replies' chunks, unreferenced now
    assert chunk_files(chatkv_home) == set(survivors)  # their files went with the save that dropped them
    assert {u.hash for u in store.chunk_usage()} == set(survivors)
    assert store.session_bytes("dead").total == store.disk_usage().file_bytes == \
        fresh_store.disk_usage().file_bytes
    report = collect_garbage(store, dry_run=False, grace_s=0)
    assert not (report.unreferenced_chunks or report.orphan_files or report.dangling_chunks)  # nothing left for gc
    assert report.files_removed == 0 and chunk_files(chatkv_home) == set(survivors)

    # The next turn answers as stock transformers re-prefilling the history.
    reference = stock_copy(engine.loaded.model)
    tok = engine.tokenizer
    want = stock_greedy(reference, tok, chat.messages + [{"role": "user", "content": NEXT}], N, tok.eos_token_id)
    chat.send(NEXT)
    assert chat.last_stats.token_ids == want
    assert chat.last_stats.reused_tokens >= len(prompt)
    fresh.close()
    chat.close()
    fresh_store.close()
