"""A lost index is noticed: gc keeps chunk files it can no longer tell from orphans,
and a read-only home can still be listed and shown."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import text

from chatkv.storage import DiskPolicy, StorageError, StorageWriteError, Store, collect_garbage, enforce_disk_policy

from .conftest import FP, kv_files, new_chunks


def _fill(home: Path) -> list[Path]:
    """Two sessions with KV; returns their chunk files, aged past gc's grace period."""
    with Store(home) as st:
        for sid, base in (("a", 0), ("b", 1000)):
            st.open_session(sid, fingerprint=FP)
            st.append_message(sid, "user", f"hello from {sid}")
            ids = list(range(base, base + 150))
            st.save_kv(sid, token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
    files = kv_files(home)
    old = time.time() - 3600
    for p in files:
        os.utime(p, (old, old))
    return files


def _lose(home: Path, how: str) -> None:
    db = home / "index.db"
    url = os.environ.get("CHATKV_DB_URL")
    if url and how in ("deleted", "truncated"):  # PostgreSQL: the index's tables are dropped
        if how == "truncated":
            pytest.skip("about SQLite index files")
        from sqlalchemy import MetaData, create_engine

        engine = create_engine(url)
        md = MetaData()
        md.reflect(engine)
        md.drop_all(engine)
        engine.dispose()
    elif how == "deleted":
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
    elif how == "truncated":
        db.write_bytes(b"")
    elif how == "emptied":
        with Store(home) as st, st.engine.begin() as conn:
            for table in ("chatkv_session_chunks", "chatkv_messages", "chatkv_chunks", "chatkv_sessions"):
                conn.execute(text(f"DELETE FROM {table}"))
    else:
        raise AssertionError(how)


def _cli(*args: str):
    from chatkv.cli.main import main

    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("how", ["deleted", "truncated", "emptied"])
def test_gc_keeps_chunk_files_when_the_index_looks_lost(home: Path, how: str) -> None:
    files = _fill(home)
    _lose(home, how)
    with Store(home) as st:
        report = collect_garbage(st, dry_run=False, grace_s=0)
        assert kv_files(home) == files  # nothing deleted
        why = st.index_lost()
        assert why and "looks lost" in why and "--force" in why
        assert ("created new" in why) if how != "emptied" else ("no sessions and no chunks" in why)
        assert st.index_created == (how != "emptied")
        assert report.orphans_kept and report.index_lost == why
        assert sorted(report.orphan_files) == files and report.files_removed == 0
        disk = enforce_disk_policy(st, DiskPolicy(kv_ttl_s=0), grace_s=0)
        assert disk.orphans_kept and disk.files_removed == 0 and kv_files(home) == files
        if how != "emptied":
            # a new conversation after the loss saves KV: the old files still are not orphans to gc
            st.open_session("new", fingerprint=FP)
            ids = list(range(5000, 5070))
            st.save_kv("new", token_ids=ids, fingerprint=FP, chunks=new_chunks(ids))
            assert st.index_lost() is not None
            collect_garbage(st, dry_run=False, grace_s=0)
            assert set(files) <= set(kv_files(home))


def test_sessions_gc_refuses_then_force_deletes(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATKV_HOME", str(home))
    files = _fill(home)
    _lose(home, "deleted")
    dry = _cli("sessions", "gc", "--dry-run", "--grace", "0")
    assert dry.exit_code == 0 and "looks lost" in dry.stderr and "(kept: the index looks lost)" in dry.stdout
    res = _cli("sessions", "gc", "--grace", "0")
    assert res.exit_code == 1, res.output
    assert f"kept {len(files)} orphan chunk files" in res.stderr and "chatkv sessions gc --force" in res.stderr
    assert kv_files(home) == files
    forced = _cli("sessions", "gc", "--grace", "0", "--force")
    assert forced.exit_code == 0, forced.output
    assert kv_files(home) == []
    with Store(home) as st:
        assert st.index_lost() is None  # dealt with: the record is cleared
    assert _cli("sessions", "gc", "--grace", "0").exit_code == 0


def test_a_whole_index_still_collects_its_orphans(home: Path) -> None:
    files = _fill(home)
    with Store(home) as st:
        assert not st.index_created and st.index_lost() is None
        orphan = st.write_chunk(list(range(9000, 9010)), new_chunks(list(range(10)))[0].tensors, new_chunks([1])[0].meta)
        report = collect_garbage(st, dry_run=False, grace_s=0)
        assert not report.orphans_kept and report.orphan_files == [st.path_of(orphan)]
    assert kv_files(home) == files


@pytest.mark.sqlite_only
def test_a_zero_filled_index_is_an_error_not_an_empty_store(home: Path) -> None:
    files = _fill(home)
    db = home / "index.db"
    db.write_bytes(b"\0" * db.stat().st_size)
    with pytest.raises(StorageError, match="cannot open the index"):
        Store(home)
    assert kv_files(home) == files


# ---------------------------------------------------------------------------- read-only homes


def _files(home: Path) -> list[tuple[Path, int]]:
    # SQLite's own -wal/-shm files are left out: a read-only connection creates them where it may
    return sorted((p, p.stat().st_mtime_ns) for p in home.rglob("*") if not p.name.endswith(("-wal", "-shm")))


def test_a_read_only_store_writes_nothing(home: Path) -> None:
    _fill(home)
    before = _files(home)
    with Store(home, read_only=True) as st:
        assert st.read_only and {i.id for i in st.list_sessions()} == {"a", "b"}
        assert [m.content for m in st.messages("a")] == ["hello from a"]
        assert st.session_bytes("a").total > 0 and st.get_session("b").n_cached == 150
        with pytest.raises(StorageWriteError):
            st.append_message("a", "user", "more")
        assert st.remove_debris().files_removed == 0
    assert _files(home) == before


def test_a_read_only_home_without_an_index_says_so(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match="no chatkv index|no chatkv tables"):
        Store(tmp_path / "empty", read_only=True)


def _read_only_runner() -> list[str] | None:
    """A command prefix that runs its argument on a read-only view of $HOME_DIR, or None."""
    if os.geteuid() != 0:
        return []  # chmod is enough for a non-root user
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount --bind / /mnt 2>/dev/null; echo ok"],
                           capture_output=True, text=True)
    return ["unshare", "-m"] if probe.returncode == 0 and "ok" in probe.stdout else None


def test_sessions_ls_and_show_work_on_a_read_only_home(home: Path) -> None:
    runner = _read_only_runner()
    if runner is None:
        pytest.skip("cannot make a read-only home here (root without mount namespaces)")
    _fill(home)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in home.rglob("*"))
    env = dict(os.environ)  # CHATKV_DB_URL names the PostgreSQL index, if the test runs on one
    env["CHATKV_HOME"] = str(home)
    cli = f"{sys.executable} -m chatkv.cli.main"
    script = f"{cli} sessions ls && {cli} sessions show a"
    if runner:  # root: a read-only bind mount in a private mount namespace
        cmd = [*runner, "sh", "-c", f"mount --bind '{home}' '{home}' && mount -o remount,bind,ro '{home}' && {script}"]
    else:
        for p in [home, *home.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
        cmd = ["sh", "-c", script]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    finally:
        if not runner:
            for p in [home, *home.rglob("*")]:
                p.chmod(p.stat().st_mode | 0o200)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "a " in res.stdout and "b " in res.stdout and "user: hello from a" in res.stdout
    assert sorted((str(p), p.stat().st_mtime_ns) for p in home.rglob("*")) == before


def test_lost_index_gc_read_only_listing_and_history_only_import_do_not_import_torch(home: Path, tmp_path: Path) -> None:
    files = _fill(home)
    with Store(home) as st:
        bundle = tmp_path / "bundle"
        from chatkv.storage import export_session

        export_session(st, "a", bundle)
    _lose(home, "deleted")
    script = textwrap.dedent(f"""
        import json, sys
        import chatkv.storage as st
        store = st.Store({str(home)!r})
        assert store.index_lost() and st.collect_garbage(store, dry_run=False, grace_s=0).orphans_kept
        info = st.import_session(store, {str(bundle)!r}, with_kv=False)
        assert info.n_messages == 1 and info.n_cached == 0
        store.close()
        ro = st.Store({str(home)!r}, read_only=True)
        assert [i.id for i in ro.list_sessions()] == ["a"]
        print(json.dumps(sorted(sys.modules)))
    """)
    env = dict(os.environ)  # CHATKV_DB_URL names the PostgreSQL index, if the test runs on one
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    heavy = [m for m in json.loads(res.stdout.splitlines()[-1]) if m.split(".")[0] in ("torch", "transformers")
             or m.startswith("safetensors.torch")]
    assert heavy == [] and kv_files(home) == files
