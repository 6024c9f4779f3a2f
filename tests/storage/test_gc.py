from __future__ import annotations

from pathlib import Path

from chatkv.storage import Store

from .conftest import FP, kv_files, new_chunks


def test_gc_dry_run_then_real_run(store: Store, home: Path) -> None:
    store.open_session("s")
    store.append_message("s", "user", "keep me")
    ids = list(range(200))
    r = store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    # an orphan file (crash after rename, before commit), a temp file (writer died mid-write)
    orphan = store.write_chunk(list(range(5000, 5010)), new_chunks(list(range(10)))[0].tensors, new_chunks([1])[0].meta)
    tmp = store.path_of(r.chunks[0]).parent / ".tmp-dead.123.abcd"
    tmp.write_bytes(b"x" * 100)
    # an unreferenced row (e.g. left by an older chatkv) and a dangling row (file lost)
    with store._tx() as s:
        from chatkv.storage.store import chunk_row

        lone = store.write_chunk([42], new_chunks([42])[0].tensors, new_chunks([42])[0].meta)
        s.add(chunk_row(lone))
    store.path_of(r.chunks[2]).unlink()

    dry = store.gc(dry_run=True, grace_s=0)
    assert dry.orphan_files == [store.path_of(orphan)] and dry.temp_files == [tmp]
    assert dry.dangling_chunks == [r.chunks[2].hash] and dry.unreferenced_chunks == [lone.hash]
    assert dry.reclaimable_bytes == orphan.bytes + 100 + lone.bytes and dry.files_removed == 0
    assert store.path_of(orphan).exists() and tmp.exists()  # dry run touched nothing

    real = store.gc(dry_run=False, grace_s=0)
    assert real.files_removed == 3 and real.bytes_reclaimed == dry.reclaimable_bytes
    assert not tmp.exists() and sorted(kv_files(home)) == sorted(store.path_of(c) for c in r.chunks[:2])
    assert store.get_session("s").n_cached == 128  # prefix before the lost chunk
    assert [m.content for m in store.messages("s")] == ["keep me"]
    again = store.gc(dry_run=True, grace_s=0)
    assert (again.orphan_files, again.temp_files, again.dangling_chunks, again.unreferenced_chunks) == ([], [], [], [])


def test_gc_grace_spares_fresh_files(store: Store) -> None:
    store.write_chunk([1, 2], new_chunks([1, 2])[0].tensors, new_chunks([1])[0].meta)
    assert store.gc(dry_run=True).orphan_files == []  # default grace: a save may be in flight
    assert len(store.gc(dry_run=True, grace_s=0).orphan_files) == 1
