from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from chatkv.storage import StorageError, StorageWriteError, Store, collect_garbage

from .conftest import FP, kv_files, new_chunks


def _all_files(home: Path) -> list[Path]:
    return sorted(p for p in (home / "kv").rglob("*") if p.is_file()) if (home / "kv").exists() else []


def _setup(store: Store) -> list[int]:
    store.open_session("s", fingerprint=FP)
    store.append_message("s", "user", "first")
    ids = list(range(70))
    store.save_kv("s", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    return ids


def _fail(err: int):
    def boom(*a, **k):
        raise OSError(err, os.strerror(err))
    return boom


@pytest.mark.parametrize(
    "target, err, words",
    [
        ("write", errno.ENOSPC, "disk full"),
        ("fsync", errno.EIO, "Input/output error"),
        ("replace", errno.ENOSPC, "disk full"),
        ("open", errno.EROFS, "read-only file system"),
    ],
)
def test_write_failure_is_clear_and_leaves_nothing_half_done(
    store: Store, home: Path, monkeypatch: pytest.MonkeyPatch, target: str, err: int, words: str
) -> None:
    import chatkv.storage.chunkfile as cf

    ids = _setup(store)
    before_files = _all_files(home)
    before = store.get_session("s")
    longer = ids + list(range(500, 600))
    if target == "open":
        real_open = os.open

        def ro_open(path, flags, *a, **k):  # only file creation fails, like a read-only mount
            if flags & os.O_CREAT:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(cf.os, "open", ro_open)
    else:
        monkeypatch.setattr(cf.os, target, _fail(err))
    with pytest.raises(StorageWriteError, match=words) as ei:
        store.save_kv("s", token_ids=longer, fingerprint=FP, chunks=new_chunks(longer))
    assert isinstance(ei.value, StorageError)
    monkeypatch.undo()
    assert _all_files(home) == before_files  # no temp file, no new chunk
    after = store.get_session("s")
    assert (after.n_cached, after.kv_generation, after.n_chunks) == (before.n_cached, before.kv_generation, before.n_chunks)
    assert store.load_kv("s").token_ids == ids
    assert [m.content for m in store.messages("s")] == ["first"]
    # once space is back, the same save succeeds
    store.append_message("s", "user", "second")
    store.save_kv("s", token_ids=longer, fingerprint=FP, chunks=new_chunks(longer))
    assert store.load_kv("s").token_ids == longer


def test_index_write_failure_is_a_storage_write_error(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.orm import Session

    _setup(store)

    def full(self, *a, **k):
        raise OperationalError("INSERT", {}, Exception("database or disk is full"))

    monkeypatch.setattr(Session, "flush", full)
    with pytest.raises(StorageWriteError, match="disk is full"):
        store.append_message("s", "user", "lost?")
    monkeypatch.undo()
    assert [m.content for m in store.messages("s")] == ["first"]


def test_unwritable_home_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(StorageWriteError, match="cannot create directory"):
        Store(blocker / "home")


def test_failed_commit_removes_the_files_it_wrote(store: Store, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import chatkv.storage.store as store_module
    from sqlalchemy.exc import OperationalError

    ids = _setup(store)
    n = len(kv_files(home))

    def fail(*a, **k):
        raise OperationalError("INSERT", {}, Exception("disk I/O error"))

    # Building the new chunks' index rows fails: the index transaction dies after the files are durable.
    monkeypatch.setattr(store_module, "chunk_row", fail)
    longer = ids + list(range(500, 600))
    with pytest.raises(StorageWriteError, match="disk I/O error"):
        store.save_kv("s", token_ids=longer, fingerprint=FP, chunks=new_chunks(longer))
    monkeypatch.undo()
    assert store.load_kv("s").token_ids == ids  # old state
    assert len(kv_files(home)) == n  # the files it wrote are gone at once, not left for gc's grace
    assert collect_garbage(store, dry_run=True, grace_s=0).orphan_files == []


def test_files_of_a_failed_commit_that_cannot_be_cleaned_at_once_go_at_close(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import chatkv.storage.store as store_module
    from sqlalchemy.exc import OperationalError

    store = Store(home)
    ids = _setup(store)
    n = len(kv_files(home))

    def fail(*a, **k):
        raise OperationalError("INSERT", {}, Exception("disk I/O error"))

    def index_down(*a, **k):
        raise StorageWriteError("index write failed: disk I/O error")

    monkeypatch.setattr(store_module, "chunk_row", fail)
    monkeypatch.setattr(store_module.Store, "_reap_pending", index_down)
    longer = ids + list(range(500, 600))
    with pytest.raises(StorageWriteError):
        store.save_kv("s", token_ids=longer, fingerprint=FP, chunks=new_chunks(longer))
    monkeypatch.undo()
    assert len(kv_files(home)) > n  # still recorded as this Store's pending files
    with Store(home) as other:  # a live Store's files are not another's to remove
        assert other.debris_removed.files_removed == 0 and len(kv_files(home)) > n
    store.close()
    assert len(kv_files(home)) == n
    with Store(home) as again:
        assert again.load_kv("s").token_ids == ids and again.verify_chunks() == []
