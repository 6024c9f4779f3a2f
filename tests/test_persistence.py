"""Sessions on disk: resume without re-prefill, dedup, incremental saves, faults."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest
import torch

from chatkv import Chat, EngineConfig
from chatkv.engine import Engine
from chatkv.errors import ChatKVWarning
from chatkv.models import load_model
from chatkv.persistence import default_store
from chatkv.storage import export_session, import_session
from chatkv.storage import SessionLockedError, Store, StorageWriteError

CHUNK = 16


def fresh_engine(arch: str = "llama") -> Engine:
    """A new engine with an empty pool: what a restarted process has."""
    return Engine(load_model(f"tiny:{arch}"), EngineConfig(num_blocks=256, block_size=4))


def open_chat(engine: Engine, sid: str = "s", **kw) -> Chat:
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("stop", ["\n"])
    return Chat(sid, engine=engine, chunk_tokens=CHUNK, **kw)


TURNS = ["Hello there, how are you?", "Tell me a story about a fox.", "And then what?"]


def test_resume_after_restart_prefills_only_the_new_turn_and_answers_the_same():
    first = fresh_engine()
    chat = open_chat(first, system="You are terse.")
    for text in TURNS[:2]:
        chat.send(text)
    cached = chat.num_cached_tokens
    chat.close()

    # The uninterrupted run, for comparison, on its own engine and session.
    ref = open_chat(fresh_engine(), "reference", system="You are terse.", persist=False)
    for text in TURNS:
        ref.send(text)

    second = fresh_engine()
    again = open_chat(second)
    info = again.wait_restored()
    assert info.source == "disk" and info.cached_tokens == cached and info.turns == 2
    assert again.messages == chat.messages
    again.send(TURNS[2])
    stats = again.last_stats
    # Exactly what the never-restarted session reuses and prefills (with the tiny
    # model's random bytes a reply may re-tokenize differently; SmolLM2's test
    # shows the exact "only the new turn" count).
    assert stats.reused_tokens == ref.last_stats.reused_tokens > 0
    assert stats.prefilled_tokens == ref.last_stats.prefilled_tokens < stats.prompt_tokens
    assert again.last_stats.token_ids == ref.last_stats.token_ids
    assert again.messages == ref.messages
    again.close()
    assert second.pool_stats().used_blocks == 0


def test_shared_system_prompt_is_stored_once():
    engine = fresh_engine()
    system = "You are a terse assistant who answers in one line. " * 2
    for i in range(10):
        c = open_chat(engine, f"user-{i}", system=system)
        c.send(f"question {i}")
        c.close()
    store = default_store()
    per_session = [store.kv_chunks(f"user-{i}") for i in range(10)]
    first_chunks = {chunks[0].hash for chunks in per_session}
    assert len(first_chunks) == 1  # every session starts with the same file
    shared = set.intersection(*({c.hash for c in chunks} for chunks in per_session))
    assert len(shared) >= 2
    usage = store.disk_usage()
    all_refs = sum(len(chunks) for chunks in per_session)
    assert usage.n_files == usage.n_chunks < all_refs - 9 * (len(shared) - 1)
    one_copy = sum(c.bytes for c in per_session[0] if c.hash in shared)
    total_if_copied = sum(c.bytes for chunks in per_session for c in chunks)
    assert usage.file_bytes <= total_if_copied - 9 * one_copy


def test_each_save_writes_only_the_chunks_its_turn_completed():
    engine = fresh_engine()
    chat = open_chat(engine, system="sys", max_new_tokens=12, stop=[])
    per_token = engine.pool.bytes_per_block // engine.pool.block_size
    prev_cached = 0
    for i in range(8):
        chat.send(f"turn number {i} with some words")
        stats = chat.last_stats
        cached = chat.num_cached_tokens
        grown = cached - prev_cached
        # New full chunks plus the rewritten tail: never the whole history.
        assert stats.bytes_written <= (grown + CHUNK) * per_token + 4096 * (grown // CHUNK + 2)
        prev_cached = cached
    assert prev_cached > 6 * CHUNK
    assert stats.bytes_written < prev_cached * per_token / 3


def test_another_models_cache_is_never_used():
    llama = open_chat(fresh_engine("llama"), "shared-id", system="sys")
    llama.send("hello")
    llama.close()
    qwen_engine = fresh_engine("qwen2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qwen = open_chat(qwen_engine, "shared-id")
        info = qwen.wait_restored()
    assert info.source == "history" and info.cached_tokens == 0
    assert "another model" in info.warning
    assert any(issubclass(w.category, ChatKVWarning) for w in caught)
    assert len(qwen.messages) == 3  # history intact
    qwen.send("again")
    assert qwen.last_stats.reused_tokens == 0  # re-prefilled from history
    assert "another model" in qwen.last_stats.not_reused  # the turn says why
    assert len(qwen.messages) == 5
    qwen.close()


def _chunk_files(home: Path) -> list[Path]:
    return sorted((home / "kv").rglob("*.safetensors"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_or_missing_chunk_costs_a_reprefill_not_the_conversation(damage, chatkv_home):
    engine = fresh_engine()
    chat = open_chat(engine, "c", system="sys " * 10, max_new_tokens=10, stop=[])
    chat.send("first message here")
    chat.send("second message here")
    history = chat.messages
    chat.close()
    ref = open_chat(fresh_engine(), "ref", persist=False, system="sys " * 10, max_new_tokens=10, stop=[])
    for text in ["first message here", "second message here", "third"]:
        ref.send(text)

    victim = default_store().kv_chunks("c")[1]
    path = default_store().path_of(victim)
    data = path.read_bytes()
    if damage == "flip":
        path.write_bytes(data[:-20] + bytes(b ^ 0xFF for b in data[-20:]))
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        again = open_chat(fresh_engine(), "c", max_new_tokens=10, stop=[])
        info = again.wait_restored()
    assert info.warning and info.cached_tokens == CHUNK  # the chunk before the bad one still counts
    assert again.messages == history
    again.send("third")
    assert again.last_stats.token_ids == ref.last_stats.token_ids
    why = again.last_stats.not_reused
    assert why and ("missing" if damage == "delete" else "quarantined") in why, why
    if damage != "delete":
        assert list((chatkv_home / "quarantine").iterdir())
    again.close()


def _two_turns(sid: str) -> list:
    """Session ``sid`` saved after two turns; returns its chunks (at least 4)."""
    chat = open_chat(fresh_engine(), sid, system="sys " * 10, max_new_tokens=10, stop=[])
    chat.send("first message here")
    chat.send("second message here")
    chat.close()
    chunks = default_store().kv_chunks(sid)
    assert len(chunks) >= 4
    return chunks


def _fail_reads_of(monkeypatch, chunk_hash: str):
    """Make reading chunk ``chunk_hash`` raise an I/O error (not a checksum
    mismatch); returns the real ``ChunkReader.read_into``, to put back."""
    from chatkv.storage import chunkfile

    real = chunkfile.ChunkReader.read_into

    def read_into(self, buffers, **kwargs):
        if self.hash == chunk_hash:
            raise OSError(5, "Input/output error")
        return real(self, buffers, **kwargs)

    monkeypatch.setattr(chunkfile.ChunkReader, "read_into", read_into)
    return real


def test_a_read_that_fails_midway_keeps_only_the_chunks_before_it(monkeypatch):
    # An I/O error from one chunk's read: the chunks read after it, even if
    # their reads succeeded, must not be committed.
    chunks = _two_turns("eio")
    ref = open_chat(fresh_engine(), "eio-ref", persist=False, system="sys " * 10, max_new_tokens=10, stop=[])
    for text in ["first message here", "second message here", "third"]:
        ref.send(text)
    _fail_reads_of(monkeypatch, chunks[1].hash)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        again = open_chat(fresh_engine(), "eio", max_new_tokens=10, stop=[])
        info = again.wait_restored()
    assert "Input/output error" in info.warning
    assert info.cached_tokens == CHUNK  # the chunk before it; none after it
    monkeypatch.undo()
    again.send("third")
    assert again.last_stats.token_ids == ref.last_stats.token_ids
    again.close()


def test_a_read_error_then_a_close_before_the_turn_keeps_the_stored_kv(monkeypatch):
    # The same I/O error, then the session closed with no turn: the device
    # holds the first chunk only, and the close must not cut the KV on disk
    # (still whole and valid: the error was the read's, not the file's) to it.
    from chatkv.storage import chunkfile

    chunks = _two_turns("eio2")
    store = default_store()
    stored = store.get_session("eio2").n_cached
    real = _fail_reads_of(monkeypatch, chunks[1].hash)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        again = open_chat(fresh_engine(), "eio2", max_new_tokens=10, stop=[])
        assert again.wait_restored().cached_tokens == CHUNK
        again.close()
    monkeypatch.setattr(chunkfile.ChunkReader, "read_into", real)  # (undo() would drop the test's home too)
    assert store.get_session("eio2").n_cached == stored and store.kv_chunks("eio2") == chunks
    later = open_chat(fresh_engine(), "eio2", max_new_tokens=10, stop=[])
    assert later.wait_restored().cached_tokens == stored
    later.close()


def test_a_second_process_gets_a_clear_lock_error():
    engine = fresh_engine()
    chat = open_chat(engine, "locked")
    chat.send("hi")
    other = Store()  # another owner, as another process would be
    try:
        with pytest.raises(SessionLockedError):
            other.acquire_lease("locked")
        chat.close()
        lease = other.acquire_lease("locked")  # free once closed
        lease.release()
    finally:
        other.close()


def test_full_disk_keeps_the_conversation_in_memory_and_saves_later(monkeypatch):
    engine = fresh_engine()
    chat = open_chat(engine, "full", system="sys")
    chat.send("one")
    store = default_store()
    real = store.save_kv

    def full(*a, **k):
        raise StorageWriteError("No space left on device")

    monkeypatch.setattr(store, "save_kv", full)
    with pytest.warns(ChatKVWarning, match="continues in memory"):
        chat.send("two")
    assert "No space left" in chat.last_stats.persist_error
    assert len(chat.messages) == 5
    monkeypatch.setattr(store, "save_kv", real)
    chat.send("three")
    assert chat.last_stats.persist_error is None
    cached = chat.num_cached_tokens
    chat.close()
    again = open_chat(fresh_engine(), "full")
    assert again.wait_restored().cached_tokens == cached
    assert len(again.messages) == 7


def test_partial_replies_and_system_changes_survive_a_restart():
    engine = fresh_engine()
    chat = open_chat(engine, "p", system="old", max_new_tokens=30, stop=[])
    stream = chat.stream("go on and on")
    next(stream)
    stream.close()
    chat.set_system("new system prompt")
    chat.send("next")
    chat.close()
    again = open_chat(fresh_engine(), "p")
    again.wait_restored()
    assert again.system == "new system prompt"
    assert again.history[2].partial and not again.history[4].partial


def test_reset_and_fork_persist():
    engine = fresh_engine()
    chat = open_chat(engine, "orig", system="sys")
    chat.send("question")
    child = chat.fork("copy")
    assert child.messages == chat.messages
    chat.reset()
    assert chat.messages == [{"role": "system", "content": "sys"}]
    chat.close()
    child.close()
    store = default_store()
    assert [m.role for m in store.messages("orig")] == ["system"]
    assert [m.role for m in store.messages("copy")] == ["system", "user", "assistant"]
    again = open_chat(fresh_engine(), "copy")
    assert again.wait_restored().source == "disk"


def test_export_and_import_into_another_home(tmp_path, monkeypatch):
    engine = fresh_engine()
    chat = open_chat(engine, "travel", system="sys")
    chat.send("pack this")
    cached = chat.num_cached_tokens
    chat.close()
    bundle = export_session(default_store(), "travel", tmp_path / "bundle")
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path / "elsewhere"))
    import_session(default_store(), bundle)
    again = open_chat(fresh_engine(), "travel")
    info = again.wait_restored()
    assert info.source == "disk" and info.cached_tokens == cached
    assert again.messages == chat.messages
    again.close()


@pytest.mark.parametrize("made_by", ["this model", "another model"])
def test_imported_kv_is_checked_against_the_model_before_it_is_used(made_by):
    """KV only an import vouches for is probed (a few tokens recomputed) before use:
    KV made by another model under this model's fingerprint is never served."""
    from chatkv.persistence import KV_TENSOR
    from chatkv.storage import ChunkMeta, NewChunk, NewMessage

    maker = fresh_engine("llama" if made_by == "this model" else "qwen2")
    chat = open_chat(maker, "made", system="sys")
    chat.send("hello there")
    messages = chat.messages
    chat.close()
    store = default_store()
    made = store.load_kv("made")
    user = fresh_engine("llama")
    fp = user.loaded.fingerprint  # the claim: made by the model that will use it
    # One chunk holding everything: new content hashes, so nothing is verified already.
    c0 = made.chunks[0].info
    kv = torch.cat([c.tensors[KV_TENSOR] for c in made.chunks], dim=2)
    chunks = [NewChunk(len(made.token_ids), {KV_TENSOR: kv},
                       ChunkMeta(fingerprint=fp, kv_format=c0.kv_format, dtype=c0.dtype,
                                 block_size=len(made.token_ids), quant=c0.quant))]
    store.create_session("imported", fingerprint=fp, messages=[NewMessage(m["role"], m["content"]) for m in messages],
                         token_ids=made.token_ids, chunks=chunks, kv_verified=False)
    assert store.get_session("imported").kv_verified is False
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        again = open_chat(user, "imported")
        info = again.wait_restored()
    if made_by == "this model":
        assert info.cached_tokens == len(made.token_ids) and info.warning is None
        assert store.get_session("imported").kv_verified  # the probe passed and was recorded
    else:
        assert info.cached_tokens == 0 and "does not match" in info.warning
        assert store.get_session("imported").n_cached == 0  # dropped, never served
    ref = open_chat(fresh_engine("llama"), "ref", persist=False)
    ref.append(messages)
    ref.send("and then?")
    again.send("and then?")
    assert again.last_stats.token_ids == ref.last_stats.token_ids
    again.close()


def test_a_restore_reads_only_what_the_pool_does_not_share_and_answers_the_same():
    """The stored session's first chunk is partly held by another open session
    (the same system prompt): the restore attaches those blocks, reads the
    rest of that chunk and every later one straight into the pool, and the
    next turn equals a session that never left memory."""
    system = "You are a terse assistant who answers in one line. " * 3
    first = fresh_engine()
    chat = open_chat(first, "b", system=system)
    for text in TURNS[:2]:
        chat.send(text)
    cached = chat.num_cached_tokens
    chat.close()
    ref = open_chat(fresh_engine(), "reference", system=system, persist=False)
    for text in TURNS:
        ref.send(text)

    second = fresh_engine()
    other = open_chat(second, "a", system=system, persist=False)
    other.send("hello")  # the system prompt's blocks are now in this pool
    again = open_chat(second, "b")
    info = again.wait_restored()
    assert info.source == "disk" and info.cached_tokens == cached
    # whole chunks inside the shared prefix are not read; the rest is
    assert 0 < info.bytes_read < sum(c.bytes for c in default_store().kv_chunks("b"))
    assert second.pool_stats().shared_blocks > 0
    again.send(TURNS[2])
    assert again.last_stats.token_ids == ref.last_stats.token_ids
    assert again.last_stats.reused_tokens == ref.last_stats.reused_tokens
    again.close()
    other.close()
    assert second.pool_stats().used_blocks == 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_restore_readers_keep_to_cpus_of_their_own(monkeypatch) -> None:
    """Each restore reader thread runs on one CPU, none shared (the kernel had
    them take turns on one CPU while the other idled); switched off, a reader
    keeps every CPU of the process."""
    from chatkv import persistence

    cpus = os.sched_getaffinity(0)
    if len(cpus) < persistence.RESTORE_READERS:
        pytest.skip(f"{len(cpus)} CPU(s) for {persistence.RESTORE_READERS} readers")
    meet = threading.Barrier(persistence.RESTORE_READERS, timeout=30)

    def where() -> frozenset[int]:
        meet.wait()  # every reader at once: each answers for a thread of its own
        return frozenset(os.sched_getaffinity(0))

    readers = persistence._restore_readers()
    got = [f.result() for f in [readers.submit(where) for _ in range(persistence.RESTORE_READERS)]]
    assert all(len(c) == 1 and c <= cpus for c in got) and len(set(got)) == persistence.RESTORE_READERS

    monkeypatch.setenv(persistence.PIN_READERS_ENV, "0")
    seen: list[set[int]] = []

    def unpinned() -> None:
        persistence._pin_reader()
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=unpinned)
    t.start()
    t.join()
    assert seen == [cpus]
