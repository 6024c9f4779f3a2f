from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from chatkv.storage import (
    DiskGcReport,
    DiskPolicy,
    Store,
    collect_garbage,
    enforce_disk_policy,
)
from chatkv.storage.store import chunk_row
from sqlalchemy.orm import Session

from .conftest import FP, kv_files, new_chunks


def _add_unreferenced_row(store: Store, token_ids: list[int]):
    """A chunk file plus an index row no session links to (as an older chatkv could leave)."""
    c = new_chunks(token_ids)[0]
    info = store.write_chunk(token_ids, c.tensors, c.meta)
    with Session(store.engine) as s, s.begin():
        s.add(chunk_row(info))
    return info


def test_gc_dry_run_then_real_run(store: Store, home: Path) -> None:
    store.open_session("s")
    store.append_message("s", "user", "keep me")
    ids = list(range(200))
    r = store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    # an orphan file (crash after rename, before commit), a temp file (writer died mid-write)
    orphan = store.write_chunk(list(range(5000, 5010)), new_chunks(list(range(10)))[0].tensors, new_chunks([1])[0].meta)
    tmp = store.path_of(r.chunks[0]).parent / ".tmp-dead.123.abcd"
    tmp.write_bytes(b"x" * 100)
    # an unreferenced row and a dangling row (file lost)
    lone = _add_unreferenced_row(store, [42])
    store.path_of(r.chunks[2]).unlink()

    dry = collect_garbage(store, dry_run=True, grace_s=0)
    assert dry.orphan_files == [store.path_of(orphan)] and dry.temp_files == [tmp]
    assert dry.dangling_chunks == [r.chunks[2].hash] and dry.unreferenced_chunks == [lone.hash]
    assert dry.reclaimable_bytes == orphan.bytes + 100 + lone.bytes and dry.files_removed == 0
    assert store.path_of(orphan).exists() and tmp.exists()  # dry run touched nothing

    real = collect_garbage(store, dry_run=False, grace_s=0)
    assert real.files_removed == 3 and real.bytes_reclaimed == dry.reclaimable_bytes
    assert not tmp.exists() and sorted(kv_files(home)) == sorted(store.path_of(c) for c in r.chunks[:2])
    assert store.get_session("s").n_cached == 128  # prefix before the lost chunk
    assert [m.content for m in store.messages("s")] == ["keep me"]
    again = collect_garbage(store, dry_run=True, grace_s=0)
    assert (again.orphan_files, again.temp_files, again.dangling_chunks, again.unreferenced_chunks) == ([], [], [], [])


def test_gc_grace_spares_fresh_files(store: Store) -> None:
    store.write_chunk([1, 2], new_chunks([1, 2])[0].tensors, new_chunks([1])[0].meta)
    assert collect_garbage(store, dry_run=True).orphan_files == []  # default grace: a save may be in flight
    assert len(collect_garbage(store, dry_run=True, grace_s=0).orphan_files) == 1


def test_chunk_usage_counts_links_and_drop_spares_referenced_chunks(store: Store) -> None:
    for sid in ("a", "b"):
        store.open_session(sid, fingerprint=FP)
        store.save_kv(sid, token_ids=list(range(64)), fingerprint=FP, chunks=new_chunks(list(range(64))))
    shared = store.kv_chunks("a")[0]
    lone = _add_unreferenced_row(store, [7, 8])
    usage = {u.hash: u for u in store.chunk_usage()}
    assert (usage[shared.hash].n_refs, usage[lone.hash].n_refs) == (2, 0)
    assert usage[lone.hash].bytes == lone.bytes and usage[lone.hash].relpath == lone.relpath
    removed = store.drop_unreferenced_chunks([shared.hash, lone.hash, "f" * 64])
    assert (removed.files_removed, removed.bytes_removed) == (1, lone.bytes)
    assert not store.path_of(lone).exists() and store.path_of(shared).exists() and store.has_chunk(shared.hash)


# ------------------------------------------------------------------ disk policy


def _sessions(store: Store, *sids: str, size: int = 100) -> dict[str, int]:
    """Sessions with unshared KV, saved in this order (so least recently used first); their unique bytes."""
    out = {}
    for n, sid in enumerate(sids):
        store.open_session(sid, fingerprint=FP)
        store.append_message(sid, "user", f"hello from {sid}")
        ids = list(range(10_000 * (n + 1), 10_000 * (n + 1) + size))
        store.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
        out[sid] = store.session_bytes(sid).unique
    return out


def _state(store: Store) -> tuple:
    return (sorted(kv_files(store.home)),
            [(i.id, i.n_cached, i.n_messages, i.kv_generation) for i in store.list_sessions()])


def test_disk_policy_validates() -> None:
    assert DiskPolicy() == DiskPolicy(None, None)
    for bad in ({"kv_ttl_s": -1}, {"disk_budget_bytes": -1}, {"kv_ttl_s": float("nan")}):
        with pytest.raises(ValueError):
            DiskPolicy(**bad)


def test_ttl_expires_idle_kv_frees_its_bytes_and_keeps_histories(store: Store) -> None:
    sizes = _sessions(store, "old", "new")
    t_old, t_new = (store.get_session(s).last_used_at for s in ("old", "new"))
    now = t_new + timedelta(seconds=100)
    policy = DiskPolicy(kv_ttl_s=100 + (t_new - t_old).total_seconds() / 2)  # "old" is past it, "new" is not
    before = _state(store)

    dry = enforce_disk_policy(store, policy, dry_run=True, grace_s=0, now=now)
    assert isinstance(dry, DiskGcReport) and dry.dry_run
    assert (dry.expired_sessions, dry.expired_bytes, dry.over_budget_sessions) == (["old"], sizes["old"], [])
    assert dry.bytes_reclaimed == sizes["old"] and dry.files_removed == 0
    assert _state(store) == before  # a dry run removes nothing

    real = enforce_disk_policy(store, policy, grace_s=0, now=now)
    assert (real.expired_sessions, real.expired_bytes) == (["old"], sizes["old"])
    assert real.bytes_reclaimed == sizes["old"]
    assert real.disk_bytes_before - real.disk_bytes_after == sizes["old"]
    assert store.get_session("old").n_cached == 0 and store.kv_chunks("old") == []
    assert [m.content for m in store.messages("old")] == ["hello from old"]  # the history stays
    assert store.get_session("new").n_cached == 100 and store.load_kv("new").token_ids


def test_budget_drops_least_recently_used_kv_until_it_fits(store: Store) -> None:
    sizes = _sessions(store, "s1", "s2", "s3")
    store.touch("s1")  # now the most recently used
    budget = sizes["s1"] + sizes["s3"] // 2
    before = _state(store)

    dry = enforce_disk_policy(store, DiskPolicy(disk_budget_bytes=budget), dry_run=True, grace_s=0)
    assert dry.over_budget_sessions == ["s2", "s3"] and dry.over_budget_bytes == sizes["s2"] + sizes["s3"]
    assert _state(store) == before

    real = enforce_disk_policy(store, DiskPolicy(disk_budget_bytes=budget), grace_s=0)
    assert real.over_budget_sessions == ["s2", "s3"] and real.expired_sessions == []
    assert store.disk_usage().indexed_bytes == sizes["s1"] <= budget
    assert [store.get_session(s).n_cached for s in ("s1", "s2", "s3")] == [100, 0, 0]
    assert all(store.get_session(s).n_messages == 1 for s in ("s1", "s2", "s3"))
    # already within budget: nothing more goes
    assert enforce_disk_policy(store, DiskPolicy(disk_budget_bytes=budget), grace_s=0).over_budget_sessions == []


def test_skipped_and_foreign_leased_sessions_are_left_alone(store: Store, home: Path) -> None:
    _sessions(store, "skipped", "leased", "free")
    with Store(home) as other:
        other.acquire_lease("leased", auto_renew=False)
        for dry_run in (True, False):
            report = enforce_disk_policy(store, DiskPolicy(kv_ttl_s=0, disk_budget_bytes=0), dry_run=dry_run,
                                         grace_s=0, skip=["skipped"])
            assert report.expired_sessions == ["free"] and report.over_budget_sessions == []
        assert store.get_session("skipped").n_cached == store.get_session("leased").n_cached == 100
        assert store.get_session("free").n_cached == 0
    # our own lease does not protect a session from our own policy run
    store.acquire_lease("leased", auto_renew=False)
    assert enforce_disk_policy(store, DiskPolicy(kv_ttl_s=0), grace_s=0, skip=["skipped"]).expired_sessions == ["leased"]


def test_policy_report_includes_the_garbage_collection(store: Store) -> None:
    _sessions(store, "a")
    _add_unreferenced_row(store, [1, 2, 3])
    report = enforce_disk_policy(store, grace_s=0)
    assert (report.expired_sessions, report.over_budget_sessions) == ([], [])
    assert report.unreferenced_chunks == 1 and report.files_removed == 1 and report.bytes_reclaimed > 0
    assert store.get_session("a").n_cached == 100
